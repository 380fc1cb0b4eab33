#!/usr/bin/env bash
# Set up a virtualenv in .venv with torch (CPU build, pinned: an unpinned torch pulls
# several GB of CUDA packages) and the dev tools, then run the checks and the whole test
# suite, multi-process and slow tests included; the documentation site (docs/, mkdocs.yml)
# is built first, with warnings as errors. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --disable-pip-version-check -q "torch==2.13.0"
.venv/bin/python -m pip install --disable-pip-version-check -q -e ".[torch,dev,plot,docs]"
.venv/bin/ruff format --check src tests benchmarks examples
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/mypy
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir build/site
exec .venv/bin/python -m pytest "$@"
