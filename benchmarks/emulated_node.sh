#!/usr/bin/env bash
# One torchrun rank as a member of an emulated node: ranks LOCAL_RANK / LOWBIT_NODE_SIZE share a node.
# NCCL then sees separate hosts (NVLink inside an emulated node, sockets between them), and lowbit's
# hierarchical algorithm takes the same node size. 4 GPUs as 2 nodes of 2:
#   LOWBIT_NODE_SIZE=2 torchrun --nproc-per-node 4 --no-python benchmarks/emulated_node.sh \
#       benchmarks/bench_ddp.py --link 2nodes --hooks "ddp;fp16;lowbit[algorithm=hierarchical]:qsgd:bits=4,bucket=512"
set -euo pipefail
: "${LOCAL_RANK:?run me under torchrun}"
export LOWBIT_NODE_SIZE="${LOWBIT_NODE_SIZE:-2}"
export NCCL_HOSTID="node$(( LOCAL_RANK / LOWBIT_NODE_SIZE ))"
export NCCL_IB_DISABLE=1
exec "${PYTHON:-python}" "$@"
