"""Study results where users already look: CSV files (spreadsheets, pandas) and TensorBoard.

* :func:`write_csv` — ``runs.csv`` (one row per finished run: its configuration, labels and every scalar
  of its summary; time-to-accuracy runs also their ratios to the references, ``tta_x_vs_torch_fp16``, ...)
  and ``epochs.csv`` (one row per epoch of every finished run: the run's configuration and the epoch's
  measurements). ``lowbit study report`` writes both beside ``index.html``;
  ``lowbit study export RESULTS --csv DIR`` writes them anywhere.
* :func:`write_curves_csv` — ``curves.csv``: every validation point of the time-to-accuracy runs (when
  there are any), with the run's configuration.
* :class:`TensorBoardLog` — one TensorBoard run per study run (its directory named after the run),
  scalars per epoch under ``accuracy/``, ``loss/``, ``speed/``, ``time/`` and ``comm/``, the run's
  configuration as text. ``lowbit study --tensorboard DIR`` logs live as epochs end (rank 0);
  ``lowbit study export RESULTS --tensorboard DIR`` writes the same from a finished (or interrupted)
  results file. Needs the ``tensorboard`` extra (``pip install 'lowbit[tensorboard]'``).

Both read the results file through :func:`lowbit.lab.study.report.load_runs`, so they see exactly the runs
the report does (the last finished attempt per key; malformed rows skipped with a warning).
"""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path
from typing import Any

from lowbit.extras import require
from lowbit.lab.study.tta import run_ratios

__all__ = ["write_csv", "write_curves_csv", "TensorBoardLog", "export_tensorboard", "output_folder", "RUN_FIELDS",
           "EPOCH_SCALARS"]

#: The configuration columns that lead both CSV files (then every other config field, sorted).
RUN_FIELDS = ("key", "study", "network", "dataset", "codec", "label", "algorithm", "error_feedback", "world_size",
              "backend", "device", "batch_size", "epochs", "seed")

#: Epoch measurements sent to TensorBoard: field -> tag.
EPOCH_SCALARS = {
    "test_acc": "accuracy/test", "train_loss": "loss/train", "test_loss": "loss/test",
    "samples_per_s": "speed/samples_per_s", "train_s": "time/train_s", "compute_s": "time/compute_s",
    "exposed_comm_s": "time/exposed_comm_s", "encode_s": "time/encode_s", "comm_s": "time/comm_s",
    "decode_s": "time/decode_s", "bytes_per_step_per_rank": "comm/bytes_per_step_per_rank", "lr": "lr",
}


