#!/usr/bin/env bash
# Issue 17, session 11: what still separates the graphed 8-bit hybrid from 1.5x the 32-bit one (2 GPUs, sockets).
#   bash benchmarks/experiments/run_hybrid_levers.sh       (on the device; $OUT collects the files)
# GPU tests of the hybrid first, then AlexNet over sockets: the graphed paired 8-bit hybrid with sub-batches
# (S = 1, 2, 4) and with other codecs for the features' gradients, beside the 32-bit hybrid and DDP+onebit,
# in interleaved rounds; a profile of the current best configuration and its per-step summary.
set -uo pipefail
export PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_')
nvidia-smi -L
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python -m pytest -q -m gpu tests/gpu/test_parallel_nccl.py tests/gpu/test_nccl.py -p no:cacheprovider 2>&1 \
    | tail -4 | tee "$OUT/gpu_tests_parallel_nccl_${card}.log"
fi
Q8=conv=lowbit:qsgd:bits=8,bucket=512
D=dettmers:type=dynamic,bucket=0
BEST="hybrid[s=1,pair=1,graph=1,$Q8]:$D"
CFGS=${CFGS:-"dp:lowbit:onebit:bucket=64;hybrid[s=1,pair=1]:fp32;$BEST;hybrid[s=2,pair=1,graph=1,$Q8]:$D;hybrid[s=4,pair=1,graph=1,$Q8]:$D;hybrid[s=1,pair=1,graph=1,conv=lowbit:onebit:bucket=64]:$D;hybrid[s=1,pair=1,graph=1,conv=lowbit:qsgd:bits=4,bucket=512]:$D;hybrid[s=1,pair=1,graph=1,conv=fp16]:$D"}
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 timeout ${BENCH_TIMEOUT:-420} torchrun --nproc-per-node 2 \
  benchmarks/bench_hybrid.py --link sockets --models "${MODELS:-alexnet}" --configs "$CFGS" --no-phases \
  --rounds "${ROUNDS:-3}" --steps "${STEPS:-20}" ${PROFILE:+--profile "$OUT/prof" --profile-config "$BEST"} \
  --out "$OUT/hybrid_levers_2x${card}_sockets.json" 2>&1 | grep -v "^W1\|Warning\|warn" | tail -30
if [ -n "${PROFILE:-}" ]; then
  for t in "$OUT"/prof/trace_*.json; do gzip "$t"; done
  python benchmarks/trace_steps.py "$OUT"/prof/trace_*.json.gz > "$OUT/trace_summary_${card}.txt" 2>&1
  head -40 "$OUT/trace_summary_${card}.txt"
fi
