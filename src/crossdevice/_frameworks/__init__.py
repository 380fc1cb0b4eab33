"""Layer 10 (docs/design.md §2): what a model-training user touches, built on the strategies.

Nothing below this package imports it. `crossdevice.torch` is its public face for PyTorch.
"""