def output_folder(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` as a folder to write into: ValueError naming ``what`` (e.g. ``--out``) when something that
    is not a folder is there. Checked before any work, so a wrong path costs nothing."""
    p = Path(path).expanduser()
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise ValueError(f"{what} {str(path)!r}: not a folder ({'a file is there' if q == p else f'{q} is a file'})")
            break
    return p


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, bool, int, float))


#: What a spreadsheet reads as the start of a formula (OWASP, CSV injection): = + - @ tab CR.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_LEADING_SPACE = re.compile(r"[^\S\t\r]*")  # whitespace before a formula, but tab and CR start one themselves


def _text(v: str) -> str:
    """A text cell as a spreadsheet should show it: names from results starting like a formula get a
    leading ``'`` (OWASP's rule), so ``=HYPERLINK(...)`` is text, not a formula — after leading
    whitespace too, which spreadsheets skip (`` =1+1`` runs as ``=1+1``). A plain number written as text
    (``-0.5``) runs nothing and is left alone."""
    head = v[_LEADING_SPACE.match(v).end():]
    if head.startswith(_FORMULA_START) and not _PLAIN_NUMBER.fullmatch(head.rstrip()):
        return "'" + v
    return v


def _cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return ""  # as the JSON store keeps it (null): empty in a spreadsheet, NaN for pandas
    if isinstance(v, str):
        return _text(v)
    return "" if v is None else v  # numbers (negative ones too) stay numbers


def _config_columns(runs: list[dict[str, Any]]) -> list[str]:
    extra = sorted({k for r in runs for k, v in r.items()
                    if k not in RUN_FIELDS and _scalar(v) and k not in ("synthetic", "bits", "finished")})
    return [*RUN_FIELDS, *extra, "synthetic", "bits", "finished"]


def _write(path: Path, header: list[str], rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=header, extrasaction="ignore")
        csv.writer(f).writerow([_text(k) for k in header])  # column names come from results too
        for row in rows:
            w.writerow({k: _cell(row.get(k)) for k in header})
    os.replace(tmp, path)  # never a half-written CSV where a complete one stood


def write_csv(runs: list[dict[str, Any]], out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``runs.csv`` and ``epochs.csv`` of ``runs`` (rows of :func:`~lowbit.lab.study.report.load_runs`) into
    ``out_dir``; returns their paths."""
    out = output_folder(out_dir, "CSV folder")
    out.mkdir(parents=True, exist_ok=True)
    cfg_cols = _config_columns(runs)
    summary_cols = sorted({k for r in runs for k, v in r["summary"].items() if _scalar(v)})
    label_cols = sorted({k for r in runs for k, v in r.get("labels", {}).items() if _scalar(v)} - {"codec"})
    ratios = run_ratios(runs)  # time to accuracy: x times sooner than each reference (none: no columns)
    ratio_cols = sorted({k for v in ratios.values() for k in v})
    run_rows = []
    for r in runs:
        row = {k: r.get(k) for k in cfg_cols}
        row.update({f"labels.{k}": r["labels"].get(k) for k in label_cols})
        row.update({k: r["summary"].get(k) for k in summary_cols})
        row.update(ratios.get(r["key"], {}))
        run_rows.append(row)
    runs_path = out / "runs.csv"
    _write(runs_path, [*cfg_cols, *(f"labels.{k}" for k in label_cols), *summary_cols, *ratio_cols], run_rows)

    epoch_cols = sorted({k for r in runs for e in r["epoch_rows"] for k, v in e.items() if _scalar(v)} - {"epoch"})
    epoch_rows = []
    for r in runs:
        for e in r["epoch_rows"]:
            epoch_rows.append({**{k: r.get(k) for k in cfg_cols}, **e})
    epochs_path = out / "epochs.csv"
    _write(epochs_path, [*cfg_cols, "epoch", *epoch_cols], epoch_rows)
    return runs_path, epochs_path


#: A validation point's columns in curves.csv, after the run's configuration.
CURVE_FIELDS = ("step", "epoch", "train_s", "samples", "val_loss", "val_acc", "lr")


def write_curves_csv(runs: list[dict[str, Any]], out_dir: str | os.PathLike[str]) -> Path | None:
    """``curves.csv`` of the time-to-accuracy runs in ``runs`` (rows of ``load_runs``): one row per validation
    point, the run's configuration first; None (and no file) when no run has a curve."""
    with_curve = [r for r in runs if r.get("curve")]
    if not with_curve:
        return None
    out = output_folder(out_dir, "CSV folder")
    out.mkdir(parents=True, exist_ok=True)
    cfg_cols = _config_columns(with_curve)
    point_cols = [f"{k}_at_point" if k in cfg_cols else k for k in CURVE_FIELDS]  # (lr: the run's, and then)
    rows = [{**{k: r.get(k) for k in cfg_cols}, **{c: p.get(k) for c, k in zip(point_cols, CURVE_FIELDS)}}
            for r in with_curve for p in r["curve"]]
    path = out / "curves.csv"
    _write(path, [*cfg_cols, *point_cols], rows)
    return path


def _run_dir(key: str, config: dict[str, Any] | None) -> str:
    """A run's TensorBoard directory name: what TensorBoard lists, so readable (network, data, codec,
    world size, seed) and unique (the run's key), made safe for a file name."""
    c = config or {}
    parts = [c.get("network"), c.get("dataset"), c.get("label") or c.get("codec"),
             f"K{c['world_size']}" if "world_size" in c else None, f"seed{c['seed']}" if "seed" in c else None, key]
    name = "_".join(str(p) for p in parts if p not in (None, ""))
    return re.sub(r"[^A-Za-z0-9.=+-]+", "_", name).strip("_") or "run"


class TensorBoardLog:
    """Per-run TensorBoard writers under ``logdir`` (``tensorboard`` extra). Use as a context manager or
    call :meth:`close`."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        require("tensorboard", "tensorboard", "TensorBoard logging")
        from torch.utils.tensorboard import SummaryWriter

        self._Writer = SummaryWriter
        self.logdir = output_folder(logdir, "TensorBoard folder")
        self._writers: dict[str, Any] = {}

    def _writer(self, key: str, config: dict[str, Any] | None) -> Any:
        w = self._writers.get(key)
        if w is None:
            w = self._writers[key] = self._Writer(log_dir=str(self.logdir / _run_dir(key, config)))
            if config:
                lines = [f"| {k} | {v} |" for k, v in sorted(config.items()) if _scalar(v)]
                w.add_text("config", "| field | value |\n|---|---|\n" + "\n".join(lines), 0)
        return w

    def log_epoch(self, key: str, epoch: dict[str, Any], config: dict[str, Any] | None = None) -> None:
        """The scalars of one epoch row (``epoch`` 1-based is the step)."""
        w = self._writer(key, config)
        step = int(epoch.get("epoch", 0))
        for field, tag in EPOCH_SCALARS.items():
            v = epoch.get(field)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                w.add_scalar(tag, v, step)
        w.flush()

    def close(self) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def export_tensorboard(runs: list[dict[str, Any]], logdir: str | os.PathLike[str]) -> int:
    """Every epoch of every run in ``runs`` (rows of ``load_runs``) to TensorBoard; returns the number of
    runs written."""
    with TensorBoardLog(logdir) as tb:
        for r in runs:
            cfg = {k: r.get(k) for k in _config_columns([r]) if k != "key"}
            for e in r["epoch_rows"]:
                tb.log_epoch(r["key"], e, cfg)
    return len(runs)
