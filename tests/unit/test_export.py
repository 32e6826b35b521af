"""Study results as CSV and TensorBoard logs (`lowbit export`, the report's tables)."""

from __future__ import annotations

import csv
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

from lowbit.lab.cli import main
from lowbit.extras import MissingExtra
from lowbit.lab.study.export import TensorBoardLog, export_tensorboard, write_csv
from lowbit.lab.study.report import load_runs

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "study_cpu_default" / "results.jsonl"


def _read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_holds_every_run_and_epoch(tmp_path: Path) -> None:
    runs, _ = load_runs(REAL)
    runs_csv, epochs_csv = write_csv(runs, tmp_path)
    table = _read(runs_csv)
    assert len(table) == len(runs) and len({r["key"] for r in table}) == len(runs)
    by_key = {r["key"]: r for r in runs}
    for row in table:
        src = by_key[row["key"]]
        assert row["codec"] == src["codec"] and int(row["world_size"]) == src["world_size"]
        assert math.isclose(float(row["final_test_acc"]), src["summary"]["final_test_acc"], rel_tol=1e-12)
        assert row["label"] == src["label"]
    epochs = _read(epochs_csv)
    assert len(epochs) == sum(len(r["epoch_rows"]) for r in runs)
    first = runs[0]
    mine = sorted((e for e in epochs if e["key"] == first["key"]), key=lambda e: int(e["epoch"]))
    assert [float(e["train_loss"]) for e in mine] == pytest.approx([e["train_loss"] for e in first["epoch_rows"]])


def test_csv_writes_non_finite_as_empty(tmp_path: Path) -> None:
    runs, _ = load_runs(REAL)
    run = json.loads(json.dumps(runs[0]))
    run["summary"]["final_test_loss"] = float("nan")
    run["epoch_rows"][0]["test_loss"] = float("inf")
    runs_csv, epochs_csv = write_csv([run], tmp_path)
    assert _read(runs_csv)[0]["final_test_loss"] == ""
    assert _read(epochs_csv)[0]["test_loss"] == ""


def test_tensorboard_export_reads_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs, _ = load_runs(REAL)
    runs = runs[:2]
    assert export_tensorboard(runs, tmp_path) == 2
    dirs = sorted(tmp_path.iterdir())
    assert len(dirs) == 2
    for run in runs:
        (d,) = [d for d in dirs if d.name.endswith(run["key"])]
        ea = EventAccumulator(str(d))
        ea.Reload()
        acc = ea.Scalars("accuracy/test")
        assert [e.step for e in acc] == [e["epoch"] for e in run["epoch_rows"]]
        assert [e.value for e in acc] == pytest.approx([e["test_acc"] for e in run["epoch_rows"]], rel=1e-6)
        assert "speed/samples_per_s" in ea.Tags()["scalars"]


def test_export_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = tmp_path / "res"
    res.mkdir()
    shutil.copy(REAL, res / "results.jsonl")
    assert main(["export", str(res), "--csv", str(tmp_path / "csv"), "--tensorboard", str(tmp_path / "tb")]) == 0
    out = capsys.readouterr().out
    assert "runs.csv" in out and "epochs.csv" in out and "tensorboard" in out
    assert (tmp_path / "csv" / "runs.csv").exists() and any((tmp_path / "tb").iterdir())
    # nothing to export to, no results: one line, exit code 2
    assert main(["export", str(res)]) == 2
    assert "--csv DIR and/or --tensorboard DIR" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), "--csv", str(tmp_path / "c")]) == 2
    assert "no results" in capsys.readouterr().err


def test_tensorboard_missing_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(MissingExtra, match=r"lowbit\[tensorboard\]"):
        TensorBoardLog(tmp_path)


def test_csv_cells_that_a_spreadsheet_would_run_are_escaped(tmp_path: Path) -> None:
    """OWASP's CSV-injection rule: a text cell starting with = + - @ tab or CR gets a leading ' so a
    spreadsheet shows it as text; numbers (negative ones too) stay numbers."""
    runs, _ = load_runs(REAL)
    run = json.loads(json.dumps(runs[0]))
    hostile = {"network": "=HYPERLINK(\"http://x\",\"y\")", "dataset": "+cmd|' /C calc'!A0", "codec": "-2+3",
               "label": "@SUM(A1:A9)", "algorithm": "\tallreduce", "backend": "\r=1"}
    run.update(hostile)
    run["summary"] = {**run["summary"], "final_test_acc": -0.25, "=evil": 1.0}
    run["labels"] = {**run["labels"], "data": "=1+1"}
    run["epoch_rows"] = [{**e, "train_loss": -1.5, "=field": "=2"} for e in run["epoch_rows"]]
    runs_csv, epochs_csv = write_csv([run], tmp_path)
    text = runs_csv.read_text()
    row = _read(runs_csv)[0]
    for field, value in hostile.items():
        assert row[field] == "'" + value, (field, row[field])
    assert row["labels.data"] == "'=1+1"
    assert float(row["final_test_acc"]) == -0.25  # a negative number is a number, not text
    assert "'=evil" in row and ",=" not in text and ",\"=" not in text
    epochs = _read(epochs_csv)
    assert float(epochs[0]["train_loss"]) == -1.5 and epochs[0]["'=field"] == "'=2"
    assert epochs[0]["network"] == "'" + hostile["network"]
    assert row["seed"] == str(runs[0]["seed"]) and row["world_size"] == str(runs[0]["world_size"])


def test_csv_cells_that_start_like_a_formula_after_spaces_are_escaped(tmp_path: Path) -> None:
    """Spreadsheets skip leading spaces before they look for a formula: " =1+1" runs like "=1+1", so it is
    escaped too (issue 44); a plain number after spaces is still a number, not text."""
    runs, _ = load_runs(REAL)
    run = json.loads(json.dumps(runs[0]))
    hostile = {"network": " =1+1", "dataset": "   +cmd|' /C calc'!A0", "codec": " -2+3", "label": "\n@SUM(A1:A9)",
               "algorithm": " \t=1", "backend": "  \r=1"}
    run.update(hostile)
    run["labels"] = {**run["labels"], "data": " =HYPERLINK(\"http://x\")", "plain": "  -0.5"}
    runs_csv, _ = write_csv([run], tmp_path)
    row = _read(runs_csv)[0]
    for field, value in hostile.items():
        assert row[field] == "'" + value, (field, row[field])
    assert row["labels.data"] == "' =HYPERLINK(\"http://x\")" and row["labels.plain"] == "  -0.5"
