#!/usr/bin/env bash
# On a 2-GPU machine, from the source tree: GPU tests, then the throughput study (synthetic AlexNet and
# ResNet-50) over NCCL on NVLink and over sockets. Usage: OUT=dir bash benchmarks/run_device_study.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/lowbit-device}
nvidia-smi -L
python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_2gpu.log" | tail -3
C="fp32 fp16 qsgd:bits=8,bucket=512 qsgd:bits=4,bucket=512 qsgd:bits=2,bucket=128 onebit:bucket=64"
A="--preset throughput --networks alexnet resnet50 --backend nccl --device cuda --batch-sizes 64 --epochs 3 --no-progress --no-report"
timeout 270 python3 -m lowbit study $A --codecs $C --out "$OUT/nvlink" 2>&1 | tail -13
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 timeout 270 python3 -m lowbit study $A --codecs $C --out "$OUT/sockets" 2>&1 | tail -13
