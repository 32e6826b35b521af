"""The localsgd preset cut down, on two gloo workers over one emulated link with a latency (issue 45): DDP
fp32 sets the target, local SGD runs (4-bit QSGD with error feedback, streaming with overlapping
communication) take it, each on its own schedule over its budget, sync every few steps and send about 1/8
of fp32 local SGD's bytes per outer step; the report's table carries the strict time. ~10 s."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowbit.lab.cli import main
from lowbit.lab.study.report import load_runs
from lowbit.lab.study.store import ResultStore
from lowbit.lab.study.tta import tta_table

_CUT_DOWN = """extends = "localsgd"
codecs = ["torch:ddp"]
world_sizes = [2]
seeds = [0]
emulate_link = ["100mbit@10ms"]
time_budget_s = 1.5
eval_every_s = 0.4
eval_samples = 32
batch_sizes = [8]
local_steps = 4
also = [{parallelism = ["localsgd"], codecs = ["fp32", "qsgd:bits=4,bucket=512"]},
        {parallelism = ["localsgd"], codecs = ["qsgd:bits=4,bucket=512"], fragments = 2, overlap = 1}]
[model_args.gpt2_small]
n_layers = 1
n_heads = 2
d_model = 32
context = 32
[dataset_args.pysource]
seq_len = 32
max_files = 30
"""


def test_cut_down_localsgd_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOWBIT_KERNELS", "reference")
    cfg = tmp_path / "localsgd.toml"
    cfg.write_text(_CUT_DOWN)
    out = tmp_path / "res"
    assert main(["study", "--config", str(cfg), "--out", str(out), "--no-progress", "--no-report"]) == 0
    rows = {(r["config"]["parallelism"], r["config"]["codec"], r["config"].get("fragments", 1)): r
            for r in ResultStore(out).rows() if r["kind"] == "run"}
    assert len(rows) == 4
    fp32 = rows[("localsgd", "fp32", 1)]
    q4 = rows[("localsgd", "qsgd:bits=4,bucket=512,norm=max,rounding=stochastic", 1)]
    for r in (fp32, q4, rows[("localsgd", "qsgd:bits=4,bucket=512,norm=max,rounding=stochastic", 2)]):
        s = r["summary"]
        assert s["target_from"] == "torch:ddp" and s["target_loss"] == rows[("data", "torch:ddp", 1)]["summary"][
            "final_val_loss"]
        assert s["target_loss_rule"] == pytest.approx(s["target_loss"] * 1.01)
        assert s["steps"] >= 4 and s["bytes_sent_total"] > 0
        # the preset's rule: each its own schedule over its own budget (none replayed), to the target
        assert r["config"]["target_schedule"] == "own" and s["schedule_steps"] is None
        assert s["stop_reason"] in ("target", "budget") and s["time_budget_s"] == 1.5
    assert q4["config"]["error_feedback"] is True and fp32["config"]["error_feedback"] is False
    assert rows[("localsgd", "qsgd:bits=4,bucket=512,norm=max,rounding=stochastic", 2)]["config"]["overlap"] == 1
    # bytes per outer step: 4-bit deltas about 1/8 of fp32's (scales and slots on top)
    per = {k: r["summary"]["bytes_sent_total"] / (r["summary"]["steps"] // 4) for k, r in (("fp32", fp32), ("q4", q4))}
    assert 1 / 8 <= per["q4"] / per["fp32"] <= 1 / 8 * 1.05, per
    # collectives a step (each pays the link's latency; the speed model's cross-over check reads them):
    # PyTorch's allreduce of DDP's one bucket; an outer step's payload and its per-call check (CPU) every
    # 4 steps, and those of each of 2 fragments when streaming
    col = {k: r["summary"]["collectives_per_step"] for k, r in rows.items()}
    assert col[("data", "torch:ddp", 1)] == 1.0
    for key, f in ((("localsgd", "fp32", 1), 1), (("localsgd", q4["config"]["codec"], 1), 1),
                   (("localsgd", q4["config"]["codec"], 2), 2)):
        steps = rows[key]["summary"]["steps"]
        n = round(col[key] * steps)
        assert n == pytest.approx(col[key] * steps) and n % 2 == 0, (key, col[key], steps)  # pairs
        # a pair per fragment's exchange: F of them each period of 4 steps (the run may stop within one)
        assert 2 * f * (steps // 4) <= n <= 2 * f * -(-steps // 4), (key, n, steps)
    runs, _ = load_runs(out)
    table = tta_table(runs)
    assert {r["label"] for r in table} >= {"QSGD 4bit/512 +EF [local SGD H=4]", "QSGD 4bit/512 +EF [local SGD H=4, F=2, overlap 1]"}
    assert all("time_to_target_strict_s" in r for r in table)
