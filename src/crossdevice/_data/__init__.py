"""Data sets shipped inside the package (see README.md in this folder for provenance)."""
