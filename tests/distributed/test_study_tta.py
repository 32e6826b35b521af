"""Time to accuracy in the study on two gloo workers: the ranks stop at the same step whatever their own
clocks say, a target run hands its loss and schedule to the others across a crash and a resume, and the
report's table and CSV files carry the results.

Cost: the agreement checks share one spawn (~2 s); the cut-down study (the tta_cpu preset with two
configurations, budgets of a second or two, a smaller GPT and slice) one invocation, ~8 s; the same with a
crash between its runs, and the whole tta_cpu preset with its report, are marked slow."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from lowbit.lab.cli import main
from lowbit.launch import spawn
from lowbit.lab.models import build_model
from lowbit.lab.study.config import StudyConfig
from lowbit.lab.study.runs import RunConfig, expand_runs
from lowbit.lab.study.export import write_csv, write_curves_csv
from lowbit.lab.study.metrics import TailClock
from lowbit.lab.study.report import load_runs, write_report
from lowbit.lab.study.runner import CRASH_ENV
from lowbit.lab.study.store import ResultStore
from lowbit.lab.study.train import _ToTarget, _Trainer, make_optimizer
from lowbit.lab.study.tta import tta_table
from tests.distributed.shared_spawn import part, run_parts


# ------------------------------------------------------------------------------------ the stop rule
def _stop_body(rank: int, world: int, changes: dict, slow_rank: int) -> dict:
    """A short time-to-accuracy run of a tiny MLP with torch's fp16 hook, where ``slow_rank`` sleeps 30 ms
    before each step's forward pass: what each rank decided."""
    torch.set_num_threads(1)
    cfg = StudyConfig(networks=("mlp",), datasets=("synthetic",), codecs=("torch:fp16",), world_sizes=(2,),
                      **changes)
    run = expand_runs(cfg)[0]
    torch.manual_seed(0)
    model = build_model("mlp", num_classes=4, in_shape=(8,), hidden=[16], dropout=[0.0, 0.0])
    trainer = _Trainer(run, model, rank, world, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(512, 8, generator=g), torch.randint(0, 4, (512,), generator=g)
    loader = trainer.loader(x, y)
    step = trainer.step

    def slow_step(*args):  # the slow rank's own clock runs ahead of the other's
        if rank == slow_rank:
            time.sleep(0.03)
        return step(*args)

    trainer.step = slow_step
    tta = _ToTarget(run, trainer, world, torch.device("cpu"), len(loader), x[:64], y[:64])
    opt = make_optimizer(run, trainer.parameters())
    clock = TailClock(model.parameters(), False)
    for epoch in range(run.epochs):
        loader.set_epoch(epoch)
        tta.epoch(epoch, loader, opt, clock)
        if tta.stop:
            break
    clock.remove()
    return {"steps": tta.step, "clock": tta.clock, "local": tta.local, "stop": tta.stop,
            "curve": [(p["step"], p["val_loss"]) for p in tta.curve], "summary": tta.summary()}


@pytest.fixture(scope="module")
def stops() -> list:
    parts = (("budget", _stop_body, ({"time_budget_s": 0.5, "eval_every_s": 0.15, "epochs": 50}, 1)),
             ("target", _stop_body, ({"target_loss": 1.3, "eval_every": 3, "epochs": 50, "lr": 0.2}, 0)),
             ("epochs", _stop_body, ({"eval_every": 5, "epochs": 2}, 0)))
    return spawn(run_parts, 2, parts, backend="gloo", timeout_s=120)


def test_ranks_stop_together_at_the_budget_of_the_slowest_clock(stops) -> None:
    a, b = part(stops, "budget")
    assert a["stop"] == b["stop"] == "budget"
    assert a["steps"] == b["steps"] and a["curve"] == b["curve"]  # the same steps, validated at the same steps
    assert a["clock"] == b["clock"] >= 0.5
    # the ranks' own clocks differ (DDP makes the fast rank wait for the slow one inside its steps, so by
    # less than a step): the agreed clock is the larger, and every decision was taken on it
    assert a["local"] != b["local"] and a["clock"] == max(a["local"], b["local"])
    assert len(a["curve"]) >= 3  # every 0.15 s of the agreed clock, and at the stop
    assert a["summary"]["reached_target"] is None and a["summary"]["time_to_target_s"] is None


def test_ranks_stop_together_at_the_target(stops) -> None:
    a, b = part(stops, "target")
    assert a["stop"] == b["stop"] == "target" and a["steps"] == b["steps"]
    s = a["summary"]
    assert s["reached_target"] and s["steps_to_target"] == a["steps"] and s["steps_to_target"] % 3 == 0
    assert a["curve"][-1][1] <= 1.3 and all(loss > 1.3 for _, loss in a["curve"][:-1])  # the first one that met it
    assert s["time_to_target_s"] == pytest.approx(a["clock"])


def test_runs_without_a_stop_train_their_epochs(stops) -> None:
    a, b = part(stops, "epochs")
    assert a["stop"] == b["stop"] == "" and a["summary"]["stop_reason"] == "epochs"
    assert a["steps"] == b["steps"] == 2 * (512 // (2 * 32))  # two epochs of 8 steps, validated every 5 and at ends
    assert [s for s, _ in a["curve"]] == [5, 8, 10, 15, 16]


# ------------------------------------------------------------------------------------ a study
_CUT_DOWN = """extends = "tta_cpu"
codecs = ["torch:fp16", "qsgd:bits=8,bucket=512"]
time_budget_s = {budget}
target_budget_factor = 2
eval_every_s = 0.4
eval_samples = 32
batch_sizes = [8]
[model_args.gpt2_small]
n_layers = 1
n_heads = 2
d_model = 32
context = 32
[dataset_args.pysource]
seq_len = 32
max_files = 30
"""


def _run_rows(out: Path) -> list[dict]:
    return [r for r in ResultStore(out).rows() if r["kind"] == "run"]


def _cut_down_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, budget: float, crash: bool) -> Path:
    """The tta_cpu preset cut down; with ``crash``, crashed after its first run (the one that sets the
    target) and resumed, so that the other run takes its target from the results file, else in the group
    from the row just computed. Either way a rerun finds both done under the keys they were saved with."""
    monkeypatch.setenv("LOWBIT_KERNELS", "reference")
    cfg = tmp_path / "tta.toml"
    cfg.write_text(_CUT_DOWN.format(budget=budget))
    out = tmp_path / "res"
    study = ["study", "--config", str(cfg), "--out", str(out), "--no-progress", "--no-report"]
    if crash:
        monkeypatch.setenv(CRASH_ENV, "1")
        assert main(study) == 1
        rows = _run_rows(out)
        assert [r["config"]["codec"] for r in rows] == ["torch:fp16"]  # the target's run first, saved
        monkeypatch.delenv(CRASH_ENV)
        assert main([*study, "--dry-run"]) == 0
        listing = capsys.readouterr().out
        assert "(1 to do)" in listing and "target loss=" in listing  # its target known from the saved row
    assert main(study) == 0
    assert main([*study, "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert "(0 to do)" in listing and "target to come" not in listing  # the keys the rows were saved with
    assert main(study) == 0
    assert "0 to run" in capsys.readouterr().out  # and nothing runs twice
    return out


def _check_cut_down(out: Path) -> None:
    source, other = _run_rows(out)
    s, o = source["summary"], other["summary"]
    assert s["target_from"] == "torch:fp16" and s["stop_reason"] == "budget" and s["reached_target"]
    assert s["target_loss"] == s["final_val_loss"] == source["curve"][-1]["val_loss"]
    assert len(source["schedule"]) == s["steps"] and source["schedule"] == sorted(source["schedule"])
    # the other run took the target and the schedule from the saved row: in its config, so in its key
    assert other["config"]["target_loss"] == o["target_loss"] == s["final_val_loss"]
    assert other["config"]["schedule"] == source["schedule"]
    assert other["key"] == RunConfig.from_dict(other["config"]).key() != source["key"]
    assert other["config"]["time_budget_s"] == 2 * source["config"]["time_budget_s"]
    assert o["stop_reason"] in ("target", "budget", "schedule") and o["steps"] <= len(source["schedule"])
    if o["reached_target"]:
        assert o["time_to_target_s"] <= o["tta_train_s"] and o["steps_to_target"] <= o["steps"]
    else:
        assert o["time_to_target_s"] is None and o["final_val_loss"] > o["target_loss"]
    for row in (source, other):
        assert row["curve"] and all(p["train_s"] <= row["summary"]["tta_train_s"] for p in row["curve"])
        assert row["summary"]["eval_s"] > 0 and row["summary"]["eval_points"] == len(row["curve"])
        assert math.isnan(row["epochs"][0]["encode_s"] or math.nan) == (row["config"]["codec"] == "torch:fp16")


def _check_tables(out: Path, tmp_path: Path) -> None:
    runs, _ = load_runs(out)
    table = {r["codec"]: r for r in tta_table(runs)}
    fp16 = table["torch:fp16"]
    assert fp16["sets_target"] and fp16["reached"] == 1 and fp16["ratios"]["torch:fp16"] == (1.0, 1)
    q = table["qsgd:bits=8,bucket=512,norm=max,rounding=stochastic"]
    if q["reached"]:
        assert q["ratios"]["torch:fp16"][0] == pytest.approx(fp16["time_to_target_s"] / q["time_to_target_s"])
    else:
        assert q["time_to_target_s"] is None and q["ratios"]["torch:fp16"] == (None, 0)
    runs_csv, _ = write_csv(runs, tmp_path / "csv")
    header = runs_csv.read_text().splitlines()[0].split(",")
    for col in ("time_to_target_s", "steps_to_target", "reached_target", "stop_reason", "target_loss", "eval_s",
                "tta_x_vs_torch_fp16"):
        assert col in header, col
    curves = write_curves_csv(runs, tmp_path / "csv").read_text().splitlines()
    assert len(curves) == 1 + sum(len(r["curve"]) for r in runs) and "val_loss" in curves[0]


def test_target_from_hands_its_target_on_fast(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The cut-down tta_cpu preset in one invocation: the fp16 hook's run sets the target and the other run
    takes it in the same group; a dry run and a rerun, which take it from the results file, find both done;
    the tables read both (no drawing here: the slow test draws the report). Slow equivalent with a crash
    between the two runs: test_target_from_across_a_crash_and_resume."""
    out = _cut_down_study(tmp_path, monkeypatch, capsys, budget=0.8, crash=False)
    _check_cut_down(out)
    _check_tables(out, tmp_path)


@pytest.mark.slow
def test_target_from_across_a_crash_and_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """A crash after the run that sets the target: the resumed study gives the other run that target and
    schedule from the results file."""
    out = _cut_down_study(tmp_path, monkeypatch, capsys, budget=1.0, crash=True)
    _check_cut_down(out)


@pytest.mark.slow
def test_tta_cpu_preset_end_to_end_with_its_report(tmp_path: Path) -> None:
    """``lowbit study --preset tta_cpu`` as a user runs it (about 3 minutes on 2 cores), then its report:
    the time-to-accuracy panel and table. Fast equivalent: test_target_from_across_a_crash_and_resume_fast."""
    out = tmp_path / "tta"
    assert main(["study", "--preset", "tta_cpu", "--out", str(out), "--no-progress"]) == 0
    rows = _run_rows(out)
    assert len(rows) == 7 and rows[0]["config"]["codec"] == "torch:fp16"
    target = rows[0]["summary"]["final_val_loss"]
    assert all(r["summary"]["target_loss"] == target for r in rows)
    html = (out / "report" / "index.html").read_text()
    assert "<h2>Time to accuracy</h2>" in html and "tta_validation_vs_time.png" in html
    assert (out / "report" / "tta_validation_vs_time.png").stat().st_size > 10_000
    for r in rows:
        label = r["labels"]["codec"]
        assert label in html
    assert "× sooner than fp16 hook (torch)" in html and "× sooner than PowerSGD r4 (torch)" in html
    if not all(r["summary"]["reached_target"] for r in rows):
        assert "not reached" in html
    assert (out / "report" / "curves.csv").exists()
    assert json.loads(json.dumps(rows[0]["schedule"]))  # (plain data)
    _check_tables(out, tmp_path)
