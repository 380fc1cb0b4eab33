#!/usr/bin/env bash
# Set up a virtualenv in .venv with torch (CPU build, pinned: an unpinned torch pulls
# several GB of CUDA packages) and the dev tools, then run the checks and the whole test
# suite, multi-process and slow tests included. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --disable-pip-version-check -q "torch==2.13.0"
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[torch,dev,plot]"
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/ruff check src tests benchmarks
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
