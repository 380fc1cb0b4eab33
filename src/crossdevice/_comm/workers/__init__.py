"""Collectives whose peers are worker processes, on torch.distributed (Gloo, NCCL, /dev/shm)."""
