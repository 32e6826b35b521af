"""benchmarks/bench_ddp.py under torchrun on gloo: 2 ranks, a tiny model, plain DDP, fp16 and a lowbit hook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


HOOKS = "ddp;fp16;powersgd;lowbit:qsgd:bits=8,bucket=512;lowbit[mb=0]:qsgd:bits=8,bucket=512;lowbit:nosuchcodec"


def _args(out: Path) -> list[str]:
    return ["--device", "cpu", "--models", "small_cnn", "--hooks", HOOKS, "--batch", "8", "--warmup", "3",
            "--steps", "2", "--rounds", "2", "--out", str(out)]


def bench_as_torchrun_rank(rank: int, world: int, port: int, script: str, argv: list[str]) -> tuple[int, str]:
    """A spawned rank that drops the group spawn made and runs benchmarks/<script>'s main(argv) as a
    torchrun rank would (RANK / WORLD_SIZE / MASTER_* set; the script makes and ends its own group).
    Returns (its exit code, what it printed)."""
    import contextlib
    import importlib.util
    import io

    import torch.distributed as dist

    dist.destroy_process_group()  # (lowbit.launch's shutdown then finds none to tear down)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(script, ROOT / "benchmarks" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = mod.main(argv)
    return rc, buf.getvalue()


def run_bench_in_spawned_ranks(script: str, argv: list[str], monkeypatch) -> str:
    """benchmarks/<script>.py on 2 spawned gloo ranks with torchrun's environment, the reference kernels;
    rank 0's output."""
    import socket

    from lowbit.launch import spawn

    monkeypatch.setenv("LOWBIT_KERNELS", "reference")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (rc0, out0), (rc1, _) = spawn(bench_as_torchrun_rank, 2, port, script, argv, backend="gloo", timeout_s=120)
    assert rc0 == 0 and rc1 == 0, (rc0, rc1, out0[-3000:])
    return out0


def test_bench_ddp_in_spawned_ranks(tmp_path: Path, monkeypatch) -> None:
    """Fast equivalent of test_bench_ddp_torchrun_cpu (slow): the same arguments and checks, with
    bench_ddp's main() run in 2 spawned ranks that carry torchrun's environment (no torchrun, no fresh
    interpreters) on the reference kernels."""
    out = tmp_path / "ddp.json"
    stdout = run_bench_in_spawned_ranks("bench_ddp", _args(out), monkeypatch)
    assert "| small_cnn |" in stdout  # rank 0's markdown tables
    _check_doc(out)


@pytest.mark.slow
def test_bench_ddp_torchrun_cpu(tmp_path: Path) -> None:
    """Fast equivalent: test_bench_ddp_in_spawned_ranks."""
    out = tmp_path / "ddp.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "bench_ddp.py"), *_args(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "| small_cnn |" in proc.stdout  # rank 0's markdown tables
    _check_doc(out)


def _check_doc(out: Path) -> None:
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
    assert bench_ddp.lowbit_hook("lowbit[level=bold,guard=10]:auto") == ("auto", {"auto_level": "bold", "guard_every": 10})
    assert bench_ddp.lowbit_hook("fp16") is None
    for bad in ("lowbit[mb=x]:fp32", "lowbit[size=3]:fp32", "lowbit[mb]:fp32"):
        try:
            bench_ddp.lowbit_hook(bad)
        except SystemExit as e:
            assert bad in str(e)
        else:
            raise AssertionError(bad)
