"""`TUNING`: every byte, second and worker-count threshold of the library, in one frozen object.

Each threshold is a field with its default, the reason for it, and the benchmark (or the
measurement) that chose it: `reason(name)` and `benchmark(name)` read them back. Code reads
`tuning.TUNING.<field>` at the moment it decides (never a copy taken at import), so one
`overridden(...)` reaches every module alike:

    with tuning.overridden(shared_work_min_bytes=0):   # tests: force the sharded path
        ...

Not here: sizes fixed by a format (a fingerprint's 672-byte header, a shared-memory
segment's layout and its 8 MiB slots), bounds on hostile input (`MAX_PEER_BYTES`,
`MAX_TF_CONFIG_BYTES`), hardware constants (a 64-byte cache line), and bounds derived
from a field where they are used (a heartbeat thread joined within two publish intervals
and a second). Measurements quoted are from the 2-core AMD EPYC dev VM (32 MiB L3) unless
said otherwise; the torch training layer keeps its own bucket sizes (`_frameworks/torch`:
DDP's defaults, a user's choice).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = ["TUNING", "Tuning", "benchmark", "overridden", "reason", "set_tuning"]

KiB = 1024
MiB = 1024 * 1024


def _knob(default: Any, reason: str, benchmark: str) -> Any:
    return dataclasses.field(default=default, metadata={"reason": reason, "benchmark": benchmark})


@dataclasses.dataclass(frozen=True, slots=True)
class Tuning:
    """The thresholds (bytes, seconds, workers); see each field's `reason` and `benchmark`."""

    # --- host sums (_arrays) ----------------------------------------------------------
    block_bytes: int = _knob(
        512 * KiB,
        "Bytes of one accumulator block. 4 x 64 MiB float32, one thread: 64 KiB blocks 17.2 "
        "ms, 256 KiB 14.5 ms, 512 KiB 12.9 ms (naive chain 14.4 ms); at 1 MiB the "
        "accumulator block and one input block no longer fit in L2.",
        "python -m benchmarks.allreduce_limit (minima of 11 runs)",
    )
    blocked_min_bytes: int = _knob(
        8 * MiB,
        "Below this many bytes per input the plain in-order chain runs: one core's adds, "
        "not DRAM, bound it while the operands fit in L3 (4 float32 inputs: 4 MiB chain "
        "467 us vs blocked 527 us; 64 MiB 14.4 vs 12.9 ms).",
        "python -m benchmarks.allreduce_limit",
    )
    native_min_bytes: int = _knob(
        64 * KiB,
        "Ranges this large take the compiled fused kernel: below it the ~5 us of a ctypes "
        "call is not worth saving NumPy's two or three ufunc calls on data in cache.",
        "crossdevice bench -b 1K -e 1M -f 2",
    )
    kernel_parallel_min_bytes: int = _knob(
        8 * MiB,
        "Below this many bytes per input a host sum runs in the calling thread only; the "
        "worker pool costs a wake-up and a join (4 float32 inputs: 4 MiB 0.63 vs 0.74 ms; "
        "8 MiB 1.67 vs 1.58 ms; 16 MiB 3.81 vs 2.96 ms).",
        "crossdevice bench --ops reduce_to_one -b 1M -e 64M",
    )
    stream_min_bytes: int = _knob(
        16 * MiB,
        "Results this large are written with non-temporal stores: they cannot stay in the "
        "32 MiB L3 anyway, so skipping the read-for-ownership is pure gain.",
        "python -m benchmarks.allreduce_limit",
    )
    # --- replica threads' all-reduce (_comm/local) ------------------------------------
    shared_work_min_bytes: int = _knob(
        8 * MiB,
        "Rounds with fewer bytes per replica are computed by the last arriver alone; from "
        "here every replica reduces pieces (4 replicas, float32: 4 MiB one-thread 1181 us "
        "vs sharded 1071 us; 16 MiB 4.69 vs 3.30 ms; 1 MiB 360 vs 531 us).",
        "crossdevice bench --ops sharded -b 1M -e 64M",
    )
    piece_min_bytes: int = _knob(
        256 * KiB,
        "Smallest piece of a shared round: the ~10 us of Python per piece stays below 1% of "
        "its time.",
        "crossdevice bench --ops sharded -b 8M -e 256M",
    )
    piece_max_bytes: int = _knob(
        4 * MiB,
        "Largest piece of a shared round: small enough to balance four replicas on two busy cores.",
        "crossdevice bench --ops sharded -b 8M -e 256M",
    )
    pack_below_bytes: int = _knob(
        16 * KiB,
        "Arrays smaller than this are packed per replica into one flat buffer per dtype "
        "(160 x 1 KiB: unpacked 1274 us, packed below 16 KiB 549 us, below 64 KiB 675 us; "
        "50 x 8 KiB: 602 / 667 / 656 us).",
        "python -m benchmarks.batch_reduce",
    )
    pool_min_bytes: int = _knob(
        1 * MiB,
        "Output buffers this large are recycled once no result views them: a fresh large "
        "allocation is zero-filled page by page on first touch (the first all-reduce of "
        "198 MB took 0.74 s, 50 ms with a recycled buffer).",
        "python -m benchmarks.batch_reduce",
    )
    # --- cross-worker all-reduce (_comm/workers, _cross_device/collective) -------------
    donate_min_bytes: int = _knob(
        1 * MiB,
        "Local sums this large are reduced across workers where they lie instead of being "
        "packed: packing copies them once more (+37% over a raw 1 MiB all-reduce on 2 "
        "workers, against +3.6% donated), while it saves ~10 us per collective.",
        "python -m benchmarks.user_path_allreduce",
    )
    ring_min_bytes: int = _knob(
        4 * MiB,
        "Host all-reduces this large go through the out-of-place ring (send and receive "
        "over Gloo's pairs, sums in rank order, inputs never copied): on 2 workers it took "
        "0.91-0.99x a raw in-place Gloo all-reduce from 4 MiB, where copy-then-reduce took "
        "1.17-1.33x; below, its two phases' extra wake-ups cost more than the copy.",
        "python -m benchmarks.user_path_allreduce",
    )
    ring_piece_bytes: int = _knob(
        4 * MiB,
        "The ring sums and forwards a rank's chunk in pieces of at most this many bytes, so "
        "the sum of one piece overlaps the transfer of the next; each piece costs four more "
        "point-to-point ops. On 2 workers, since a lone peer's pieces land in the output "
        "and are summed there (4 paired runs of 41 rounds): 16 MiB 0.91-1.01x raw with 4 "
        "MiB pieces against 0.95-1.08x with 8 MiB ones, 32 MiB 0.96-0.98x against "
        "1.00-1.09x, 64 MiB 0.94-0.95x either way; 2 MiB pieces 0.98-1.06x. (Before: 8 MiB "
        "pieces 1.01-1.08x at 16-64 MiB, 1 MiB pieces 1.14-1.37x, unsplit 1.03-1.23x.)",
        "python -m benchmarks.user_path_allreduce --sizes 16M 32M 64M --tuning ring_piece_bytes=8M",
    )
    direct_max_workers: int = _knob(
        2,
        "With this many workers or fewer, host all-reduces of direct_min_bytes up to "
        "direct_max_bytes are exchanged whole: each worker sends its input to every peer "
        "and sums them all in rank order (one phase, no all-gather, no copy; on 2 workers "
        "the ring's bytes, on n (n-1)/2 times them). 2 workers, user path, interleaved "
        "in one process: 1 MiB 1.42-1.46 ms exchanged against 1.54-1.65 ms copied and "
        "reduced in place by Gloo; 476 KiB 1.07-1.11 against 1.13-1.19 ms.",
        "python -m benchmarks.user_path_allreduce --tuning direct_max_workers=1",
    )
    direct_min_bytes: int = _knob(
        1,
        "Smallest all-reduce exchanged whole (see direct_max_workers): every one, since "
        "the header rides behind the data below header_fold_max_bytes (one message per "
        "peer). The user path's medians, 2 workers, 3 runs each (16 KiB: 6) alternating "
        "with 256 KiB here (Gloo's in-place all-reduce below it): 4 B 0.59-0.66 ms against "
        "0.61-1.44 ms, 1 KiB 0.67-0.71 against 0.70-0.82, 4 KiB 0.55-0.94 against "
        "0.70-0.73, 16 KiB 0.58-0.78 against 0.70-0.81, 64 KiB 0.65-0.68 against "
        "0.66-0.79, 128 KiB 0.71-0.83 against 0.64-0.92. (With the header apart, 64 KiB "
        "took 0.76-0.78 ms exchanged against 0.72-0.74 in place: then the limit was "
        "256 KiB.)",
        "python -m benchmarks.user_path_allreduce --sizes 4 1K 4K 16K 64K 128K "
        "--tuning direct_min_bytes=256K",
    )
    direct_max_bytes: int = _knob(
        8 * MiB,
        "From this size the ring takes over from the whole exchange (see "
        "direct_max_workers): each worker then sums only its chunk, and the sums overlap "
        "the transfers piece by piece. 4 MiB: 3.33 ms exchanged, 3.23 ms by the ring; "
        "16 MiB: 13.5 ms against 11.8 ms.",
        "python -m benchmarks.user_path_allreduce --tuning direct_max_bytes=1G",
    )
    header_fold_max_bytes: int = _knob(
        1 * MiB,
        "A whole exchange (see direct_max_workers) whose first buffer is one piece smaller "
        "than this carries the inline header behind that buffer: one point-to-point "
        "message per peer instead of two. A buffer without room behind it (a user's "
        "tensor; a strategy's packs have room) is copied into one that has, which costs "
        "more than the message it saves from 1 MiB. 2 workers, fold against header apart "
        "in one process, interleaved: training path (476 KiB pack, 300-400 rounds, 5 "
        "runs) 0.96-0.97x in 4, 1.01x in 1; user path (101 rounds, 2 runs) 256 KiB 0.91x, "
        "512 KiB 0.94-0.98x, 768 KiB 0.94-0.95x, 1 MiB 1.00-1.07x, 4 MiB 1.03-1.06x.",
        "python -m benchmarks.user_path_allreduce --sizes 256K 512K 1M "
        "--tuning header_fold_max_bytes=1",
    )
    queue_min_bytes: int = _knob(
        0,
        "Gradient buckets (`crossdevice.torch`, one replica per worker) this large that "
        "travel through Gloo are issued on the communicator's queue thread "
        "(`_comm/workers/callqueue.py`), so packing and sending them, and completing the "
        "bucket before, leave backward running; smaller ones, and any that travel through "
        "shared memory, are issued by the backward hook itself. Every size: on the 2-core "
        "host the tutorial CNN's epoch (one 476 KiB bucket) took 0.89-0.92x DDP's time "
        "at 8 examples per worker queued against 1.04-1.11x from the hook (5 launches "
        "each; 0.96-1.00x with DDP against itself in the turns too), 0.96-1.06x against "
        "1.01-1.07x at 32 and 128; an MLP with 256 MiB of "
        "gradients in 4 buckets 0.98-1.11x against 1.05-1.17x (4), 64 MiB 1.02-1.04x "
        "against 1.03-1.05x (3), one 8 MiB bucket alike (3). Through shared memory the "
        "hook was faster: the CNN at 8 per worker 0.66-0.67x DDP against 0.70-0.73x queued "
        "(2 launches each).",
        "python -m benchmarks.multi_worker_epoch --variants gloo ddp "
        "--tuning queue_min_bytes=4611686018427387904",
    )
    pass_max_bytes: int = _knob(
        128 * MiB,
        "A backward pass's gradient buckets (`crossdevice.torch`, one replica per worker, "
        "through Gloo) up to this many bytes in all travel as one all-reduce, each bucket "
        "leaving as backward completes it (`_frameworks/torch/pass_reduce.py`); larger ones "
        "go one by one. One all-reduce saves a round trip per bucket but sums every bucket "
        "after backward, where one by one the queue's thread sums the earlier ones during "
        "it. 2 workers, 2-core host, pass/DDP against one-by-one/DDP (two launches each, "
        "alternating): the CNN in 64 KiB buckets 0.92-0.98 against 1.64-1.67 at 8 per "
        "worker, 1.05-1.09 against 1.17-1.25 at 128; MLPs in 25 MiB buckets, 64 MiB "
        "0.965, 0.975 against 1.045, 1.030; 128 MiB 1.021, 1.039 against 1.038, 1.032; "
        "256 MiB 1.29, 1.19, 1.23 against 1.21, 1.16, 1.09 (three each).",
        "python -m benchmarks.multi_worker_mlp --width 2896 --bucket-cap 25M "
        "(CROSSDEVICE_PASS_ALL_REDUCE=0 against it)",
    )
    header_apart_min_bytes: int = _knob(
        8 * MiB,
        "A first buffer this large carries no inline header behind it: the header travels "
        "in a small all-reduce of its own so the buffer is reduced where it lies; a copy "
        "costs 10-38% of the all-reduce of its bytes, the extra op ~0.4 ms.",
        "python -m tests.multi_worker.bench_all_reduce",
    )
    pipeline_min_bytes: int = _knob(
        48 * MiB,
        "In-place Gloo all-reduces this large go in chunks sent as they are filled (copy "
        "then all-reduce of 64 MiB: +38% whole, +16% in 32 MiB chunks, +31-36% in 4-8 MiB "
        "chunks, per-op costs).",
        "python -m tests.multi_worker.bench_all_reduce",
    )
    chunk_bytes: int = _knob(
        32 * MiB,
        "The chunk of a pipelined in-place all-reduce (see pipeline_min_bytes).",
        "python -m tests.multi_worker.bench_all_reduce",
    )
    shared_memory_min_bytes: int = _knob(
        0,
        "Smallest all-reduce sent through shared memory (env "
        "CROSSDEVICE_SHARED_MEMORY_MIN_BYTES overrides it): a shared round of 4 B to 64 KiB "
        "took 0.12-0.17 ms against 1.4 ms on Gloo (2 workers), so every one goes there.",
        "crossdevice bench --multi-worker -b 4 -e 64K",
    )
    # --- waits (seconds) --------------------------------------------------------------
    poll_seconds: float = _knob(
        0.25,
        "How long one wait on a process group's work (or a shared round) lasts before the "
        "store is consulted about failed and dead peers; work that completes in time pays "
        "nothing extra.",
        "tests/multi_worker/test_fault_matrix.py (a failed peer is named within seconds)",
    )
    min_wait_seconds: float = _knob(
        0.005,
        "Shortest wait asked of a work: c10d counts whole milliseconds and 0 ms means the "
        "group's own timeout (a 0.27 ms wait blocked until Gloo's timeout).",
        "measured by hand: work.wait(timedelta(seconds=0.00027))",
    )
    default_timeout_seconds: float = _knob(
        600.0,
        "Bound on every cross-worker collective when CommunicationOptions.timeout_seconds is "
        "None (NCCL's watchdog default is 10 min); dead workers are named far sooner.",
        "policy (NCCL's default), not a measurement",
    )
    default_init_timeout_seconds: float = _knob(
        300.0,
        "How long constructing a communicator waits for every worker at the rendezvous: "
        "workers start minutes apart on busy clusters (TF waits for ever, torch 30 min).",
        "policy, not a measurement",
    )
    backstop_slack_seconds: float = _knob(
        1.0,
        "The process groups time out this much after our own wait, which names the missing "
        "ranks; Gloo's timeout then clears its pending work.",
        "tests/multi_worker/test_strategy.py::test_missing_worker_times_out_naming_the_collective",
    )
    startup_probe_seconds: float = _knob(
        1.0,
        "How often a worker, while torch starts its groups, asks the c10d store whether it "
        "still answers (a frozen store host leaves torch waiting for ever): one question a "
        "second per worker loads a store server serving thousands of clients no more than "
        "the heartbeats do.",
        "tests/multi_worker/test_fault_matrix.py::test_frozen_store_host_at_start_is_named",
    )
    diagnosis_store_timeout_seconds: float = _knob(
        2.0,
        "Bound on each c10d store read while diagnosing a failure.",
        "tests/multi_worker/test_fault_matrix.py::test_lost_worker_is_named",
    )
    publish_seconds: float = _knob(
        0.05,
        "How often the health thread looks at this worker's arrival mark, and publishes it "
        "once it stood still for a whole look (a worker stuck in a collective): publishing "
        "before every collective cost 30 us a call (a store set wakes the store's server "
        "thread), and publishing every look 0.66 store round trips a training step.",
        "python -m tests.multi_worker.bench_all_reduce",
    )
    heartbeat_seconds: float = _knob(
        0.5,
        "How often a worker's heartbeat advances in the store.",
        "tests/multi_worker/test_fault_matrix.py::test_lost_worker_is_named",
    )
    dead_after_seconds: float = _knob(
        5.0,
        "A heartbeat that has not moved for this long means a dead worker: ten missed beats "
        "(a loaded 2-core host delayed a beat by up to 1.2 s in the fault campaign).",
        "tests/multi_worker/test_fault_matrix.py::test_lost_worker_is_named",
    )
    local_merge_slack_seconds: float = _knob(
        15.0,
        "Local replicas wait at a merge this much longer than the cross-worker timeout, so "
        "the cross-worker error (naming the missing ranks) is the one raised.",
        "tests/multi_worker/test_strategy.py::test_missing_worker_times_out_naming_the_collective",
    )
    interrupt_grace_seconds: float = _knob(
        0.5,
        "How long the caller waits for replicas still inside fn after Ctrl-C before it "
        "abandons them: released replicas leave in microseconds.",
        "tests/strategies/test_lifecycle.py (interrupt tests)",
    )
    recover_wait_seconds: float = _knob(
        1.0,
        "How long a run waits for the replicas an interrupted run abandoned before it says "
        "why it cannot start.",
        "tests/strategies/test_lifecycle.py (interrupt tests)",
    )
    recover_poll_seconds: float = _knob(
        0.005,
        "How often a run looks whether the replicas an interrupted run abandoned have left.",
        "tests/strategies/test_lifecycle.py (interrupt tests)",
    )
    done_poll_seconds: float = _knob(
        0.1,
        "How often the caller, waiting for the other replicas, looks whether it was interrupted.",
        "tests/strategies/test_lifecycle.py (interrupt tests)",
    )
    close_join_seconds: float = _knob(
        1.0,
        "How long close() waits for a run in flight on another thread to finish, and then "
        "for the replica threads to end (idle ones end in microseconds).",
        "tests/strategies/test_lifecycle.py",
    )
    stall_poll_seconds: float = _knob(
        0.05,
        "How long the cooperative scheduler sleeps at most, when every replica waits for a "
        "deadline, before it looks again for a gate another thread released.",
        "tests/strategies/test_cooperative.py",
    )
    auto_try_below_seconds: float = _knob(
        1e-3,
        "Replica execution 'auto' tries a step function cooperatively only when its "
        "threaded runs took less than this: above a millisecond the thread hand-offs "
        "(tens of microseconds a step) cannot be what makes a step slow.",
        "python -m benchmarks.run_overhead",
    )
    buffer_pool_max_bytes: int = _knob(
        2 * 1024 * MiB,
        "Bytes of recycled large output buffers kept in all (per pool): enough for the "
        "results of a few 64 MiB-per-replica rounds, bounded so that a run of ever-new "
        "shapes cannot grow the process without end.",
        "tests/collectives (buffer pool tests)",
    )
    heap_mmap_threshold_bytes: int = _knob(
        32 * MiB,
        "A training process (`crossdevice.torch.prepare`, `_arrays/heap.py`) takes blocks "
        "below this from glibc's heap, not each from a mapping of its own that is unmapped "
        "when freed: glibc's own ceiling for it on 64-bit, which its moving threshold "
        "reaches anyway after a step frees such a block.",
        "python -m benchmarks.multi_worker_epoch (with CROSSDEVICE_KEEP_HEAP=0 against it)",
    )
    heap_trim_threshold_bytes: int = _knob(
        1024 * MiB,
        "A training process keeps up to this much free memory at the top of glibc's heap "
        "for its next step instead of handing it back at every free: the TF tutorial CNN "
        "frees 10-40 MiB there each step at 128 examples, and each page handed back "
        "costs a zero-filling fault when the next step takes it again.",
        "python -m benchmarks.multi_worker_epoch (with CROSSDEVICE_KEEP_HEAP=0 against it)",
    )
    # --- checkpoints and preemption (_train) ------------------------------------------
    checkpoint_write_timeout_seconds: float = _knob(
        1800.0,
        "The longest a save waits for the previous checkpoint's write: several GB on a slow "
        "disk, with room; a write that takes longer is reported, not waited on for ever.",
        "python -m benchmarks.checkpoint_stall (1.08 s for 25M parameters)",
    )
    preemption_watch_seconds: float = _knob(
        1.0,
        "How often a termination_watcher_fn is polled (TF's interval).",
        "TF's PreemptionCheckpointHandler",
    )
    preemption_agree_seconds: float = _knob(
        0.2,
        "Workers agree on termination notices about this often (every step, for longer "
        "steps): one agreement cost 1.4 ms on a loaded 2-core host, 130% of a trivial "
        "2-worker run, so short steps share one; a notice waits at most about this long.",
        "tests/train/test_preemption.py",
    )


