"""Layer 1: devices, configuration, reduce ops, options, the context stack."""
