"""benchmarks/bench_overhead.py on CPU (--model tiny): the free-wire groups run FSDP2 and DDP with every
configuration, and the JSON has the documented shape. One subprocess per mode (each makes its own
process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_overhead.py"
FIELDS = {"mode", "model", "batch", "config", "ms_per_step", "ratio", "host_ms", "gpu_ms", "launches",
          "call_host_ms", "peak_mb", "mem_ratio", "residual_mb", "finite"}


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "o.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(BENCH), *args, "--model", "tiny", "--rounds", "2", "--steps", "2",
                           "--warmup", "1", "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode,wire", [("fsdp", "fake"), ("ddp", "fake"),
                                       pytest.param("fsdp", "mirror", marks=pytest.mark.slow),
                                       pytest.param("ddp", "mirror", marks=pytest.mark.slow)])
def test_bench_overhead_runs_every_configuration_on_cpu(tmp_path, mode, wire):
    subset = {"fsdp": ["--configs", "fsdp_bf16,q8_p8,q4ef_p8"], "ddp": ["--configs", "ddp;lowbit:onebit:bucket=64"]}
    doc = _run(tmp_path, "--mode", mode, "--wire", wire, *(subset[mode] if wire == "mirror" else []))
    meta, rows = doc["meta"], doc["rows"]
    assert meta["mode"] == mode and meta["commit"] and meta["card"] and meta["baseline"] in ("fsdp_bf16", "ddp")
    names = [r["config"] for r in rows]
    if wire == "mirror":
        assert names == (["fsdp_bf16", "q8_p8", "q4ef_p8"] if mode == "fsdp" else ["ddp", "lowbit:onebit:bucket=64"])
    elif mode == "fsdp":
        assert names == ["fsdp_bf16", "fsdp", "bf16", "bf16_r16", "q8", "q8_p8", "q4_p8", "q4ef_p8"]
    else:
        assert names[:2] == ["ddp", "fp16"] and "lowbit:auto" in names and len(names) == 7
    for r in rows:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert r["ms_per_step"] > 0 and len(r["ratios"]) == 2
        # the fake wire leaves receive buffers as memory held them (values may turn non-finite); the
        # mirror hands back real bytes, so every value stays finite
        assert isinstance(r["finite"], bool) and (r["finite"] or wire == "fake"), r["config"]
        if r["config"] == meta["baseline"]:
            assert r["ratio"] == 1.0
    by = {r["config"]: r for r in rows}
    if wire == "mirror":
        return
    if mode == "fsdp":  # lowbit's hooks were timed where they ran, FSDP's own where they did
        assert "lowbit_reduce_scatter" in by["q8_p8"]["call_host_ms"] and "lowbit_all_gather" in by["q8_p8"]["call_host_ms"]
        assert "lowbit_reduce_scatter" not in by["fsdp_bf16"]["call_host_ms"]
        assert by["q4ef_p8"]["residual_mb"] > 0 and by["q8_p8"]["residual_mb"] == 0
    else:
        assert by["lowbit:qsgd:bits=8,bucket=512"]["call_host_ms"]["ddp_comm_hook"]["calls"] > 0
        assert "ddp_comm_hook" not in by["ddp"]["call_host_ms"]
