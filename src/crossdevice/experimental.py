"""`crossdevice.experimental`: TF's `tf.distribute.experimental` names."""

from crossdevice._core.options import CollectiveCommunication as CollectiveCommunication
from crossdevice._core.options import CommunicationImplementation as CommunicationImplementation
from crossdevice._core.options import CommunicationOptions as CommunicationOptions
from crossdevice._input.input_context import ValueContext as ValueContext
from crossdevice._input.optional import Optional as Optional
from crossdevice._strategies.central_storage import CentralStorageStrategy as CentralStorageStrategy
from crossdevice._strategies.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)

__all__ = [
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "MultiWorkerMirroredStrategy",
    "Optional",
    "ValueContext",
]
