"""benchmarks/trace_steps.py on a small hand-made chrome trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import trace_steps  # noqa: E402


def test_summary_cuts_steps_and_finds_gaps_kernels_and_hook_time(tmp_path) -> None:
    def x(name, cat, ts, dur, tid=1):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid}

    events = [x("DistributedDataParallel.forward", "gpu_user_annotation", 0, 10),
              x("conv", "kernel", 0, 1000), x("conv", "kernel", 1500, 1000),  # 0.5 ms idle at 1.0 ms
              x("ncclDevKernel_AllGather_RING_LL", "kernel", 2000, 3000, tid=2),
              x("lowbit.ddp.hook", "user_annotation", 1900, 400, tid=9),
              x("DistributedDataParallel.forward", "gpu_user_annotation", 6000, 10)]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = trace_steps.summary(str(path))
    assert "step   6.00 ms, compute busy  2.00 ms" in out
    assert "[2.0+3.0]" in out and "@1.0:0.50" in out
    assert "median 0.40 ms" in out
