#!/usr/bin/env bash
# bench_overhead.py on one GPU (wire free): FSDP2 gpt_350m at 16 and 4 seqs/rank, DDP on GPT-2 small,
# ResNet-50 and AlexNet. Writes $OUT/overhead_*.json and prints each table.
#   PARTS="fsdp16 ddp_resnet50" ROUNDS=3 bash benchmarks/run_device_overhead.sh
set -u
OUT=${OUT:-/tmp/overhead}; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-5}; STEPS=${STEPS:-10}; PARTS=${PARTS:-"fsdp16 fsdp4 ddp_gpt2_small ddp_resnet50 ddp_alexnet"}
WIRE=${WIRE:-mirror}  # mirror: collectives hand back this rank's bytes (finite values); fake: nothing moves
CPROF=${CPROF:-}
TRACE=${TRACE:-}  # configs whose profiled steps are also written as Chrome traces
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for part in $PARTS; do
  case $part in
    fsdp16) args=(--mode fsdp --model gpt_350m --batch 16) ;;
    fsdp4) args=(--mode fsdp --model gpt_350m --batch 4) ;;
    ddp_gpt2_small) args=(--mode ddp --model gpt2_small --batch 16 --seq 256) ;;
    ddp_resnet50) args=(--mode ddp --model resnet50 --batch 64) ;;
    ddp_alexnet) args=(--mode ddp --model alexnet --batch 64) ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
  echo "== $part"
  python benchmarks/bench_overhead.py "${args[@]}" --device cuda --wire "$WIRE" --rounds "$ROUNDS" --steps "$STEPS" \
    ${CONFIGS:+--configs "$CONFIGS"} ${CPROF:+--cprofile "$CPROF"} ${TRACE:+--trace "$TRACE"} --out "$OUT/overhead_${part}_$WIRE.json" 2> "$OUT/overhead_${part}_$WIRE.log" \
    || { echo "FAILED: $part"; tail -30 "$OUT/overhead_${part}_$WIRE.log"; }
done
