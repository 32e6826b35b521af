"""Results store: one JSON Lines file, appended to as measurements come in, never rewritten.

Rows (one JSON object per line, each with ``kind`` and the run's ``key``):

* ``{"kind": "epoch", "key", "attempt", "epoch", ...metrics}`` — written when an epoch ends, so an
  interrupted run keeps what it measured;
* ``{"kind": "run", "key", "attempt", "config", "env", "summary", "epochs": [...]}`` — written when a
  run ends (time-to-accuracy runs add ``"curve": [...]``, their validation points, and the run that sets
  a target ``"schedule": [...]``, its learning-rate schedule's progress at each step). A key with a ``run``
  row is finished; a resumed study skips it.

Every append is one ``write`` of a whole line, then ``flush`` and ``fsync``: a crash or Ctrl-C loses at
most the line being written. A truncated last line (the crash case) is ignored on read, and the next
append starts on a fresh line so it cannot glue onto the fragment.

:func:`read_runs` is the one reader of a study's finished runs: the report (``lowbit report``, ``lowbit
export``), the speed model (:func:`load_run_records`: ``lowbit predict``, ``lowbit advise``) and the tests
all see the same rows and the same errors.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowbit.lab.baselines import get_baseline, is_baseline
from lowbit.codecs.base import get_codec
from lowbit.lab.study.config import auto_level, is_auto
from lowbit.lab.study.records import RunRecord, run_record

__all__ = ["ResultStore", "ResultsWarning", "resolve_results_path", "read_runs", "load_run_records", "RESULTS_NAME"]

RESULTS_NAME = "results.jsonl"


def resolve_results_path(path: str | os.PathLike[str]) -> Path:
    """A results directory (holding ``results.jsonl``) or a ``.jsonl`` file -> the file's path."""
    p = Path(path)
    if p.suffix == ".jsonl" or p.is_file():
        return p
    return p / RESULTS_NAME


def _clean(value: Any) -> Any:
    """NaN and infinities are not JSON: store them as null (and say so in ``nonfinite``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class ResultStore:
    """Append-only JSON Lines file of study results."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = resolve_results_path(path)
        self.skipped: list[tuple[int, str]] = []

    def append(self, row: dict[str, Any]) -> None:
        """Append one row durably (write + flush + fsync)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(_clean(row), sort_keys=True, allow_nan=False) + "\n"
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a torn last line: do not glue onto it
                    line = "\n" + line
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every readable row, in file order. Lines that are not a JSON object with a string ``kind`` and
        ``key`` (a torn write, garbage) are skipped; ``skipped`` lists them as ``(line, reason)``."""
        self.skipped: list[tuple[int, str]] = []
        self.line_of: dict[int, int] = {}  # id(row) -> its line in the file, for messages
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                row, problem = _parse(line)
                if problem:
                    self.skipped.append((lineno, problem))
                    continue
                self.line_of[id(row)] = lineno
                yield row

    @property
    def skipped_lines(self) -> int:
        return len(getattr(self, "skipped", ()))

    def finished(self) -> dict[str, dict[str, Any]]:
        """key -> the run row of every finished run (the first one, if a key was written twice)."""
        out: dict[str, dict[str, Any]] = {}
        for row in self.rows():
            if row["kind"] == "run":
                out.setdefault(row["key"], row)
        return out

    def finished_keys(self) -> set[str]:
        return set(self.finished())


class ResultsWarning(RuntimeWarning):
    """Lines of a results file that a reader skipped: one warning per read, naming each line and why."""


