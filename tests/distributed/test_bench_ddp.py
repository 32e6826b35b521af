"""benchmarks/bench_ddp.py under torchrun on gloo: 2 ranks, a tiny model, plain DDP, fp16 and a lowbit hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_ddp_torchrun_cpu(tmp_path: Path) -> None:
    out = tmp_path / "ddp.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    hooks = "ddp;fp16;powersgd;lowbit:qsgd:bits=8,bucket=512;lowbit[mb=0]:qsgd:bits=8,bucket=512;lowbit:nosuchcodec"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "bench_ddp.py"), "--device", "cpu", "--models", "small_cnn",
           "--hooks", hooks, "--batch", "8", "--warmup", "3", "--steps", "2", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "| small_cnn |" in proc.stdout  # rank 0's markdown tables

    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert meta["world_size"] == 2 and meta["backend"] == "gloo" and meta["link"] == "cpu"
    assert meta["torch_version"] and "NCCL_P2P_DISABLE" in meta["nccl_env"] and meta["finished"]
    res = doc["results"]["small_cnn"]
    assert res["params"] > 0 and res["global_batch"] == 16
    hooks_out = res["hooks"]
    for h in ("ddp", "fp16", "lowbit:qsgd:bits=8,bucket=512", "lowbit[mb=0]:qsgd:bits=8,bucket=512"):
        r = hooks_out[h]
        assert len(r["raw_samples_per_s"]) == 2 and r["samples_per_s"] > 0 and r["step_ms"] > 0, h
        assert r["ratio_vs_ddp"] > 0 and r["errors"] == []
    assert hooks_out["ddp"]["ratio_vs_ddp"] == 1.0 and hooks_out["ddp"]["bytes_sent_per_step"] is None
    assert hooks_out["powersgd"]["skipped"] and hooks_out["powersgd"]["samples_per_s"] is None  # gloo: skipped
    # A bad spec fails on every rank at registration: recorded per round, and the run goes on.
    bad = hooks_out["lowbit:nosuchcodec"]
    assert bad["samples_per_s"] is None and len(bad["errors"]) == 2 and "nosuchcodec" in bad["errors"][0]
    assert [e["hook"] for e in doc["errors"]] == ["lowbit:nosuchcodec"] * 2
    # message_mb=0 (one message per tensor) sends more 16-byte-aligned slots, never fewer bytes.
    assert (hooks_out["lowbit[mb=0]:qsgd:bits=8,bucket=512"]["bytes_sent_per_step"]
            >= hooks_out["lowbit:qsgd:bits=8,bucket=512"]["bytes_sent_per_step"] > 0)


def test_lowbit_hook_options() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_ddp
    finally:
        sys.path.pop(0)
    assert bench_ddp.lowbit_hook("lowbit:qsgd:bits=8") == ("qsgd:bits=8", {})
    assert bench_ddp.lowbit_hook("lowbit[mb=256,algorithm=allgather]:qsgd:bits=4,bucket=512") == (
        "qsgd:bits=4,bucket=512", {"message_mb": 256.0, "algorithm": "allgather"})
    assert bench_ddp.lowbit_hook("fp16") is None
    for bad in ("lowbit[mb=x]:fp32", "lowbit[size=3]:fp32", "lowbit[mb]:fp32"):
        try:
            bench_ddp.lowbit_hook(bad)
        except SystemExit as e:
            assert bad in str(e)
        else:
            raise AssertionError(bad)
