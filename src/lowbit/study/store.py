"""Results store: one JSON Lines file, appended to as measurements come in, never rewritten.

Rows (one JSON object per line, each with ``kind`` and the run's ``key``):

* ``{"kind": "epoch", "key", "attempt", "epoch", ...metrics}`` — written when an epoch ends, so an
  interrupted run keeps what it measured;
* ``{"kind": "run", "key", "attempt", "config", "env", "summary", "epochs": [...]}`` — written when a
  run ends. A key with a ``run`` row is finished; a resumed study skips it.

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

from lowbit.codecs.base import get_codec
from lowbit.perfmodel.calibrate import RunRecord, run_record

__all__ = ["ResultStore", "resolve_results_path", "read_runs", "load_run_records", "RESULTS_NAME"]

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
        self.skipped_lines = 0

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
        """Every readable row, in file order. Lines that do not parse (a torn write) are skipped."""
        self.skipped_lines = 0
        self.line_of: dict[int, int] = {}  # id(row) -> its line in the file, for messages
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    self.skipped_lines += 1
                    continue
                if isinstance(row, dict) and "kind" in row and "key" in row:
                    self.line_of[id(row)] = lineno
                    yield row
                else:
                    self.skipped_lines += 1

    def finished(self) -> dict[str, dict[str, Any]]:
        """key -> the run row of every finished run (the first one, if a key was written twice)."""
        out: dict[str, dict[str, Any]] = {}
        for row in self.rows():
            if row["kind"] == "run":
                out.setdefault(row["key"], row)
        return out

    def finished_keys(self) -> set[str]:
        return set(self.finished())


_ROW_FIELDS = {"network": str, "dataset": str, "codec": str, "algorithm": str, "world_size": int, "backend": str,
               "batch_size": int, "seed": int, "epochs": int}


def _malformed(row: dict[str, Any]) -> str:
    """Why a run row cannot be read ('' when it can): what the readers use must be there, typed."""
    cfg = row.get("config")
    if not isinstance(cfg, dict):
        return f"'config' must be an object, got {type(cfg).__name__}"
    for field, typ in _ROW_FIELDS.items():
        v = cfg.get(field)
        if not isinstance(v, typ) or isinstance(v, bool):
            return f"config.{field} must be {typ.__name__}, got {v!r}"
    try:
        if cfg["codec"] != "auto":  # (codec="auto" chooses while training)
            get_codec(cfg["codec"])
    except ValueError as exc:
        return f"config.codec: {exc}"
    for field, typ in (("summary", dict), ("epochs", list), ("labels", dict), ("env", dict)):
        if field in row and not isinstance(row[field], typ):
            return f"'{field}' must be {'an object' if typ is dict else 'a list'}, got {type(row[field]).__name__}"
    if any(not isinstance(e, dict) for e in row.get("epochs", [])):
        return "'epochs' must hold objects"
    return ""


def read_runs(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The finished runs of a results directory or ``.jsonl`` file, and notes on what was left out.

    Runs are the ``run`` rows as written, in file order, the first one of each key. Torn lines (an
    interrupted write) and rows that are not objects with ``kind`` and ``key`` are skipped; parseable
    run rows without what the readers need (:func:`_malformed`) are skipped with a warning naming their
    line. Notes: ``path`` (the file), ``skipped_lines`` (both kinds), ``malformed_rows``, and the
    ``incomplete_attempts`` / ``incomplete_epochs`` of runs that never finished (a partial sweep).
    ValueError if the file is missing.
    """
    store = ResultStore(path)
    if not store.path.exists():
        raise ValueError(f"study results not found: no results at {store.path} (give a results directory "
                         "holding results.jsonl, or the .jsonl file)")
    finished: dict[str, dict[str, Any]] = {}
    line_of: dict[str, int] = {}
    done_attempts = set()
    epochs: dict[str, int] = {}
    for row in store.rows():
        if row["kind"] == "run":
            done_attempts.add(row.get("attempt"))
            if row["key"] not in finished:
                finished[row["key"]] = row
                line_of[row["key"]] = store.line_of[id(row)]
        elif row["kind"] == "epoch":
            attempt = row.get("attempt", "")
            epochs[attempt] = epochs.get(attempt, 0) + 1
    runs = []
    for key, row in finished.items():
        problem = _malformed(row)
        if problem:
            warnings.warn(f"{store.path}, line {line_of[key]}: skipping a malformed run row (key {key!r}): "
                          f"{problem}", RuntimeWarning, stacklevel=3)
            continue
        runs.append(row)
    malformed = len(finished) - len(runs)
    incomplete = [n for a, n in epochs.items() if a not in done_attempts]
    notes = {"path": str(store.path), "skipped_lines": store.skipped_lines + malformed,
             "malformed_rows": malformed, "incomplete_attempts": len(incomplete),
             "incomplete_epochs": sum(incomplete)}
    return runs, notes


def load_run_records(path: str | os.PathLike[str]) -> list[RunRecord]:
    """The finished runs of :func:`read_runs` as the speed model reads them
    (:func:`lowbit.perfmodel.calibrate.run_record`: data-parallel runs with timed steps); ValueError if
    the file is missing or holds none."""
    rows, notes = read_runs(path)
    runs = [r for r in (run_record(row) for row in rows) if r is not None]
    if not rows:
        raise ValueError(f"study results {notes['path']!r} hold no finished runs")
    if not runs:
        raise ValueError(f"study results {notes['path']!r} hold {len(rows)} finished run(s), none of them one the "
                         "speed model describes (data-parallel, timed steps, a fixed codec: not codec='auto', "
                         "model or hybrid parallelism, or the simulated NCCL)")
    return runs
