"""`crossdevice.experimental`: TF's `tf.distribute.experimental` names."""

from crossdevice._core.exports import fix_module_metadata as _fix_module_metadata
from crossdevice._core.options import CollectiveCommunication as CollectiveCommunication
from crossdevice._core.options import CommunicationImplementation as CommunicationImplementation
from crossdevice._core.options import CommunicationOptions as CommunicationOptions
from crossdevice._input.input_context import ValueContext as ValueContext
from crossdevice._input.optional import Optional as Optional
from crossdevice._strategies.central_storage import CentralStorageStrategy as CentralStorageStrategy
from crossdevice._strategies.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from crossdevice._trace.session import trace as trace
from crossdevice._train.preemption import RESTART_EXIT_CODE as RESTART_EXIT_CODE
from crossdevice._train.preemption import (
    PreemptionCheckpointHandler as PreemptionCheckpointHandler,
)
from crossdevice._train.preemption import TerminationConfig as TerminationConfig

__all__ = [
    "RESTART_EXIT_CODE",
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "Optional",
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "ValueContext",
    "trace",
]

# Only the names first defined for this module: the strategies keep `crossdevice`.
_fix_module_metadata(
    globals(),
    ["PreemptionCheckpointHandler", "TerminationConfig", "trace"],
    "crossdevice.experimental",
)
