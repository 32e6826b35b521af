#!/usr/bin/env bash
# On a 4-GPU machine: scalability of the collectives and of training (synthetic AlexNet, 1/2/4 GPUs),
# NCCL over NVLink and over sockets. Usage: OUT=dir bash benchmarks/run_device_4gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/lowbit-device}
SOCK="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1"
nvidia-smi -L
B="bench allreduce --world-size 4 --backend nccl --sizes 16M,64M --reps 5 --quiet"
CB="fp32;qsgd:bits=8,bucket=512;qsgd:bits=4,bucket=512;qsgd:bits=2,bucket=128;onebit:bucket=64"
timeout 120 python3 -m lowbit $B --codecs "$CB" --label "4 GPUs, NCCL over NVLink/P2P" --json "$OUT/allreduce_nccl_nvlink_4gpu.json" 2>&1 | tail -24
env $SOCK timeout 150 python3 -m lowbit $B --codecs "$CB" --label "4 GPUs, NCCL over sockets" --json "$OUT/allreduce_nccl_sockets_4gpu.json" 2>&1 | tail -24
S="study --preset throughput --networks alexnet --backend nccl --device cuda --batch-sizes 64 --epochs 3 --world-sizes 1 2 4 --no-progress --no-report"
env $SOCK timeout 150 python3 -m lowbit $S --codecs fp32 qsgd:bits=8,bucket=512 qsgd:bits=4,bucket=512 qsgd:bits=2,bucket=128 onebit:bucket=64 --out "$OUT/study_sockets_4gpu" 2>&1 | tail -12
