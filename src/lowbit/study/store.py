"""Results store: one JSON Lines file, appended to as measurements come in, never rewritten.

Rows (one JSON object per line, each with ``kind`` and the run's ``key``):

* ``{"kind": "epoch", "key", "attempt", "epoch", ...metrics}`` — written when an epoch ends, so an
  interrupted run keeps what it measured;
* ``{"kind": "run", "key", "attempt", "config", "env", "summary", "epochs": [...]}`` — written when a
  run ends. A key with a ``run`` row is finished; a resumed study skips it.

Every append is one ``write`` of a whole line, then ``flush`` and ``fsync``: a crash or Ctrl-C loses at
most the line being written. A truncated last line (the crash case) is ignored on read, and the next
append starts on a fresh line so it cannot glue onto the fragment.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowbit.perfmodel.calibrate import RunRecord, run_record

__all__ = ["ResultStore", "resolve_results_path", "load_run_records", "RESULTS_NAME"]

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

    def incomplete_attempts(self) -> dict[str, list[dict[str, Any]]]:
        """Epoch rows of attempts that never wrote a run row (interrupted runs), by attempt id."""
        done_attempts = set()
        epochs: dict[str, list[dict[str, Any]]] = {}
        for row in self.rows():
            if row["kind"] == "run":
                done_attempts.add(row.get("attempt"))
            elif row["kind"] == "epoch":
                epochs.setdefault(row.get("attempt", ""), []).append(row)
        return {a: rs for a, rs in epochs.items() if a not in done_attempts}


def load_run_records(path: str | os.PathLike[str]) -> list[RunRecord]:
    """The finished runs of a results directory or ``.jsonl`` file as the speed model reads them
    (:func:`lowbit.perfmodel.calibrate.run_record`: data-parallel runs with timed steps); ValueError if
    the file is missing or holds none."""
    p = resolve_results_path(path)
    if not p.exists():
        raise ValueError(f"study results {str(path)!r} not found (give a results directory holding "
                         "results.jsonl, or the .jsonl file)")
    runs = [r for r in (run_record(row) for row in ResultStore(p).finished().values()) if r is not None]
    if not runs:
        raise ValueError(f"study results {str(p)!r} hold no finished runs")
    return runs
