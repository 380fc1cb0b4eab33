#!/usr/bin/env bash
# The first thing to run on any machine with a GPU: every GPU test suite on real CUDA,
# `crossdevice bench --cuda`, and the GPU training example, in one command, within 8
# minutes. CI has no GPU, so this is where the CUDA paths meet real CUDA.
#
#   bash scripts/gpu_check.sh [LOG]
#
# What it runs (logical GPUs make up the count where the host has fewer GPUs: 4 for the
# strategy and training suites, 16 for the cross-device contract suite):
#   1. the GPU suites, real-CUDA cases only: tests/gpu, the cross-device contract on GPUs,
#      tests/cross_device/test_gpu.py, real NCCL (tests/cross_device/test_nccl_path.py),
#      the strategy contract's mirrored4_gpu_cuda cases, CUDA tensors across 1 and 2
#      workers (tests/multi_worker/test_torch_dist.py), and bench --cuda's helpers;
#   2. `crossdevice bench --cuda` (1 MiB and 16 MiB per GPU, each op against raw NCCL;
#      it exits 1 if a result is wrong);
#   3. examples/custom_training_loop.py on GPU:0..3 in float64, checked against one
#      replica (--check: it exits non-zero if the parameters differ by more than 1e-5).
# A suite case skipped because torch saw no CUDA counts as a failure here; cases that
# need two physical GPUs (real NCCL between cards) skip on a one-GPU host and are listed.
#
# Needs: a Python (`python3`, or $PYTHON) that has torch built with CUDA, numpy, optree,
# tqdm, pytest and pytest-timeout (greenlet is optional here). No network, no install and
# nothing ignored by git: it runs the tree as it is checked out (PYTHONPATH=src), so no
# .venv, build output or compiled kernel travels (without the kernel, which the install
# builds where there is a C compiler, crossdevice uses its NumPy kernels: same results).
# Where optree is missing on an offline machine, carry its wheel and point
# GPU_CHECK_WHEELS at the folder: every wheel there is installed first, into a temporary
# folder (pip --no-index --no-deps --target), not into the Python.
#
# Output: one log (the path is printed first; default under ${TMPDIR:-/tmp}), with the
# bench results as JSON beside it. Exit status: 0 all passed, 1 any failure, 2 no CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
LOG=${1:-${TMPDIR:-/tmp}/crossdevice-gpu-check-$(date +%Y%m%d-%H%M%S).log}
BENCH_JSON="${LOG%.log}-bench.json"
#: The whole check's budget, in seconds; each step gets what is left of it.
BUDGET=${GPU_CHECK_BUDGET_SECONDS:-480}
mkdir -p "$(dirname "$LOG")"
: >"$LOG"
echo "crossdevice GPU check: log $LOG"

say() { echo "$*" | tee -a "$LOG"; }

if [[ -n "${GPU_CHECK_WHEELS:-}" ]]; then
    target=$(mktemp -d "${TMPDIR:-/tmp}/crossdevice-gpu-check-site.XXXXXX")
    "$PY" -m pip install -q --no-index --no-deps --target "$target" "$GPU_CHECK_WHEELS"/*.whl \
        >>"$LOG" 2>&1 || { say "FAILED: installing the wheels in $GPU_CHECK_WHEELS (see the log)"; exit 1; }
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# --- is there CUDA at all? (exit 2: nothing to check) -----------------------------------
cuda=$("$PY" - 2>>"$LOG" <<'EOF'
import importlib.util
if importlib.util.find_spec("torch") is None:
    print("none: torch is not installed in this Python")
else:
    import torch
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print(f"none: torch {torch.__version__} sees no CUDA device "
              f"(built with CUDA {torch.version.cuda}; torch.cuda.is_available() is False)")
    else:
        print(f"{torch.cuda.device_count()}: torch {torch.__version__}, CUDA {torch.version.cuda}, "
              + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
EOF
)
if [[ "$cuda" != [0-9]* ]]; then
    say "crossdevice GPU check: no CUDA to check (${cuda#none: }). Run it on a machine" \
        "with a GPU and a torch built with CUDA (PYTHON=... picks the Python); without" \
        "one, the fake-CUDA suites of the ordinary test run cover the GPU code paths."
    exit 2
fi
gpus=${cuda%%:*}
say "CUDA: ${cuda#*: }"

missing=$("$PY" -c '
import importlib.util
names = ["numpy", "optree", "tqdm", "pytest", "pytest_timeout"]
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))' 2>>"$LOG")
if [[ -n "$missing" ]]; then
    say "FAILED: this Python lacks $missing; install them (offline: carry their wheels and" \
        "set GPU_CHECK_WHEELS to their folder)"
    exit 1
fi

# --- the steps -------------------------------------------------------------------------
failures=()
deadline=$((SECONDS + BUDGET))

step() {  # step NAME CAP_SECONDS COMMAND...: run it within min(CAP, what is left)
    local name=$1 cap=$2
    shift 2
    local left=$((deadline - SECONDS))
    ((left < cap)) && cap=$left
    if ((cap <= 0)); then
        say "FAILED: $name: no time left of the ${BUDGET} s budget"
        failures+=("$name (no time left)")
        return
    fi
    say ""
    say "=== $name (at most ${cap} s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    if ((status == 124 || status == 137)); then
        say "FAILED: $name: still running after ${cap} s"
        failures+=("$name (timed out)")
    elif ((status != 0)); then
        say "FAILED: $name: exit status $status"
        failures+=("$name (exit $status)")
    else
        say "passed: $name ($((SECONDS - start)) s)"
    fi
}

pytest_args=(-m pytest -p no:cacheprovider -q -rs)
step "GPU suites on real CUDA" 330 "$PY" "${pytest_args[@]}" \
    tests/gpu tests/cross_device/test_contract_on_gpus.py tests/cross_device/test_gpu.py \
    tests/collectives/test_bench_cuda.py -k "not fake"
step "real NCCL, the strategy contract on GPUs, CUDA across workers" 240 "$PY" \
    "${pytest_args[@]}" tests/cross_device/test_nccl_path.py tests/strategies/test_contract.py \
    tests/multi_worker/test_torch_dist.py -k "real_nccl or gpu_cuda or cuda_tensors"
# A suite case that saw no CUDA, where this script saw some, checked nothing.
if grep -E "^SKIPPED .*(torch sees none|needs CUDA)" "$LOG" >/dev/null; then
    say "FAILED: GPU suite cases skipped for want of CUDA although torch sees $gpus GPU(s)"
    failures+=("cases skipped without CUDA")
fi

logical=()
((gpus < 4)) && logical=(env CROSSDEVICE_LOGICAL_GPUS=4)
step "crossdevice bench --cuda" 120 "${logical[@]}" "$PY" -m crossdevice bench --cuda \
    --cuda-sizes 1M,16M --repeats 3 --json "$BENCH_JSON"
step "GPU training example (4 replicas, float64, --check)" 120 "$PY" \
    examples/custom_training_loop.py --device-type GPU --replicas 4 --epochs 2 \
    --dtype float64 --check

say ""
if ((${#failures[@]})); then
    say "crossdevice GPU check FAILED ($((SECONDS)) s): $(printf '%s; ' "${failures[@]}")log: $LOG"
    exit 1
fi
say "crossdevice GPU check passed ($((SECONDS)) s). Log: $LOG"
