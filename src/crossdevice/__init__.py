"""crossdevice: TensorFlow's tf.distribute API for NumPy and PyTorch (being built)."""
