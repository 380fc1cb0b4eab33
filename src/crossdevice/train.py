"""`crossdevice.train`: TF's `tf.train` checkpointing for crossdevice programs.

`Checkpoint` saves and restores everything that decides the next step of a training
run: models and optimizers (mirrored or not), `crossdevice.Variable`s, LR schedulers,
`GradScaler`s, the position of distributed datasets and iterators, and every worker's
global random state. It is written once per job, atomically and off the training thread,
in torch's Distributed Checkpoint format (or NumPy's `.npz` for NumPy-only programs).
`CheckpointManager` numbers, keeps and finds checkpoints in a directory. A restored run
continues bitwise where the saved one stopped on the same layout, and at the next global
batch on any other. See the guide "Checkpoints and preemption".

    >>> import tempfile, numpy as np, crossdevice
    >>> strategy = crossdevice.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> with strategy.scope():
    ...     w = crossdevice.Variable(np.ones(3, np.float32))
    >>> manager = crossdevice.train.CheckpointManager(
    ...     crossdevice.train.Checkpoint(w=w), tempfile.mkdtemp(), max_to_keep=3)
    >>> path = manager.save()
    >>> _ = w.assign(np.zeros(3, np.float32))
    >>> manager.restore_or_initialize() == path, w.numpy().tolist()
    (True, [1.0, 1.0, 1.0])
"""

from crossdevice._core.exports import fix_module_metadata as _fix_module_metadata
from crossdevice._train.checkpoint import Checkpoint as Checkpoint
from crossdevice._train.manager import CheckpointManager as CheckpointManager
from crossdevice._train.state_file import latest_checkpoint as latest_checkpoint
from crossdevice._train.status import CheckpointLoadStatus as CheckpointLoadStatus
from crossdevice._train.status import InitializationOnlyStatus as InitializationOnlyStatus

__all__ = [
    "Checkpoint",
    "CheckpointLoadStatus",
    "CheckpointManager",
    "InitializationOnlyStatus",
    "latest_checkpoint",
]

_fix_module_metadata(globals(), __all__, "crossdevice.train")
