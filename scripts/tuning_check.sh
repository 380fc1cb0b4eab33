#!/usr/bin/env bash
# Issue #26's open measurements, for a host whose cores the two workers do not share (the
# device machine has 16): the 2-core CI host is CPU-bound, so there the exchange's pieces
# cannot overlap their sums with the transfers, and what a threshold is worth elsewhere
# cannot be seen. In one command, within about 8 minutes:
#   1. the user's all-reduce through Gloo (`CROSSDEVICE_SHARED_MEMORY=0` inside the
#      benchmark's `gloo` variant) against raw `torch.distributed.all_reduce`, with each
#      candidate threshold timed against the defaults in the same processes, taking turns
#      (`benchmarks/user_path_allreduce.py --against`); the first candidate is the default
#      itself: the comparison's own resolution;
#   2. the training epoch against DDP (`benchmarks/multi_worker_epoch.py`), also cut into
#      3 gradient buckets against DDP cut alike (`--bucket-cap 128K`): with one all-reduce
#      in flight at a time, the 2-core host's strategy paid 13-44% for them, DDP 2-8%;
#   3. an MLP with 64 MiB of gradients against DDP (`benchmarks/multi_worker_mlp.py`), its
#      buckets issued on the communicator's queue thread (the default), then by the
#      backward hook; and the epoch (one bucket) both ways.
#
#   bash scripts/tuning_check.sh [LOG]
#
# Settings (environment): PYTHON (default python3: needs torch, numpy, optree),
# TUNING_CHECK_SIZES (default "4M 16M"), TUNING_CHECK_ROUNDS (101),
# TUNING_CHECK_AGAINST (the candidates, space-separated NAME=VALUE; default the default
# piece size, 2 MiB and 1 MiB pieces, and the ring from 4 MiB), TUNING_CHECK_EPOCH (1: run
# step 2; 0: skip it), TUNING_CHECK_MLP (1: run step 3; 0: skip it). Runs the tree as checked out (PYTHONPATH=src), installs nothing.
# Exit status: 0 every run completed (whatever it measured), 1 a run failed.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
LOG=${1:-${TMPDIR:-/tmp}/crossdevice-tuning-check-$(date +%Y%m%d-%H%M%S).log}
SIZES=${TUNING_CHECK_SIZES:-4M 16M}
ROUNDS=${TUNING_CHECK_ROUNDS:-101}
AGAINST=${TUNING_CHECK_AGAINST:-ring_piece_bytes=4M ring_piece_bytes=2M ring_piece_bytes=1M direct_max_bytes=4M}
mkdir -p "$(dirname "$LOG")"
: >"$LOG"
echo "crossdevice tuning check: log $LOG"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

say() { echo "$*" | tee -a "$LOG"; }
status=0
say "host: $(nproc) cores; $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1)"
for candidate in $AGAINST; do
    say "--- user path, $candidate against the defaults"
    # shellcheck disable=SC2086  # SIZES is a list
    if ! timeout 300 "$PY" -m benchmarks.user_path_allreduce --sizes $SIZES \
        --rounds "$ROUNDS" --against "$candidate" 2>&1 | tee -a "$LOG" | grep -E "x gloo|^ +[0-9]+ B"; then
        say "FAILED: user path with $candidate (see the log)"
        status=1
    fi
done
if [[ "${TUNING_CHECK_EPOCH:-1}" != 0 ]]; then
    # One bucket first, as earlier sessions measured it; then 3 buckets in a launch of
    # their own (a second model on the strategy, and DDP cut alike); then the one bucket
    # issued by the backward hook instead of the queue thread.
    for variants in "gloo ddp ddp2 local comm" "gloo ddp --bucket-cap 128K" \
        "gloo ddp --tuning queue_min_bytes=4611686018427387904"; do
        say "--- training epoch against DDP: --variants $variants"
        # shellcheck disable=SC2086  # variants is a list of arguments
        if ! timeout 300 "$PY" -m benchmarks.multi_worker_epoch --per-worker 8 32 128 \
            --rounds 9 --variants $variants 2>&1 | tee -a "$LOG" \
            | grep -E "^batch|/|overlap|target|parameters"; then
            say "FAILED: the epoch with --variants $variants (see the log)"
            status=1
        fi
    done
fi
if [[ "${TUNING_CHECK_MLP:-1}" != 0 ]]; then
    # 64 MiB of gradients in 4 buckets: issued on the communicator's queue thread (the
    # default), then by the backward hook (`queue_min_bytes` 2^62), each against DDP.
    for queue in "" "queue_min_bytes=4611686018427387904"; do
        say "--- MLP with 64 MiB of gradients against DDP${queue:+, --tuning $queue}"
        if ! timeout 300 "$PY" -m benchmarks.multi_worker_mlp --bucket-cap 25M 1G \
            ${queue:+--tuning "$queue"} 2>&1 | tee -a "$LOG" | grep -E "bucket cap|rank 0"; then
            say "FAILED: the MLP${queue:+ with $queue} (see the log)"
            status=1
        fi
    done
fi
say "crossdevice tuning check: $([[ $status == 0 ]] && echo done || echo FAILED)"
exit $status
