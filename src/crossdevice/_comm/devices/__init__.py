"""Collectives whose peers are the devices of this process: algorithms over one array each."""