#: The thresholds in force. Replace it with `set_tuning` or `overridden`, never in place.
TUNING: Tuning = Tuning()


def set_tuning(**changes: Any) -> Tuning:
    """Replace fields of `TUNING` for the whole process; returns the previous object.

    Raises:
        TypeError: a name that is no threshold (naming the ones there are).
    """
    global TUNING
    previous = TUNING
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Tuning)})
    if unknown:
        raise TypeError(
            f"no such tuning threshold: {unknown}; expected names from "
            f"{[f.name for f in dataclasses.fields(Tuning)]}"
        )
    TUNING = dataclasses.replace(previous, **changes)
    return previous


@contextlib.contextmanager
def overridden(**changes: Any) -> Iterator[Tuning]:
    """`set_tuning(**changes)` for the duration of a `with` block, then the previous values."""
    global TUNING
    previous = set_tuning(**changes)
    try:
        yield TUNING
    finally:
        TUNING = previous


def reason(name: str) -> str:
    """Why the threshold `name` has its value."""
    return str(_field(name).metadata["reason"])


def benchmark(name: str) -> str:
    """The benchmark (or measurement) that chose the threshold `name`."""
    return str(_field(name).metadata["benchmark"])


def _field(name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(Tuning):
        if f.name == name:
            return f
    raise KeyError(f"no tuning threshold named {name!r}")
