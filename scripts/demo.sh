#!/usr/bin/env bash
# Set up a virtualenv in .venv (NumPy only: the demo needs no torch) and run the demo:
# a digits classifier trained data-parallel on 4 logical CPU replicas, checked against
# a single-replica run. Extra arguments go to `crossdevice demo` (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --disable-pip-version-check -q -e .
exec .venv/bin/crossdevice demo "$@"
