"""`DeviceCommunicator`: collectives whose peers are the devices of this process.

One replica thread per device (a GPU, or any device the algorithms take) calls the same
collectives in the same order, each with its value on its own device; every call is a
round of a `Rendezvous`, and the last replica to arrive runs the per-device algorithm
for everybody (`algorithms.py`):

* all-reduce: reduce to the first device (one NCCL reduce when the values are CUDA
  tensors on distinct GPUs, else the in-order sum there), then broadcast to every
  device (one NCCL broadcast between GPUs);
* all-gather: gather to the first device, concatenate, broadcast;
* broadcast: from the root's device to every device.

Each replica gets its result on its own device. The arrivals are validated as the
replica threads' are (`local/arrivals.py`): the same call, reduce op, structure, shapes
and dtypes everywhere, else a ValueError in every replica naming each one's call. It is
the `devices` place of the one `Communicator` protocol (through `participant`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from crossdevice._arrays import backend_for, is_torch
from crossdevice._arrays.handout import hand_out_each
from crossdevice._comm.devices import algorithms
from crossdevice._comm.local.arrivals import CollectiveArrival, validate
from crossdevice._comm.local.participant import Participant
from crossdevice._core.devices import canonicalize
from crossdevice._core.reduce_op import ReduceOp, as_reduce_op
from crossdevice._sync.call import describe_leaves
from crossdevice._sync.rendezvous import Rendezvous
from crossdevice._sync.rounds import Round

__all__ = ["DeviceCommunicator"]


class DeviceCommunicator:
    """Collectives among the devices of this process, one replica thread each.

    Args:
        devices: the replicas' devices, in replica order (device strings).
        name: a name for error messages.
        rendezvous: the rendezvous the replicas meet in (None makes one).
    """

    def __init__(
        self,
        devices: Sequence[str],
        name: str = "DeviceCommunicator",
        rendezvous: Rendezvous | None = None,
    ) -> None:
        self._devices = tuple(canonicalize(d) for d in devices)
        self._name = name
        self._rendezvous = rendezvous or Rendezvous(len(self._devices), name)

    @property
    def num_replicas(self) -> int:
        """How many devices (replicas) take part."""
        return len(self._devices)

    @property
    def devices(self) -> tuple[str, ...]:
        """The replicas' canonical devices, in replica order."""
        return self._devices

    @property
    def rendezvous(self) -> Rendezvous:
        """The rendezvous the replicas meet in."""
        return self._rendezvous

    def participant(self, replica_id: int) -> Participant:
        """Replica `replica_id` of this communicator, as a `Communicator` (the protocol)."""
        if not 0 <= replica_id < self.num_replicas:
            raise ValueError(
                f"{self._name}: replica_id must be in [0, {self.num_replicas}), "
                f"received {replica_id!r}"
            )
        return Participant(self, replica_id)

    def abort(self, exc: BaseException) -> None:
        """Release every waiting replica with `ReplicaAbortedError` (`Rendezvous.abort`)."""
        self._rendezvous.abort(exc)

    def __repr__(self) -> str:
        return f"DeviceCommunicator({list(self._devices)!r}, name={self._name!r})"

    # -- collectives (each replica with its own id) -------------------------------------

    def all_reduce(
        self,
        replica_id: int,
        arrays: Sequence[Any],
        reduce_op: ReduceOp | str,
        timeout: float | None = None,
        structure: Any = None,
    ) -> list[Any]:
        """Reduce each array across the devices; each replica gets the results on its own."""
        arrival = self._arrival("all_reduce", list(arrays), as_reduce_op(reduce_op))
        arrival.structure = structure
        return self._rendezvous.arrive(replica_id, arrival, timeout)

    def all_gather(
        self,
        replica_id: int,
        array: Any,
        axis: int = 0,
        timeout: float | None = None,
        structure: Any = None,
    ) -> Any:
        """Concatenate every replica's `array` along `axis`, in replica order."""
        arrival = self._arrival("all_gather", [array], None)
        arrival.extra, arrival.structure = axis, structure
        return self._rendezvous.arrive(replica_id, arrival, timeout)[0]

    def broadcast(
        self, replica_id: int, array: Any, root: int = 0, timeout: float | None = None
    ) -> Any:
        """Every replica gets replica `root`'s `array`, on its own device."""
        arrival = self._arrival("broadcast", [] if array is None else [array], None)
        arrival.extra = root
        return self._rendezvous.arrive(replica_id, arrival, timeout)[0]

    def _arrival(self, kind: str, values: list[Any], op: ReduceOp | None) -> CollectiveArrival:
        sig = tuple((backend_for(v).shape(v), backend_for(v).dtype_name(v)) for v in values)
        mask = tuple(is_torch(v) for v in values)
        return CollectiveArrival(kind, values, None, sig, mask, op, handler=self)

    # -- rounds (the rendezvous' Handler) -----------------------------------------------

    def describe(self, arrival: CollectiveArrival) -> str:
        """What `arrival` asked for, as error messages show it."""
        leaves = describe_leaves(arrival.sig, arrival.structure)
        if arrival.kind == "all_reduce":
            return f"all_reduce({arrival.op.name if arrival.op else None}, {leaves})"
        return f"{arrival.kind}({arrival.extra!r}, {leaves if arrival.values else None})"

    def complete(self, rnd: Round, replica_id: int) -> None:
        """Run by the last arriver: validate, then the per-device algorithm for everyone."""
        del replica_id
        arrivals: list[CollectiveArrival] = rnd.arrivals
        error = validate(rnd, arrivals)
        if error is not None:
            rnd.set_error(ValueError, error)
            return
        first, devices = arrivals[0], self._devices
        if first.kind == "all_reduce":
            op = first.op or ReduceOp.SUM
            per_leaf = [
                self._everywhere(
                    algorithms.reduce_to_one([a.values[i] for a in arrivals], devices[0], op)
                )
                for i in range(len(first.values))
            ]
            rnd.results = [[leaf[r] for leaf in per_leaf] for r in range(len(devices))]
        elif first.kind == "all_gather":
            column = [a.values[0] for a in arrivals]
            total = algorithms.gather_to_one(column, devices[0], first.extra)
            rnd.results = [[x] for x in self._everywhere(total)]
        else:
            source = arrivals[first.extra].values[0]
            copy = backend_for(source).copy(source)  # never the root's input itself
            rnd.results = [[x] for x in self._everywhere(copy)]

    def _everywhere(self, value: Any) -> list[Any]:
        """A computed `value` on every replica's device, handed out once to each."""
        return hand_out_each(algorithms.broadcast(value, self._devices))

    def finalize(self, rnd: Round) -> None:
        """Nothing: every result is made in `complete`."""
        del rnd

    def result(self, rnd: Round, replica_id: int) -> list[Any]:
        """Replica `replica_id`'s results, on its device."""
        return list(rnd.results[replica_id])
