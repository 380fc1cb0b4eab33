"""Per-step overhead on 4 replicas: `run`, a scalar all_reduce, a 1 KiB all_reduce.

Written against TF's API, so the TensorFlow side-by-side runs the same steps:

    strategy = crossdevice.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    strategy.run(fn)
    crossdevice.get_replica_context().all_reduce("sum", x)

Also measured: a step with one `merge_call`, and `ThreadCommunicator.all_reduce` of a
scalar called directly by 4 replica threads (the collective without the strategy).
Each number is the median of `--runs` runs of `--inner` back-to-back steps.

The steps run with the default replica execution (replica threads) and again as
cooperative replicas on the caller's thread
(`crossdevice.config.set_replica_execution("cooperative")`), the rows marked
`cooperative:`. `--torch` imports torch first (the targets hold either way).

    python -m benchmarks.run_overhead --json overhead.json
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

import crossdevice
from benchmarks import _common
from crossdevice._cli.bench.impls import ReplicaThreads
from crossdevice._comm.local.thread import ThreadCommunicator
from crossdevice._sync import waiting

#: The issue's targets, microseconds (TF measured 10-25x slower).
TARGETS_US = {"run_trivial": 100.0, "run_scalar_all_reduce": 200.0, "run_1KiB_all_reduce": 150.0}


def trivial() -> Any:
    return np.float32(1.0)


def scalar_step() -> Any:
    return crossdevice.get_replica_context().all_reduce("sum", np.float32(1.0))


ONE_KIB = np.ones(256, np.float32)


def kib_step() -> Any:
    return crossdevice.get_replica_context().all_reduce("sum", ONE_KIB)


def merge_step() -> Any:
    return crossdevice.get_replica_context().merge_call(lambda strategy: 1)


def main() -> None:
    p = _common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--inner", type=int, default=200, help="steps per timed run (200)")
    p.add_argument("--torch", action="store_true", help="import torch first")
    args = p.parse_args()
    if args.torch:
        import torch  # noqa: F401  (imported for its effect: torch's thread state is carried)
    devices = _common.setup_devices()
    strategy = crossdevice.MirroredStrategy(devices)
    results: dict[str, Any] = {}
    steps = {
        "run_trivial": trivial,
        "run_scalar_all_reduce": scalar_step,
        "run_1KiB_all_reduce": kib_step,
        "run_merge_call": merge_step,
    }
    default = crossdevice.config.get_replica_execution()
    for mode in (default, "cooperative"):
        crossdevice.config.set_replica_execution(mode)  # type: ignore[arg-type]
        prefix = "" if mode == default else f"{mode}:"
        for name, fn in steps.items():
            seconds, _ = _common.median_seconds(
                lambda fn=fn: strategy.run(fn), args.runs, args.inner, warmup=20
            )
            results[f"{prefix}{name}_us"] = seconds * 1e6
    crossdevice.config.set_replica_execution(default)  # type: ignore[arg-type]
    n = _common.REPLICAS
    threads = ReplicaThreads(n)
    comm = ThreadCommunicator(n, name="overhead-bench")
    scalar = [np.float32(1.0)]
    try:
        seconds, _ = _common.replica_median_seconds(
            threads,
            lambda r: comm.all_reduce(r, scalar, "sum", timeout=60),
            args.runs,
            args.inner,
            warmup=20,
        )
    finally:
        threads.close()
    results["communicator_scalar_all_reduce_us"] = seconds * 1e6
    print(
        f"per-step overhead, {n} replicas (median of {args.runs} x {args.inner} steps; default "
        f"replica execution {default!r}; "
        f"cooperative replicas available: {waiting.available()}, torch imported: "
        f"{'torch' in sys.modules}):"
    )
    for key, value in results.items():
        target = TARGETS_US.get(key[:-3])
        note = f"  (target <= {target:.0f} us)" if target else ""
        print(f"  {key[:-3]:>34}: {value:8.1f} us{note}")
    _common.report(args, results)


if __name__ == "__main__":
    main()
