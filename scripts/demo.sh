#!/usr/bin/env bash
# Set up a virtualenv in .venv with torch (CPU build, pinned: an unpinned torch pulls
# several GB of CUDA packages) and run the demo: a PyTorch CNN trained data-parallel on
# 4 logical CPU replicas with crossdevice.torch, checked against a single-replica run.
# Extra arguments go to `crossdevice demo` (try --help; --numpy trains a NumPy model).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --disable-pip-version-check -q "torch==2.13.0"
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[torch]"
exec .venv/bin/crossdevice demo "$@"
