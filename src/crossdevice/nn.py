"""`crossdevice.nn`: TF's `tf.nn` loss-scaling helpers for distributed training.

`tf.nn.compute_average_loss` and `tf.nn.scale_regularization_loss` port by name: they
take NumPy arrays or torch tensors (the same functions as `crossdevice.torch`'s).
"""

from crossdevice._core.exports import fix_module_metadata as _fix_module_metadata
from crossdevice._strategies.losses import compute_average_loss as compute_average_loss
from crossdevice._strategies.losses import scale_regularization_loss as scale_regularization_loss

__all__ = ["compute_average_loss", "scale_regularization_loss"]

_fix_module_metadata(globals(), __all__, "crossdevice.nn")
