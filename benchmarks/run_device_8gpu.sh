#!/usr/bin/env bash
# Device recipe for issue 34: the seed's scalability at 8 GPUs, as one node and as 2 emulated nodes of 4
# (NCCL_HOSTID per rank: NVLink inside a node, sockets between; benchmarks/emulated_node.sh).
#   MODE=study bash benchmarks/run_device_8gpu.sh   the study at 1, 2, 4, 8 GPUs, 1 and 2 nodes, flat vs
#                                                    hierarchical (configs/study8.toml), then predict --validate
#   MODE=ddp   ...                                   bench_ddp on 2 nodes of 4: plain DDP, fp16, PowerSGD rank 4,
#                                                    hierarchical 8/4-bit QSGD and 1bitSGD*, auto
#   MODE=fsdp  ...                                   bench_fsdp on 2 nodes of 4: FSDP2 baselines, hierarchical
#                                                    lowbit, HSDP (FSDP2's own against lowbit's replicate all-reduce)
# NGPU=4 runs every mode on 4 GPUs as 2 nodes of 2 (the dry run on a 4-GPU machine). Each mode fits one
# device call of 10 minutes (STUDY_TIMEOUT, DDP_TIMEOUT, FSDP_TIMEOUT); results land under $OUT as they finish.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NGPU=${NGPU:-8}; NODE_SIZE=$((NGPU / 2))
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_')
have=$(nvidia-smi -L | wc -l)
[ "$have" -ge "$NGPU" ] || { echo "this machine has $have GPUs; NGPU=$NGPU asks for more"; exit 2; }
quiet() { grep -v "^W1\|Warning\|warn\|return func" ; }
sizes=1; for w in 2 4 8; do [ "$w" -le "$NGPU" ] && sizes="$sizes $w"; done
for mode in ${MODE:-study ddp fsdp}; do
  case $mode in
    study)
      timeout "${STUDY_TIMEOUT:-570}" python -m lowbit study --config benchmarks/configs/study8.toml --world-sizes $sizes \
        ${STUDY_NETWORKS:+--networks $STUDY_NETWORKS} --no-progress --no-report --out "$OUT/study_${NGPU}x${card}_nodes" 2>&1 \
        | quiet | tail -40
      python -m lowbit predict --validate "$OUT/study_${NGPU}x${card}_nodes" > "$OUT/perfmodel_validation_${NGPU}x${card}_nodes.txt" 2>&1
      tail -12 "$OUT/perfmodel_validation_${NGPU}x${card}_nodes.txt" ;;
    ddp)
      H="ddp;fp16;powersgd;lowbit[algorithm=hierarchical]:qsgd:bits=8,bucket=512;lowbit[algorithm=hierarchical]:qsgd:bits=4,bucket=512"
      H="$H;lowbit[algorithm=hierarchical]:onebit:bucket=64;lowbit:auto"
      LOWBIT_NODE_SIZE=$NODE_SIZE timeout "${DDP_TIMEOUT:-570}" torchrun --nproc-per-node "$NGPU" --no-python \
        benchmarks/emulated_node.sh benchmarks/bench_ddp.py --link 2nodes --models "${MODELS:-vgg19,alexnet,gpt2_small}" \
        --hooks "${HOOKS:-$H}" --steps "${STEPS:-20}" --rounds "${ROUNDS:-2}" --warmup "${WARMUP:-8}" \
        --out "$OUT/ddp_${NGPU}x${card}_2nodes.json" 2>&1 | quiet | tail -40 ;;
    fsdp)
      NGPU=$NGPU NODE_SIZE=$NODE_SIZE MODE=nodes BATCH=${BATCH:-16} STEPS=${STEPS:-10} ROUNDS=${ROUNDS:-2} \
        CONFIGS="${CONFIGS:-fsdp,fsdp_bf16,hsdp_bf16,h_q8_p8,h_q4_p8,hsdp_q8}" timeout "${FSDP_TIMEOUT:-570}" \
        bash benchmarks/run_device_fsdp.sh ;;
    *) echo "unknown MODE $mode (study, ddp, fsdp)"; exit 2 ;;
  esac
done
