"""Multi-process tests: worker processes on 127.0.0.1 running torch.distributed."""