def _parse(line: str) -> tuple[Any, str]:
    """A line -> (row, '') or (None, why it is not a row)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"not JSON ({exc.msg}, column {exc.colno})"
    except RecursionError:
        return None, "not JSON (nested too deeply to read)"
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        return None, f"not JSON ({str(exc).split(';')[0]})"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object with 'kind' and 'key'"
    for field in ("kind", "key"):
        if field not in row:
            return None, f"no '{field}'"
        if not isinstance(row[field], str):
            return None, f"'{field}' must be a string, got {type(row[field]).__name__}"
    if not isinstance(row.get("attempt", ""), str):
        return None, f"'attempt' must be a string, got {type(row['attempt']).__name__}"
    return row, ""


# What the readers (report, export, the speed model) use from a run row, typed. Keys not named here are
# carried along unread. "num" is a finite number; "num?" also null (non-finite values are stored as null).
_CONFIG = {"network": "str", "dataset": "str", "codec": "str", "algorithm": "str", "backend": "str",
           "world_size": "int>=1", "batch_size": "int>=1", "seed": "int", "epochs": "int>=0"}
_CONFIG_OPTIONAL = {"nodes": "int>=1", "sub_batches": "int>=1", "max_steps_per_epoch": "int>=0",
                    "max_train_samples": "int>=0", "max_test_samples": "int>=0", "start_iter": "int>=0",
                    "threads_per_worker": "int>=0", "lr": "num", "momentum": "num", "weight_decay": "num",
                    "error_feedback": "bool", "dataset_args": "dict", "model_args": "dict", "policy": "dict",
                    "device": "str", "optimizer": "str", "lr_schedule": "str", "batch_preset": "str",
                    "parallelism": "str", "emulate_link": "str?",
                    # time to accuracy
                    "time_budget_s": "num?", "target_loss": "num?", "target_accuracy": "num?", "target_from": "str?",
                    "target_schedule": "str", "eval_every": "int>=0", "eval_every_s": "num", "eval_samples": "int>=0",
                    "warmup": "num", "autocast": "str?"}
_SUMMARY = {"diverged": "bool", "timed_epochs": "ints", "auto_plan": "dict?", **{k: "num?" for k in (
    "best_test_acc", "bytes_per_step_per_rank", "collectives_per_step", "comm_comp_ratio", "compressed_fraction", "compressed_params",
    "epoch_comm_s", "epoch_compute_s", "epoch_decode_s", "epoch_encode_s", "epoch_exposed_comm_s",
    "epoch_train_s", "final_test_acc", "final_test_loss", "final_test_top5", "final_train_loss",
    "gflop_per_sample", "global_batch", "n_test", "n_train", "num_classes", "params", "samples_per_s",
    "samples_per_s_all_epochs", "steps_per_epoch", "train_s", "wall_s",
    # time to accuracy (runs with a target, a budget or an evaluation cadence)
    "target_loss", "target_accuracy", "time_to_target_s", "steps_to_target", "samples_to_target", "time_budget_s",
    "schedule_steps", "steps", "tta_train_s", "eval_s", "agree_s", "eval_points", "eval_samples", "final_val_loss",
    "final_val_acc", "best_val_loss")}, "reached_target": "bool?", "stop_reason": "str", "target_from": "str?"}
_EPOCH = {"epoch": "int", **{k: "num?" for k in (
    "bytes_per_step_per_rank", "bytes_sent_per_rank", "collectives_per_step", "comm_s", "compute_s", "decode_s", "encode_s", "eval_s",
    "exposed_comm_s", "lr", "samples", "samples_per_s", "steps", "test_acc", "test_loss", "test_top5",
    "train_loss", "train_s", "wall_s")}}
_LABELS = {"codec": "str", "data": "str", "task": "str", "synthetic": "bool"}
#: A point of a time-to-accuracy run's validation curve (the row's ``curve``).
_POINT = {"step": "int>=0", "epoch": "int>=0", **{k: "num?" for k in ("train_s", "samples", "val_loss", "val_acc", "lr")}}
_TOP = {"study": "str", "finished": "str", "started": "str"}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _type_problem(v: Any, kind: str) -> str:
    """'' when ``v`` is of ``kind``, else what it should be."""
    nullable = kind.endswith("?")
    if nullable:
        if v is None:
            return ""
        kind = kind[:-1]
    if kind == "str":
        ok, want = isinstance(v, str), "a string"
    elif kind == "bool":
        ok, want = isinstance(v, bool), "true or false"
    elif kind == "dict":
        ok, want = isinstance(v, dict), "an object"
    elif kind == "num":
        ok, want = _is_num(v), "a finite number" + (" or null" if nullable else "")
    elif kind == "ints":
        ok, want = isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v), \
            "a list of integers"
    else:  # int, int>=0, int>=1
        low = int(kind[5:]) if kind.startswith("int>=") else None
        ok = isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low)
        want = "an integer" + (f" >= {low}" if low is not None else "")
    return "" if ok else f"must be {want}, got {_short(v)}"


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _check(obj: dict[str, Any], schema: dict[str, str], where: str, required: bool = False) -> str:
    for field, kind in schema.items():
        if field not in obj:
            if required:
                return f"{where}{field} is missing"
            continue
        problem = _type_problem(obj[field], kind)
        if problem:
            return f"{where}{field} {problem}"
    return ""


def _malformed(row: dict[str, Any]) -> str:
    """Why a run row cannot be read ('' when it can): what the readers use must be there, typed."""
    cfg = row.get("config")
    if not isinstance(cfg, dict):
        return f"config must be an object, got {type(cfg).__name__}"
    problem = _check(cfg, _CONFIG, "config.", required=True) or _check(cfg, _CONFIG_OPTIONAL, "config.")
    if problem:
        return problem
    try:
        if is_baseline(cfg["codec"]):  # PyTorch's hooks (lowbit.lab.baselines)
            get_baseline(cfg["codec"])
        elif is_auto(cfg["codec"]):  # (codec="auto" chooses while training; "auto:bold": its level)
            auto_level(cfg["codec"])
        else:
            get_codec(cfg["codec"])
    except ValueError as exc:
        return f"config.codec: {exc}"
    for field, typ in (("summary", dict), ("epochs", list), ("labels", dict), ("env", dict)):
        if field in row and not isinstance(row[field], typ):
            return f"{field} must be {'an object' if typ is dict else 'a list'}, got {type(row[field]).__name__}"
    problem = (_check(row, _TOP, "") or _check(row.get("summary", {}), _SUMMARY, "summary.")
               or _check(row.get("labels", {}), _LABELS, "labels."))
    if problem:
        return problem
    for i, e in enumerate(row.get("epochs", [])):
        if not isinstance(e, dict):
            return f"epochs[{i}] must be an object, got {type(e).__name__}"
        problem = _check(e, _EPOCH, f"epochs[{i}].")
        if problem:
            return problem
    schedule = row.get("schedule", [])
    if not isinstance(schedule, list) or not all(_is_num(p) for p in schedule):
        return f"schedule must be a list of numbers, got {_short(schedule)}"
    curve = row.get("curve", [])
    if not isinstance(curve, list):
        return f"curve must be a list, got {type(curve).__name__}"
    for i, point in enumerate(curve):
        if not isinstance(point, dict):
            return f"curve[{i}] must be an object, got {type(point).__name__}"
        problem = _check(point, _POINT, f"curve[{i}].", required=True)
        if problem:
            return problem
    loads = row.get("env", {}).get("loadavg_at_start")
    if loads is not None and not (isinstance(loads, list) and loads and all(_is_num(x) for x in loads)):
        return f"env.loadavg_at_start must be a list of numbers, got {_short(loads)}"
    return ""


def _lines_text(skipped: list[tuple[int, str]], reasons: int = 8, numbers: int = 60) -> str:
    """``line N: why; ...`` for the first lines, then the other lines' numbers (one line of text, bounded)."""
    text = "; ".join(f"line {n}: {why}" for n, why in skipped[:reasons])
    rest = [str(n) for n, _ in skipped[reasons:]]
    if rest:
        more = f", and {len(rest) - numbers} more" if len(rest) > numbers else ""
        text += f"; also line{'s' if len(rest) > 1 else ''} {', '.join(rest[:numbers])}{more}"
    return text


