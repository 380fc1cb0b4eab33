"""Layer 8: strategies (default, OneDevice, Mirrored, CentralStorage, MultiWorkerMirrored)."""
