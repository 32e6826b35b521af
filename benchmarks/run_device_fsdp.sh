#!/usr/bin/env bash
# Device recipe for issue 28 (lowbit.fsdp): FSDP2 throughput beside its bf16 baselines, and convergence.
#   MODE="nvlink sockets" bash benchmarks/run_device_fsdp.sh      (2 GPUs)
#   MODE=nodes bash benchmarks/run_device_fsdp.sh                 (4 GPUs as 2 emulated nodes of 2)
#   MODE=paired PAIRED=fsdp_bf16,bf16 bash benchmarks/run_device_fsdp.sh   (2 GPUs over NVLink: B against A step by
#                                                                  step, both models in memory; LINK=sockets too)
#   MODE=pairednodes PAIRED=fsdp_bf16,h_q8_p8 bash benchmarks/run_device_fsdp.sh   (4 GPUs as 2 emulated nodes, paired)
#   MODE=hsdp bash benchmarks/run_device_fsdp.sh                  (4 GPUs as 2 emulated nodes: FSDP2's HSDP against
#                                                                  lowbit's compressed replicate all-reduce)
#   NGPU=8 NODE_SIZE=4 MODE="nodes hsdp" ...                      (8 GPUs as 2 emulated nodes of 4; issue 34)
#   MODE=auto bash benchmarks/run_device_fsdp.sh                  (2 GPUs, NVLink then sockets: codec="auto" at both levels
#                                                                  beside FSDP2's baselines and the fixed codecs; issue 29)
#   MODE=autonodes bash benchmarks/run_device_fsdp.sh             (4 GPUs as 2 emulated nodes: auto, flat and h_auto)
#   MODE=train bash benchmarks/run_device_fsdp.sh                 (2 GPUs over NVLink: 1,500 steps on pysource)
#   MODE=trainpair bash benchmarks/run_device_fsdp.sh             (4 GPUs: two such runs side by side, GPUs 0-1
#                                                                  and 2-3, PAIR="fsdp q8_p8": half the wall time)
# MODEL (default gpt_350m), CONFIGS, STEPS, WARMUP, ROUNDS, BATCH, TRAIN_STEPS override the defaults.
set -uo pipefail
export PYTHONPATH=src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_')
NGPU=${NGPU:-4}; NODE_SIZE=${NODE_SIZE:-2}  # for the modes on emulated nodes
MODEL=${MODEL:-gpt_350m}; STEPS=${STEPS:-8}; WARMUP=${WARMUP:-3}; ROUNDS=${ROUNDS:-1}; BATCH=${BATCH:-8}
common=(--model "$MODEL" --steps "$STEPS" --warmup "$WARMUP" --rounds "$ROUNDS" --batch "$BATCH" --commit "${COMMIT:-}")
quiet() { grep -v "^W1\|Warning\|warn\|^\*\*\*\|OMP_NUM" ; }
for mode in ${MODE:-nvlink sockets}; do
  case $mode in
    nvlink)
      torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --link nvlink "${common[@]}" \
        --configs "${CONFIGS:-fsdp,fsdp_bf16,bf16,q8,q8_p8,q4_p8}" --out "$OUT/fsdp_2x${card}_nvlink_${MODEL}.json" 2>&1 | quiet ;;
    sockets)
      NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py \
        --link sockets "${common[@]}" --configs "${CONFIGS:-fsdp,fsdp_bf16,bf16,q8_p8,q4_p8,q4ef_p8}" \
        --out "$OUT/fsdp_2x${card}_sockets_${MODEL}.json" 2>&1 | quiet ;;
    nodes)
      LOWBIT_NODE_SIZE=$NODE_SIZE torchrun --nproc-per-node $NGPU --no-python benchmarks/emulated_node.sh benchmarks/bench_fsdp.py \
        --link 2nodes --node-size $NODE_SIZE "${common[@]}" --configs "${CONFIGS:-fsdp,fsdp_bf16,q8_p8,h_q8,h_q8_p8,h_q4_p8}" \
        --out "$OUT/fsdp_${NGPU}x${card}_2nodes_${MODEL}.json" 2>&1 | quiet ;;
    auto)
      for link in nvlink sockets; do
        env_link=(); [ $link = sockets ] && env_link=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1)
        env "${env_link[@]}" torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --link $link "${common[@]}" \
          --configs "${CONFIGS:-fsdp,fsdp_bf16,bf16,q8,q4,auto,auto_bold}" --out "$OUT/fsdp_auto_2x${card}_${link}_${MODEL}.json" 2>&1 | quiet
      done ;;
    autonodes)
      LOWBIT_NODE_SIZE=$NODE_SIZE torchrun --nproc-per-node $NGPU --no-python benchmarks/emulated_node.sh benchmarks/bench_fsdp.py \
        --link 2nodes --node-size $NODE_SIZE "${common[@]}" --configs "${CONFIGS:-fsdp,fsdp_bf16,h_q8,auto,h_auto}" \
        --out "$OUT/fsdp_auto_${NGPU}x${card}_2nodes_${MODEL}.json" 2>&1 | quiet ;;
    hsdp)
      LOWBIT_NODE_SIZE=$NODE_SIZE torchrun --nproc-per-node $NGPU --no-python benchmarks/emulated_node.sh benchmarks/bench_fsdp.py \
        --link 2nodes --node-size $NODE_SIZE "${common[@]}" --configs "${CONFIGS:-fsdp_bf16,hsdp_bf16,h_q8_p8,hsdp_q8,hsdp_q4}" \
        --out "$OUT/fsdp_${NGPU}x${card}_2nodes_hsdp_${MODEL}.json" 2>&1 | quiet ;;
    paired)
      env_link=(); [ "${LINK:-nvlink}" = sockets ] && env_link=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1)
      env "${env_link[@]}" torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --link "${LINK:-nvlink}" --model "$MODEL" \
        --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP" --commit "${COMMIT:-}" --paired "${PAIRED:-fsdp_bf16,bf16}" \
        --out "$OUT/fsdp_paired_2x${card}_${LINK:-nvlink}_${MODEL}_$(echo "${PAIRED:-fsdp_bf16,bf16}" | tr , _).json" 2>&1 | quiet ;;
    pairednodes)
      LOWBIT_NODE_SIZE=$NODE_SIZE torchrun --nproc-per-node $NGPU --no-python benchmarks/emulated_node.sh benchmarks/bench_fsdp.py \
        --link 2nodes --node-size $NODE_SIZE --model "$MODEL" --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP" \
        --commit "${COMMIT:-}" --paired "${PAIRED:-fsdp_bf16,h_q8_p8}" \
        --out "$OUT/fsdp_paired_${NGPU}x${card}_2nodes_${MODEL}_$(echo "${PAIRED:-fsdp_bf16,h_q8_p8}" | tr , _).json" 2>&1 | quiet ;;
    train)
      torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --link nvlink --model "$MODEL" --batch "$BATCH" \
        --train "${TRAIN_STEPS:-1500}" --eval-every "${EVAL_EVERY:-250}" --commit "${COMMIT:-}" \
        --configs "${CONFIGS:-fsdp,q8_p8,q4_p8,q4ef_p8}" --out "$OUT/fsdp_train_2x${card}_${MODEL}.json" 2>&1 | quiet ;;
    trainpair)
      set -- ${PAIR:-fsdp q8_p8}
      for i in 0 1; do
        cfg=${1}; shift
        CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)) torchrun --nproc-per-node 2 --master-port $((29510 + i)) \
          benchmarks/bench_fsdp.py --link nvlink --model "$MODEL" --batch "$BATCH" --train "${TRAIN_STEPS:-1500}" \
          --eval-every "${EVAL_EVERY:-250}" --commit "${COMMIT:-}" --configs "$cfg" \
          --out "$OUT/fsdp_train_2x${card}_${MODEL}_${cfg}.json" > "$OUT/train_${cfg}.log" 2>&1 &
      done
      wait
      for f in "$OUT"/train_*.log; do grep -v "^W1\|Warning\|warn\|^\*\*\*\|OMP_NUM\|return func" "$f" | tail -8; done ;;
    *) echo "unknown MODE $mode"; exit 2 ;;
  esac
done