def read_runs(path: str | os.PathLike[str], *, strict: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The finished runs of a results directory or ``.jsonl`` file, and notes on what was left out.

    Runs are the ``run`` rows as written, in file order, the first one of each key. Lines that are not
    rows (a torn write, garbage: not a JSON object with a string ``kind`` and ``key``) and run rows
    without what the readers need, typed (:func:`_malformed`), are skipped with one
    :class:`ResultsWarning` that counts them and names each line and why; with ``strict`` they are a
    ValueError instead. Notes: ``path`` (the file), ``skipped_lines`` (both kinds), ``skipped`` (their
    ``(line, reason)``), ``malformed_rows``, and the ``incomplete_attempts`` / ``incomplete_epochs`` of runs
    that never finished (a partial sweep). ValueError if the file is missing.
    """
    store = ResultStore(path)
    if not store.path.exists():
        raise ValueError(f"study results not found: no results at {store.path} (give a results directory "
                         "holding results.jsonl, or the .jsonl file)")
    finished: dict[str, dict[str, Any]] = {}
    line_of: dict[str, int] = {}
    done_attempts = set()
    epochs: dict[str, int] = {}
    malformed: list[tuple[int, str]] = []
    for row in store.rows():
        if row["kind"] == "run":
            problem = _malformed(row)
            if problem:  # (a malformed row does not finish its key: a good row of the same key may follow)
                malformed.append((store.line_of[id(row)], f"{problem} (run {row['key']!r})"))
                continue
            done_attempts.add(row.get("attempt"))
            if row["key"] not in finished:
                finished[row["key"]] = row
                line_of[row["key"]] = store.line_of[id(row)]
        elif row["kind"] == "epoch":
            attempt = row.get("attempt", "")
            epochs[attempt] = epochs.get(attempt, 0) + 1
    skipped = sorted(store.skipped + malformed)
    if skipped:
        what = (f"{store.path}: {len(skipped)} line{'s' if len(skipped) > 1 else ''} that are not readable "
                f"result rows: {_lines_text(skipped)}")
        if strict:
            raise ValueError(what + " (without --strict they are skipped with a warning)")
        warnings.warn(f"{what}; skipped", ResultsWarning, stacklevel=3)
    runs = list(finished.values())
    incomplete = [n for a, n in epochs.items() if a not in done_attempts]
    notes = {"path": str(store.path), "skipped_lines": len(skipped), "skipped": skipped,
             "malformed_rows": len(malformed), "incomplete_attempts": len(incomplete),
             "incomplete_epochs": sum(incomplete)}
    return runs, notes


def load_run_records(path: str | os.PathLike[str], *, strict: bool = False) -> list[RunRecord]:
    """The finished runs of :func:`read_runs` as the speed model reads them
    (:func:`lowbit.lab.study.records.run_record`: data-parallel runs with timed steps); ValueError if
    the file is missing or holds none (or, with ``strict``, holds a line that is not a readable row)."""
    rows, notes = read_runs(path, strict=strict)
    runs = [r for r in (run_record(row) for row in rows) if r is not None]
    if not rows:
        raise ValueError(f"study results {notes['path']!r} hold no finished runs")
    if not runs:
        raise ValueError(f"study results {notes['path']!r} hold {len(rows)} finished run(s), none of them one the "
                         "speed model describes (data-parallel, timed steps, a fixed codec: not codec='auto', "
                         "model or hybrid parallelism, or the simulated NCCL)")
    return runs
