"""Layer 5, the communicators: one protocol, one package per place where the peers live.

`local`: replica threads (or greenlets) of this process; `workers`: processes on
torch.distributed; `devices`: the devices of this process (NCCL and per-device
algorithms). See docs/design.md §2b.
"""
