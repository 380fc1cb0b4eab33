"""PyTorch training on crossdevice strategies: mirrored modules and optimizers.

Public names are re-exported by `crossdevice.torch`; this package imports torch.
"""
