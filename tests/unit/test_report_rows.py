"""`lowbit report` skips parseable but malformed run rows, with a warning naming the line."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from lowbit.lab.study.report import load_runs, write_report

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "study_cpu_default" / "results.jsonl"


def test_malformed_rows_are_skipped_with_their_line_unrendered(tmp_path: Path) -> None:
    """Fast equivalent of test_malformed_rows_are_skipped_with_their_line (slow): the same rows and
    warnings, without drawing the report from them (~3 s of matplotlib)."""
    _malformed(tmp_path, render=False)


@pytest.mark.slow
def test_malformed_rows_are_skipped_with_their_line(tmp_path: Path) -> None:
    """Fast equivalent: test_malformed_rows_are_skipped_with_their_line_unrendered."""
    _malformed(tmp_path, render=True)


def _malformed(tmp_path: Path, render: bool) -> None:
    path = tmp_path / "results.jsonl"
    shutil.copy(REAL, path)
    good = [json.loads(x) for x in REAL.read_text().splitlines() if x.strip() and json.loads(x).get("kind") == "run"]
    n_lines = len(REAL.read_text().splitlines())
    base = good[0]
    bad = []
    for i, change in enumerate([
        lambda r: r["config"].pop("codec"),
        lambda r: r.__setitem__("summary", "fast"),
        lambda r: r.__setitem__("epochs", [1, 2]),
        lambda r: r["config"].__setitem__("codec", "qsgd:bits=99"),
        lambda r: r.__setitem__("config", None),
        lambda r: r["config"].__setitem__("world_size", "two"),
    ]):
        row = json.loads(json.dumps(base))
        row["key"] = f"bad{i}"
        change(row)
        bad.append(row)
    with open(path, "a") as f:
        for row in bad:
            f.write(json.dumps(row) + "\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs, notes = load_runs(path)
    assert len(runs) == len(good)
    assert notes["malformed_rows"] == len(bad)
    msgs = [str(w.message) for w in caught]
    for i in range(len(bad)):
        assert any(f"line {n_lines + 1 + i}:" in m and f"bad{i}" in m for m in msgs), (i, msgs)
    if not render:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_report(path, tmp_path / "report")  # the whole report still renders
    assert (tmp_path / "report" / "index.html").exists()


def test_no_verdict_when_fp32_did_not_learn() -> None:
    from lowbit.lab.study.report import accuracy_matches

    def run(codec: str, acc: float, seed: int) -> dict:
        return {"network": "mlp", "dataset": "digits", "world_size": 2, "backend": "gloo", "batch_size": 32,
                "seed": seed, "epochs": 1, "codec": codec, "label": codec, "bits": 32.0 if codec == "fp32" else 8.0,
                "synthetic": False, "summary": {"final_test_acc": acc, "num_classes": 10}, "algorithm": "allreduce",
                "batch_preset": ""}

    chance = [run("fp32", 0.085, 0), run("qsgd:bits=8,bucket=512", 0.09, 0)]
    learned = [run("fp32", 0.95, 0), run("qsgd:bits=8,bucket=512", 0.948, 0)]
    v = {r["codec"]: r["verdict"] for r in accuracy_matches(chance)}
    assert v["qsgd:bits=8,bucket=512"] == "fp32 did not learn"
    v = {r["codec"]: r["verdict"] for r in accuracy_matches(learned)}
    assert v["qsgd:bits=8,bucket=512"] == "matches"


def test_scalability_series_per_node_layout_and_algorithm(tmp_path) -> None:
    """A study at 1, 2, 4 workers as one node and as 2 emulated nodes, flat and hierarchical: the
    scalability table (Figs 12-15's data) has one row per codec x algorithm x layout, the one-worker
    fp32 run its baseline."""
    import json

    from lowbit.lab.study.report import _sps_tables, load_runs

    rows = []
    for k, nodes, codec, algo, sps in [(1, 1, "fp32", "none", 100.0), (2, 1, "fp32", "allreduce", 190.0),
                                       (4, 1, "fp32", "allreduce", 370.0), (4, 2, "fp32", "allreduce", 150.0),
                                       (4, 2, "qsgd:bits=4,bucket=512", "scatter_gather", 250.0),
                                       (4, 2, "qsgd:bits=4,bucket=512", "hierarchical", 330.0)]:
        cfg = {"network": "mlp", "dataset": "digits", "codec": codec, "algorithm": algo, "error_feedback": False,
               "world_size": k, "backend": "gloo", "device": "cpu", "batch_size": 32, "epochs": 1, "seed": 0,
               "nodes": nodes, "batch_preset": ""}
        rows.append({"kind": "run", "key": f"{k}-{nodes}-{codec}-{algo}", "config": cfg, "labels": {},
                     "summary": {"samples_per_s": sps, "final_test_acc": 0.9}, "epochs": []})
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, _ = load_runs(path)
    labels = {r["label"] for r in runs}
    assert {"32bit", "32bit (2 nodes)", "QSGD 4bit/512 (2 nodes)", "QSGD 4bit/512 [hierarchical] (2 nodes)"} <= labels
    html = _sps_tables(runs)
    assert html.count("<h3>") == 1  # one setting: the layouts are rows of it, not settings of their own
    for lab in ("32bit (2 nodes)", "QSGD 4bit/512 [hierarchical] (2 nodes)"):
        assert lab in html


def test_one_reader_for_the_report_and_the_speed_model(tmp_path: Path) -> None:
    """The report (load_runs), the speed model (load_run_records) and read_runs read the same rows of
    a damaged, partial results file, warn the same, and fail the same on a missing one."""
    import pytest

    from lowbit.lab.study.store import load_run_records, read_runs

    path = tmp_path / "results.jsonl"
    text = REAL.read_text()
    base = next(json.loads(x) for x in text.splitlines() if x.strip() and json.loads(x).get("kind") == "run")
    bad = json.loads(json.dumps(base))
    bad["key"], bad["config"]["world_size"] = "bad", "two"
    again = json.loads(json.dumps(base))
    again["summary"] = {"samples_per_s": -1.0}  # a second run row of a finished key: the first one counts
    path.write_text(text + '{"kind": "run", "key": "torn", "conf\n' + json.dumps(bad) + "\n" + json.dumps(again) + "\n"
                    + '{"kind": "epoch", "key": "k", "attempt": "cut", "epoch": 0}\n[1, 2]\n'
                    + '{"kind": "run", "key": "torn2"')
    out = {}
    for name, read in (("rows", read_runs), ("report", load_runs), ("model", load_run_records)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = read(path)
        out[name] = got, [str(w.message) for w in caught]
    (rows, notes), w_rows = out["rows"]
    keys = [r["key"] for r in rows]
    assert keys == [r["key"] for r in out["report"][0][0]] == [r.key for r in out["model"][0]]
    assert "bad" not in keys and "torn" not in keys and len(keys) == len(set(keys))
    assert next(r for r in rows if r["key"] == base["key"])["summary"] == base["summary"]
    assert w_rows == out["report"][1] == out["model"][1] and len(w_rows) == 1 and "'bad'" in w_rows[0]
    assert notes == out["report"][0][1]
    assert notes["malformed_rows"] == 1 and notes["skipped_lines"] == 4  # torn x2, [1, 2], bad
    assert notes["incomplete_attempts"] == 1 and notes["incomplete_epochs"] == 1
    errors = set()
    for read in (read_runs, load_runs, load_run_records):
        with pytest.raises(ValueError) as exc:
            read(tmp_path / "missing")
        errors.add(str(exc.value))
    assert len(errors) == 1 and "not found" in errors.pop()
