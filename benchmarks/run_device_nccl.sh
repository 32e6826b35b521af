#!/usr/bin/env bash
# Run on a machine with 2 GPUs from the source tree: GPU tests, then the allreduce benchmark over NCCL
# on NVLink and over sockets (NCCL_P2P/SHM/IB disabled: a stand-in for a slow multi-node network).
# Usage: OUT=dir bash benchmarks/run_device_nccl.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-benchmarks/results}
nvidia-smi -L
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_2gpu.log" | tail -5
SIZES=${SIZES:-1M,16M,64M,256M}
python3 -m lowbit bench allreduce --world-size 2 --backend nccl --sizes "$SIZES" --reps 10 --quiet \
    --label "2 GPUs, NCCL over NVLink/P2P" --json "$OUT/allreduce_nccl_nvlink.json" > "$OUT/allreduce_nccl_nvlink.txt" 2>&1
tail -45 "$OUT/allreduce_nccl_nvlink.txt"
NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 python3 -m lowbit bench allreduce --world-size 2 --backend nccl \
    --sizes "$SIZES" --reps 5 --quiet --label "2 GPUs, NCCL over sockets (P2P/SHM/IB disabled)" \
    --json "$OUT/allreduce_nccl_sockets.json" > "$OUT/allreduce_nccl_sockets.txt" 2>&1
tail -45 "$OUT/allreduce_nccl_sockets.txt"
