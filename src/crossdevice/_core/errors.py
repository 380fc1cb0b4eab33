"""Exceptions and shared error messages.

crossdevice raises the exception types TensorFlow raises for the same misuse, so that
ported `except` clauses keep working:

    Exception
    ├── ValueError          bad values, devices, structures, axes, reduce ops
    │   ├── ArgumentAssertionError   (also AssertionError) where TF asserts on an argument
    │   └── StructureMismatchError   (also AssertionError) replicas' structures differ
    ├── TypeError           wrong kinds of arguments (a reduce op that is no ReduceOp)
    ├── RuntimeError        wrong context (cross-replica API in a replica), mixing strategies,
    │   │                   mismatched merge_call counts
    │   ├── CollectiveTimeoutError   a rendezvous or collective outlived timeout_seconds
    │   └── WorkerFailedError        a peer worker failed in its step or died
    ├── ValueError
    │   └── CollectiveMismatchError  workers called different collectives (kind, op,
    │                                dtype, shape, order, structure, replica count)
    └── NotImplementedError features TF itself does not offer (IndexedSlices)

`CollectiveTimeoutError` is also a `TimeoutError`, TF's DeadlineExceededError counterpart.
"""

from __future__ import annotations

__all__ = [
    "CROSS_REPLICA_REQUIRED",
    "ArgumentAssertionError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ReplicaAbortedError",
    "StructureMismatchError",
    "WorkerFailedError",
]

CROSS_REPLICA_REQUIRED = (
    "Method requires being in cross-replica context, use get_replica_context().merge_call()"
)


class CollectiveTimeoutError(RuntimeError, TimeoutError):
    """A rendezvous or collective did not complete within `timeout_seconds`.

    The message names the collective, its sequence number and the replicas or ranks
    that did not arrive.
    """


class CollectiveMismatchError(ValueError):
    """Workers are about to run collectives that do not match; no data has moved.

    Every cross-worker collective of `MultiWorkerMirroredStrategy` carries a fingerprint
    (sequence number, kind, reduce op, dtypes, byte count, shapes, value structure,
    local replica count). The fingerprints are compared on every worker before any data
    moves; when they differ, every worker raises this error with each worker's
    fingerprint and the fields that differ, instead of summing unrelated buffers.

    Example::

        try:
            strategy.run(step)
        except crossdevice.CollectiveMismatchError as err:
            print(err)  # rank 0: all_reduce #7 sum float32 (2, 3) ... differ: shapes
    """


class WorkerFailedError(RuntimeError):
    """A peer worker failed in its step, or died, while this worker waited for it.

    The message names the worker (rank and global replica ids) and, when it raised,
    its exception type. The collective group is unusable afterwards (every worker must
    build a new strategy), as TF's collectives are after a peer's failure.
    """


class ReplicaAbortedError(BaseException):
    """Raised inside a replica thread to release it after a peer failed.

    It derives from BaseException so that a user's `except Exception` in a step function
    cannot swallow it; it never reaches the caller of `run`, which gets the original error.
    """


class ArgumentAssertionError(ValueError, AssertionError):
    """A bad argument where TF raises AssertionError (duplicate devices, list destinations).

    It is also a ValueError, which is what it is: `except AssertionError` in ported code
    and `except ValueError` in new code both catch it.
    """


class StructureMismatchError(ValueError, AssertionError):
    """Replicas gave differently structured values (results, merge_call or input batches).

    TF's `regroup` asserts (AssertionError); the message here names both structures. It
    is also a ValueError, so `except AssertionError` (ported code) and `except ValueError`
    both catch it.
    """
