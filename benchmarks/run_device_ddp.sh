#!/usr/bin/env bash
# Device recipe for issue 11 (2 GPUs): GPU tests, then bench_ddp over NVLink and over sockets, profiles.
#   MODE=nvlink|sockets|profile|tests  bash benchmarks/run_device_ddp.sh      (2 GPUs)
#   MODE=nodes bash benchmarks/run_device_ddp.sh                              (4 GPUs as 2 emulated nodes)
#   MODE=single4 (4 GPUs as one node)   MODE=alltests (every GPU test, on 4 GPUs)
#   MODE=study4 (4 GPUs: the study as 1 and 2 emulated nodes, then lowbit predict --validate)
#   issue 29's targets, codec="auto" (default and bold) beside the fixed codecs, plain DDP, fp16 and PowerSGD:
#   MODE=auto_nvlink / auto_sockets (2 GPUs)   MODE=auto_nodes (4 GPUs as 2 emulated nodes; MODELS default
#   vgg19,alexnet,gpt2_small). Split MODELS across calls to stay within a 10-minute command.
#   MODE=auto_recheck (4 GPUs): the cells of issue 29 that missed on 2x/4x H200 (docs/results.md), with
#   more steps and rounds: GPT-2 small over NVLink (60 steps x 5 rounds), ResNet-50 over sockets and GPT-2
#   small between 2 emulated nodes (5 rounds); GPUs 0-1 for the 2-GPU ones.
set -uo pipefail
export PYTHONPATH=src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_')
STEPS=${STEPS:-30}; ROUNDS=${ROUNDS:-3}; WARMUP=${WARMUP:-8}
MODELS=${MODELS:-vgg19,resnet50,alexnet,gpt2_small}
hook_args=(); [ -n "${HOOKS:-}" ] && hook_args=(--hooks "$HOOKS")  # HOOKS e.g. HOOKS="ddp;fp16;lowbit[mb=256]:qsgd:bits=8,bucket=512" (default: the bench's)
for mode in ${MODE:-tests nvlink}; do
  case $mode in
    tests)
      python -m pytest -q -m gpu tests/gpu/test_nccl.py 2>&1 | tail -5 | tee "$OUT/gpu_tests_nccl.log" ;;
    alltests)  # every GPU test: kernels and overflow on one GPU, NCCL on 2, emulated nodes on 4
      timeout ${TESTS_TIMEOUT:-300} python -m pytest -q -m gpu tests/gpu tests/unit/test_overflow.py -p no:cacheprovider 2>&1 \
        | tail -8 | tee "$OUT/gpu_tests_${card}.log" ;;
    single4)  # 4 GPUs as one real node (torchrun sets LOCAL_WORLD_SIZE=4): hierarchical must cost nothing
      torchrun --nproc-per-node 4 benchmarks/bench_ddp.py --link nvlink --models "$MODELS" \
        --hooks "${HOOKS:-ddp;lowbit[algorithm=hierarchical]:qsgd:bits=4,bucket=512;lowbit:qsgd:bits=4,bucket=512}" \
        --steps "$STEPS" --rounds "$ROUNDS" --warmup "$WARMUP" --out "$OUT/ddp_4x${card}_1node.json" 2>&1 \
        | grep -v "^W1\|Warning\|warn" | tail -20 ;;
    study4)  # issue 15: the study at 1, 2, 4 GPUs as one node and as 2 emulated nodes, flat vs hierarchical,
             # then the speed model's held-out prediction beside every run, and the report (Figs 12-15)
      timeout ${STUDY_TIMEOUT:-540} python -m lowbit study --config benchmarks/configs/study4.toml \
        ${STUDY_NETWORKS:+--networks $STUDY_NETWORKS} --no-progress --no-report --out "$OUT/study_4x${card}_nodes" 2>&1 \
        | grep -v "UserWarning\|return func" | tail -60
      python -m lowbit predict --validate "$OUT/study_4x${card}_nodes" > "$OUT/perfmodel_validation_4x${card}_nodes.txt" 2>&1
      tail -12 "$OUT/perfmodel_validation_4x${card}_nodes.txt" ;;
    nvlink)
      torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --link nvlink --models "$MODELS" "${hook_args[@]}" \
        --steps "$STEPS" --rounds "$ROUNDS" --warmup "$WARMUP" --out "$OUT/ddp_2x${card}_nvlink.json" 2>&1 \
        | grep -v "^W1\|Warning\|warn" | tail -40 ;;
    sockets)
      NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 torchrun --nproc-per-node 2 benchmarks/bench_ddp.py \
        --link sockets --models "$MODELS" "${hook_args[@]}" --steps "$STEPS" --rounds "$ROUNDS" --warmup "$WARMUP" \
        --out "$OUT/ddp_2x${card}_sockets.json" 2>&1 | grep -v "^W1\|Warning\|warn" | tail -40 ;;
    nodes)  # 4 GPUs as 2 emulated nodes of 2 (NVLink inside, sockets between): flat vs hierarchical lowbit
      LOWBIT_NODE_SIZE=2 torchrun --nproc-per-node 4 --no-python benchmarks/emulated_node.sh benchmarks/bench_ddp.py \
        --link 2nodes --models "$MODELS" --hooks "${HOOKS:-ddp;fp16;powersgd;lowbit:qsgd:bits=4,bucket=512;lowbit[algorithm=hierarchical]:qsgd:bits=8,bucket=512;lowbit[algorithm=hierarchical]:qsgd:bits=4,bucket=512;lowbit[algorithm=hierarchical]:onebit:bucket=64}" \
        --steps "$STEPS" --rounds "$ROUNDS" --warmup "$WARMUP" --out "$OUT/ddp_4x${card}_2nodes.json" 2>&1 \
        | grep -v "^W1\|Warning\|warn" | tail -40 ;;
    auto_nvlink|auto_sockets)  # issue 29: auto / bold against every fixed config of bold's set and the baselines
      link=${mode#auto_}
      env_link=(); [ "$link" = sockets ] && env_link=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1)
      env "${env_link[@]}" torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --link "$link" --models "$MODELS" \
        --hooks "${HOOKS:-ddp;fp16;powersgd;lowbit:qsgd:bits=8,bucket=512;lowbit:qsgd:bits=4,bucket=512;lowbit:onebit:bucket=64;lowbit:auto;lowbit[level=bold]:auto}" \
        --steps "$STEPS" --rounds "$ROUNDS" --warmup "$WARMUP" --out "$OUT/ddp_2x${card}_${link}_auto29_${MODELS//,/_}${TAG:-}.json" 2>&1 \
        | grep -v "^W1\|Warning\|warn" | tail -60 ;;
    auto_nodes)  # issue 29: the same on 4 GPUs as 2 emulated nodes, flat and hierarchical fixed configs
      LOWBIT_NODE_SIZE=2 torchrun --nproc-per-node 4 --no-python benchmarks/emulated_node.sh benchmarks/bench_ddp.py \
        --link 2nodes --models "${MODELS/resnet50,/}" --hooks "${HOOKS:-ddp;fp16;powersgd;lowbit:qsgd:bits=8,bucket=512;lowbit[algorithm=hierarchical]:qsgd:bits=8,bucket=512;lowbit:qsgd:bits=4,bucket=512;lowbit[algorithm=hierarchical]:qsgd:bits=4,bucket=512;lowbit:onebit:bucket=64;lowbit[algorithm=hierarchical]:onebit:bucket=64;lowbit:auto;lowbit[level=bold]:auto}" \
        --steps "$STEPS" --rounds "$ROUNDS" --warmup "$WARMUP" --out "$OUT/ddp_4x${card}_2nodes_auto29_${MODELS//,/_}${TAG:-}.json" 2>&1 \
        | grep -v "^W1\|Warning\|warn" | tail -60 ;;
    auto_recheck)  # issue 29's missed cells again (see the header); about 8 minutes on 4x H200
      CUDA_VISIBLE_DEVICES=0,1 TAG=_recheck OUT="$OUT" MODE=auto_nvlink MODELS=gpt2_small STEPS=60 ROUNDS=5 \
        HOOKS="ddp;fp16;lowbit:qsgd:bits=8,bucket=512;lowbit:qsgd:bits=4,bucket=512;lowbit:auto;lowbit[level=bold]:auto" \
        bash "$0" | tail -12
      CUDA_VISIBLE_DEVICES=0,1 TAG=_recheck OUT="$OUT" MODE=auto_sockets MODELS=resnet50 ROUNDS=5 bash "$0" | tail -12
      TAG=_recheck OUT="$OUT" MODE=auto_nodes MODELS=gpt2_small ROUNDS=5 bash "$0" | tail -12 ;;
    profile)
      for h in ${PROFILE_HOOKS:-ddp lowbit:qsgd:bits=8,bucket=512}; do
        torchrun --nproc-per-node 2 benchmarks/bench_ddp.py --link nvlink --models "${PROFILE_MODEL:-gpt2_small}" \
          --hooks "$h" --steps 10 --rounds 1 --warmup 8 --profile "$OUT/prof" --profile-hook "$h" \
          --out "$OUT/prof_run.json" 2>&1 | grep -v "^W1\|Warning\|warn" | tail -3
      done
      gzip -f "$OUT"/prof/trace_*.json ;;
  esac
done
