r"""The custom training loop on several machines: `MultiWorkerMirroredStrategy` + torchrun.

The same program as `custom_training_loop.py`, with the strategy TF's multi-worker
tutorial uses. Launch one process per worker; every worker runs the same program, with
`--replicas` replicas of its own (threads), and joins the others on torch.distributed:

    torchrun --standalone --nproc-per-node 2 examples/multi_worker_training.py --replicas 2

or describe the cluster as for TensorFlow, one shell per worker (index 0 and 1):

    TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/multi_worker_training.py --replicas 2

Every worker starts from the chief's parameters (`crossdevice.torch.prepare` broadcasts
them), `experimental_distribute_dataset` gives each worker its replicas' slices of every
global batch, and the gradients are all-reduced across all 4 replicas during backward,
so every replica of every worker ends with bitwise the same parameters, equal (up to
rounding) to one device trained on the same global batches. Only the chief prints.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import custom_training_loop  # the example next to this one

if __name__ == "__main__":
    custom_training_loop.main(["--strategy", "multi_worker", *sys.argv[1:]])
