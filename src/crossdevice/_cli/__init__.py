"""Layer 10: the `crossdevice` command line (kept off the library's import path)."""
