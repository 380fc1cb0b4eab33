"""Layer 4: distributed values and variables."""
