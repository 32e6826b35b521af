#!/usr/bin/env bash
# Device recipe for issue 17 (2 GPUs): bench_hybrid over sockets and NVLink, each model with its configs:
# plain and lowbit data parallelism, the 32-bit hybrids (Dettmers' split; paired; small feature buckets;
# graphed) and the 8-bit ones, in interleaved rounds, with Dettmers' model beside his split.
#   MODELS=alexnet LINKS="sockets nvlink" bash benchmarks/run_device_hybrid.sh      ($OUT collects the JSON)
# The features' DDP: cap=MB is its bucket_cap_mb, lowbit[mb=M] the hook's message size (docs/parallel.md).
set -uo pipefail
export PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
D=dettmers:type=dynamic,bucket=0
Q8=lowbit:qsgd:bits=8,bucket=512
for model in ${MODELS:-alexnet vgg19}; do
  case $model in
    alexnet) M=1 ;;  # 2.5 M feature parameters: 1 MiB buckets and messages let their sync overlap the backward
    *) M=4 ;;
  esac
  CFGS=${CFGS:-"dp:ddp;dp:lowbit:onebit:bucket=64;dp:lowbit[mb=4]:onebit:bucket=64;hybrid[s=1]:fp32;hybrid[s=1,cap=$M]:fp32;hybrid[s=1,pair=1,cap=$M]:fp32;hybrid[s=1,pair=1,graph=1,cap=$M]:fp32;hybrid[s=1,conv=$Q8]:$D;hybrid[s=1,pair=1,graph=1,conv=$Q8]:$D;hybrid[s=1,pair=1,graph=1,cap=$M,conv=lowbit[mb=$M]:qsgd:bits=8,bucket=512]:$D;hybrid[s=2,pair=1,graph=1,cap=$M,conv=lowbit[mb=$M]:qsgd:bits=8,bucket=512]:$D;hybrid[s=1,pair=1,graph=1,cap=$M,conv=lowbit[mb=$M]:onebit:bucket=64]:$D"}
  for link in ${LINKS:-sockets nvlink}; do
    env=(); [ "$link" = sockets ] && env=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1)
    env "${env[@]}" timeout ${BENCH_TIMEOUT:-500} torchrun --nproc-per-node 2 benchmarks/bench_hybrid.py --link "$link" \
      --models "$model" --configs "$CFGS" --rounds "${ROUNDS:-3}" --steps "${STEPS:-20}" \
      --out "$OUT/hybrid_2x${card}_${link}_${model}_${LOWBIT_GIT_COMMIT:-dev}.json" 2>&1 \
      | grep -v "^W1\|Warning\|warn\|round " | tail -12
  done
  unset CFGS
done
