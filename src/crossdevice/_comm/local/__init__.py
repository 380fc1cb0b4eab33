"""Collectives whose peers are the replica threads (or greenlets) of this process."""
