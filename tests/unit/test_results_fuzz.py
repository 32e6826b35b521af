"""Malformed results.jsonl lines against every reader of result rows (lowbit report, export, predict
--validate; all through lowbit.lab.study.store): each is skipped with one warning naming the file, the line
and the field, or, with --strict, refused in one line. Never a traceback."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest

from lowbit.lab.cli import main
from lowbit.lab.study.store import read_runs

REAL = Path(__file__).resolve().parents[1] / "fixtures" / "study_cpu_default" / "results.jsonl"


def _base_rows() -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in REAL.read_text().splitlines() if x.strip()]
    return [r for r in rows if r["kind"] == "run" and r["config"]["network"] == "mlp"
            and r["config"]["dataset"] == "digits"]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(row: dict[str, Any]) -> None:
        *head, last = path.split(".")
        obj: Any = row
        for part in head:
            obj = obj[int(part)] if isinstance(obj, list) else obj[part]
        if isinstance(obj, list):
            obj[int(last)] = value
        else:
            obj[last] = value
    return change


# (id, a change to a good run row or the raw text of the line, what the warning must name)
CASES: list[tuple[str, Any, str]] = [
    ("key_is_a_list", _set("key", ["a", "b"]), "key"),
    ("kind_is_a_list", _set("kind", ["run"]), "kind"),
    ("deep_list", "[" * 100_000 + "]" * 100_000, "JSON"),
    ("deep_object", '{"kind": "run", "key": "deep", "config": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001,
     "JSON"),
    ("huge_int", '{"kind": "run", "key": "big", "n": ' + "9" * 5000 + "}", "JSON"),
    ("garbage", "hello, world", "JSON"),
    ("truncated", None, "JSON"),  # filled in below: the first half of a good row
    ("summary_string", _set("summary.samples_per_s", "fast"), "summary.samples_per_s"),
    ("summary_infinite", _set("summary.final_test_acc", float("inf")), "summary.final_test_acc"),
    ("summary_bool_string", _set("summary.diverged", "no"), "summary.diverged"),
    ("timed_epochs_string", _set("summary.timed_epochs", "all"), "summary.timed_epochs"),
    ("epoch_field_string", _set("epochs.3.test_acc", "high"), "epochs[3].test_acc"),
    ("epoch_number_string", _set("epochs.0.epoch", "1"), "epochs[0].epoch"),
    ("epoch_time_list", _set("epochs.2.train_s", [1.0]), "epochs[2].train_s"),
    ("lr_string", _set("config.lr", "0.1"), "config.lr"),
    ("batch_size_0", _set("config.batch_size", 0), "config.batch_size"),
    ("world_size_0", _set("config.world_size", 0), "config.world_size"),
    ("epochs_negative", _set("config.epochs", -1), "config.epochs"),
    ("nodes_string", _set("config.nodes", "2"), "config.nodes"),
    ("sub_batches_0", _set("config.sub_batches", 0), "config.sub_batches"),
    ("error_feedback_string", _set("config.error_feedback", "false"), "config.error_feedback"),
    ("policy_list", _set("config.policy", [1]), "config.policy"),
    ("dataset_args_string", _set("config.dataset_args", "x"), "config.dataset_args"),
    ("synthetic_string", _set("labels.synthetic", "no"), "labels.synthetic"),
    ("label_number", _set("labels.codec", 8), "labels.codec"),
]


def _write(tmp_path: Path, cases: list[tuple[str, Any, str]]) -> tuple[Path, int, list[int]]:
    """The base runs, then one line per case; returns the file, the number of good runs and each case's line."""
    base = _base_rows()
    lines = [json.dumps(r) for r in base]
    where = []
    for i, (name, change, _) in enumerate(cases):
        if name == "truncated":
            text = json.dumps({**base[0], "key": "cut"})[:300]
        elif isinstance(change, str):
            text = change
        else:
            row = json.loads(json.dumps(base[i % len(base)]))
            row["key"] = f"bad-{name}"
            change(row)
            text = json.dumps(row)
        lines.append(text)
        where.append(len(lines))
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, len(base), where


@pytest.mark.parametrize("name,change,field", CASES, ids=[c[0] for c in CASES])
def test_each_malformed_line_is_skipped_naming_file_line_and_field(tmp_path: Path, name: str, change: Any,
                                                                   field: str) -> None:
    path, n_good, (line,) = _write(tmp_path, [(name, change, field)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs, notes = read_runs(path)
    assert len(runs) == n_good
    assert notes["skipped_lines"] == 1
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1, msgs
    assert str(path) in msgs[0] and f"line {line}" in msgs[0] and field in msgs[0], msgs[0]
    assert "\n" not in msgs[0]
    with pytest.raises(ValueError) as exc:
        read_runs(path, strict=True)
    assert f"line {line}" in str(exc.value) and field in str(exc.value) and "\n" not in str(exc.value)


def _one_line_error(err: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err


def test_every_reader_but_the_drawn_report_skips_them_all_or_refuses_them_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fast equivalent of test_every_reader_skips_them_all_with_one_warning_or_refuses_them_in_one_line
    (slow): export and predict --validate as there, and report --strict refusing in one line; the report
    is not drawn (~3 s of matplotlib)."""
    _every_reader(tmp_path, capsys, draw_report=False)


@pytest.mark.slow
def test_every_reader_skips_them_all_with_one_warning_or_refuses_them_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fast equivalent: test_every_reader_but_the_drawn_report_skips_them_all_or_refuses_them_in_one_line."""
    _every_reader(tmp_path, capsys, draw_report=True)


def _every_reader(tmp_path: Path, capsys: pytest.CaptureFixture[str], draw_report: bool) -> None:
    path, n_good, where = _write(tmp_path, CASES)
    # a name with matplotlib's math delimiter is a name, drawn as written
    row = {**_base_rows()[-1], "key": "dollar"}
    row["config"] = {**row["config"], "network": "mlp$_{$x", "seed": 7}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    report = ["report", str(path), "--out", str(tmp_path / "report")]
    for argv in (["export", str(path), "--csv", str(tmp_path / "csv")],
                 ["predict", "--validate", str(path)],
                 *([report] if draw_report else [])):
        assert main(argv) == 0, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err
        warned = [x for x in err.splitlines() if "skipped" in x]
        assert len(warned) == 1, err
        assert f"{len(CASES)} line" in warned[0] and str(path) in warned[0]
        for line in where:
            assert re.search(rf"\b{line}\b", warned[0].split("rows:", 1)[1]), (line, warned[0])
        assert main([*argv, "--strict"]) == 2, argv
        _one_line_error(capsys.readouterr().err)
    if draw_report:
        assert "mlp$_{$x" in (tmp_path / "report" / "index.html").read_text()
    else:
        assert main([*report, "--strict"]) == 2
        _one_line_error(capsys.readouterr().err)
        assert not (tmp_path / "report").exists()
    assert "mlp$_{$x" in (tmp_path / "csv" / "runs.csv").read_text()


def test_a_clean_file_reads_without_a_word(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, n_good, _ = _write(tmp_path, [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs, notes = read_runs(path, strict=True)
    assert len(runs) == n_good and notes["skipped_lines"] == 0
    assert main(["export", str(path), "--csv", str(tmp_path / "csv"), "--strict"]) == 0
    assert capsys.readouterr().err == ""
