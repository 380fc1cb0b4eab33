"""`crossdevice bench`: the collective benchmarks of the command line.

`main.py` is the subcommand (`register`, `run`); `common.py` holds what its parts share;
`impls.py` the timed implementations and their replica threads; `cuda.py` and
`cuda_cases.py` the GPU benchmark; `workers.py` the multi-worker one; `plot.py` the
figure; `bandwidth.py` the memory-bandwidth measurement every host figure is read against.
"""

from crossdevice._cli.bench.common import parse_size as parse_size
from crossdevice._cli.bench.common import sizes_between as sizes_between
from crossdevice._cli.bench.impls import IMPLEMENTATIONS as IMPLEMENTATIONS
from crossdevice._cli.bench.impls import ReplicaThreads as ReplicaThreads
from crossdevice._cli.bench.main import register as register
from crossdevice._cli.bench.main import run as run

__all__ = ["IMPLEMENTATIONS", "ReplicaThreads", "parse_size", "register", "run", "sizes_between"]
