#!/usr/bin/env bash
# Time to accuracy on GPUs (issue 30; docs/study.md, "Time to accuracy"): the tta preset (GPT-2 small on
# pysource, sequence 256; PyTorch's fp16 hook sets the target) from the source tree, resumable, in calls of at
# most LIMIT seconds. Every finished run is appended to $OUT/tta_gpu/results.jsonl as it lands (write + fsync,
# so a call cut short keeps what it finished); copy that file to $RESULTS (committed) between calls and the
# next call resumes from it. Rerun the same command until it prints "stage ... complete".
#
#   STAGE=sockets OUT=dir bash benchmarks/run_device_tta.sh   # 2 GPUs over sockets: the 7 configurations, seed 0
#   STAGE=seeds   OUT=dir bash benchmarks/run_device_tta.sh   # 2 GPUs over sockets: seed 1 of fp16, PowerSGD, $BEST
#   STAGE=nodes   OUT=dir bash benchmarks/run_device_tta.sh   # 4 GPUs as 2 emulated nodes: fp16, PowerSGD, $BEST2
#   STAGE=report  OUT=dir bash benchmarks/run_device_tta.sh   # the report of everything in $RESULTS (no GPU)
#
# BEST: lowbit's best configuration in the sockets stage's table (default 4-bit QSGD); BEST2: its best two
# (with the hierarchical algorithm between the emulated nodes). BUDGET: the fp16 hook's training seconds
# (default the preset's 120; the others get twice as many at most; every stage of one study must use the
# same). Each configuration starts only when the call has time left for it (the budget, validation, start-up
# and NCCL set-up), so that no call is cut off inside a run.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=src
STAGE=${STAGE:?STAGE=sockets, seeds, nodes or report}
OUT=${OUT:-/tmp/lowbit-device}
RESULTS=${RESULTS:-benchmarks/results/tta_gpu}
LIMIT=${LIMIT:-570}
BEST=${BEST:-qsgd:bits=4,bucket=512}
BEST2=${BEST2:-qsgd:bits=4,bucket=512 onebit:bucket=64}
BUDGET=${BUDGET:-120}
ONE=$(( BUDGET + 80 ))        # a configuration at most as slow as the fp16 hook: its budget, validation, start-up
SLOW=$(( 2 * BUDGET + 80 ))   # plain DDP over sockets: up to twice the budget
START=$(date +%s)
DIR="$OUT/tta_gpu"
mkdir -p "$DIR"
if [[ -f "$RESULTS/results.jsonl" && ! -f "$DIR/results.jsonl" ]]; then
    cp "$RESULTS/results.jsonl" "$DIR/results.jsonl"  # what earlier calls finished: resume from it
fi
FP16=torch:fp16
PSGD=torch:powersgd:rank=4

run() {  # run NEED "study arguments": one configuration (with the fp16 hook's run, which sets its target)
    local need=$1; shift
    local left=$(( START + LIMIT - $(date +%s) ))
    if (( left < need )); then
        echo "stage $STAGE: ${left} s left in this call, the next configuration may need ${need} s: rerun to continue"
        exit 3
    fi
    timeout "$left" python3 -m lowbit study --preset tta --time-budget-s "$BUDGET" --out "$DIR" --no-progress \
        --no-report "$@" 2>&1 \
        | grep -E "^lowbit study|  done|run\(s\) done|Error|error|rerun" | tail -6
    local rc=${PIPESTATUS[0]}
    if (( rc != 0 )); then
        echo "stage $STAGE: lowbit study stopped (exit $rc); finished runs are in $DIR/results.jsonl: rerun to continue"
        exit "$rc"
    fi
}

case "$STAGE" in
    sockets|seeds)
        export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1
        nvidia-smi -L
        if [[ $STAGE == sockets ]]; then
            SEED=0
            CONFIGS=("$PSGD" "qsgd:bits=8,bucket=512" "qsgd:bits=4,bucket=512" "onebit:bucket=64" auto torch:ddp)
        else
            SEED=1
            CONFIGS=("$PSGD" "$BEST")
        fi
        run $ONE --seeds $SEED --codecs $FP16  # the target first
        for c in "${CONFIGS[@]}"; do
            need=$ONE
            [[ $c == torch:ddp ]] && need=$SLOW
            run $need --seeds $SEED --codecs $FP16 "$c"
        done
        ;;
    nodes)
        nvidia-smi -L
        run $ONE --world-sizes 4 --emulate-nodes 2 --algorithms hierarchical --codecs $FP16
        for c in "$PSGD" $BEST2; do
            run $ONE --world-sizes 4 --emulate-nodes 2 --algorithms hierarchical --codecs $FP16 "$c"
        done
        ;;
    report)
        python3 -m lowbit report "$DIR" --out "$DIR/report" 2>&1 | tail -2
        ;;
    *)
        echo "STAGE must be sockets, seeds, nodes or report, got $STAGE" >&2
        exit 2
        ;;
esac
echo "stage $STAGE complete: $DIR/results.jsonl ($(grep -c '"kind": "run"' "$DIR/results.jsonl" 2>/dev/null || echo 0) runs)"
