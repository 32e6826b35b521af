#!/bin/bash
# torchrun --no-python: one cProfile'd bench_hybrid per rank
exec python -m cProfile -o "$OUT/cp_rank${RANK}.prof" benchmarks/bench_hybrid.py "$@"
