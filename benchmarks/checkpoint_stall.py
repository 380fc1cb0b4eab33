"""How long a checkpoint save stalls training: a 25M-parameter model with Adam's state.

`CheckpointManager.save()` returns once the state is staged (one in-memory copy, into
buffers kept from the previous save); the file write runs on a background thread. The
issue's target: the stall is at most the time of one in-memory copy of the state. Each
round times, interleaved:

* `copy`: one in-memory copy of the state (model and optimizer tensors) into fresh
  tensors (`clone`), the target's yardstick; and `copy into buffers` (`copy_` into
  tensors allocated once), what staging does once its buffers exist;
* `save stall`: the time `manager.save()` takes to return (staging, the index, the
  collectives of a save, starting the writer);
* `write`: from `save()` returning to the checkpoint being durable (`sync()`), off the
  training thread;
* `step` and `step while writing`: a training step alone, and while a write is in flight.

The model: 4 Linear(2500, 2500) layers mirrored on one CPU replica with
`crossdevice.torch.prepare`, trained by Adam (25.0M parameters, 300 MB of state).

    python -m benchmarks.checkpoint_stall --json stall.json
"""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

from benchmarks import _common

WIDTH = 2500
LAYERS = 4
BATCH = 32


def build(crossdevice: Any, torch: Any) -> tuple[Any, Any, Any, Any]:
    """The strategy, mirrored model, optimizer and one training step."""
    import crossdevice.torch as cdt

    strategy = crossdevice.MirroredStrategy(["CPU:0"])
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        model, optimizer = cdt.prepare(model, optimizer)
    x = torch.randn(BATCH, WIDTH)

    def step() -> None:
        def replica() -> None:
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()

        strategy.run(replica)

    return strategy, model, optimizer, step


def state_tensors(model: Any, optimizer: Any) -> list[Any]:
    """Every tensor of the model's and the optimizer's state."""
    tensors = list(model.state_dict().values())
    for per_param in optimizer.state_dict()["state"].values():
        tensors += [v for v in per_param.values() if hasattr(v, "clone")]
    return tensors


def main() -> None:
    import torch

    import crossdevice

    p = _common.parser(__doc__.split("\n\n")[0])
    p.set_defaults(runs=5)
    args = p.parse_args()
    _, model, optimizer, step = build(crossdevice, torch)
    step()  # Adam's state exists from the first step
    tensors = state_tensors(model, optimizer)
    params = sum(t.numel() for t in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"model: {params / 1e6:.1f}M parameters; state {state_bytes / 2**20:.0f} MiB")
    buffers = [t.clone() for t in tensors]
    times: dict[str, list[float]] = {
        k: [] for k in ("copy", "copy_into", "stall", "write", "step", "step_writing")
    }
    with tempfile.TemporaryDirectory() as directory:
        ckpt = crossdevice.train.Checkpoint(model=model, optimizer=optimizer)
        manager = crossdevice.train.CheckpointManager(ckpt, directory, max_to_keep=2)
        manager.save()  # the first save allocates the staging buffers
        manager.sync()
        for _ in range(args.runs):  # A B A B: each round measures everything once
            start = time.perf_counter()
            fresh = [t.clone() for t in tensors]
            times["copy"].append(time.perf_counter() - start)
            del fresh
            start = time.perf_counter()
            for buffer, t in zip(buffers, tensors, strict=True):
                buffer.copy_(t)
            times["copy_into"].append(time.perf_counter() - start)
            start = time.perf_counter()
            step()
            times["step"].append(time.perf_counter() - start)
            start = time.perf_counter()
            manager.save()
            saved = time.perf_counter()
            times["stall"].append(saved - start)
            step()
            times["step_writing"].append(time.perf_counter() - saved)
            manager.sync()
            times["write"].append(time.perf_counter() - saved)
        manager.close()
    medians = {k: statistics.median(v) for k, v in times.items()}
    for name, label in [
        ("copy", "copy (clone)"),
        ("copy_into", "copy into buffers"),
        ("stall", "save stall"),
        ("write", "write (background)"),
        ("step", "training step"),
        ("step_writing", "step while writing"),
    ]:
        print(
            f"{label:>20}: {medians[name] * 1e3:8.1f} ms  (runs: "
            + ", ".join(f"{t * 1e3:.0f}" for t in times[name])
            + ")"
        )
    ratio = medians["stall"] / medians["copy"]
    speed = state_bytes / 2**20 / medians["write"]
    print(f"stall / copy = {ratio:.2f} (target <= 1); write {speed:.0f} MiB/s")
    _common.report(
        args,
        {
            "parameters": params,
            "state_bytes": state_bytes,
            "median_seconds": medians,
            "seconds": times,
            "stall_over_copy": ratio,
        },
    )


if __name__ == "__main__":
    main()
