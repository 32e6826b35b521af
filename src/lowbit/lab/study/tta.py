"""Time to accuracy, as the report and the CSV export read it from finished runs.

A time-to-accuracy run (docs/study.md) records ``curve`` — its validation loss and accuracy against the
training clock — and in its summary the target, ``time_to_target_s`` (None when never reached),
``steps_to_target`` and why it stopped.

**The target rule** (every time-to-accuracy preset): a target taken from a baseline's run
(``target_from``) is that run's final validation loss plus :data:`TARGET_TOLERANCE` (1 %, relative):
a run has reached it at its first validation at or below ``final * 1.01``. The strict time (no
tolerance: at or below the baseline's final loss itself) is reported beside it. A target given as a
number (``target_loss``, ``target_accuracy``) is met as given. Both times are read here from the
runs' curves, so rows written before the rule read the same way. Here:

* :func:`tta_runs` — the finished runs that have a curve;
* :func:`tta_setting` / :func:`setting_title` — what a panel and a table share: everything but the
  configuration (codec, its algorithm and error feedback), the seed, the target and the budget; the link
  included (an emulated link's speed, or NCCL over sockets / between emulated nodes, from the row's
  ``env.links``);
* :func:`tta_table` — per setting and configuration: time to target (mean over seeds), steps, final
  validation loss, and the ratio of a reference's time to this configuration's (``x`` times sooner), for
  the references ``torch:fp16`` and every ``torch:powersgd:*`` present, paired by seed;
* :func:`run_ratios` — the same ratios per run, for ``runs.csv``.

Runs read here are the report's rows (:func:`lowbit.lab.study.report.load_runs`: config fields at the top
level, ``summary``, ``curve``, ``label``, ``env``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from collections import defaultdict
from typing import Any

from lowbit.lab.study.runs import RunConfig

__all__ = ["tta_runs", "tta_metric", "tta_setting", "setting_title", "link_label", "references", "tta_table",
           "run_ratios", "ratio_column", "REFERENCE_FP16", "TARGET_TOLERANCE", "tolerant_target", "time_to_target",
           "time_to_target_strict"]

#: A target taken from a baseline's run is its final validation loss times (1 + this) (module doc).
TARGET_TOLERANCE = 0.01

#: The reference every time to target is compared with first: PyTorch's fp16 hook.
REFERENCE_FP16 = "torch:fp16"
_POWERSGD = "torch:powersgd:"

#: Config fields that are not the setting: the configuration under test, the seed, the target it was given.
_NOT_SETTING = {"codec", "algorithm", "error_feedback", "policy", "batch_preset", "seed", "target_loss",
                "target_from", "schedule", "target_schedule", "time_budget_s",
                # local SGD is a configuration beside DDP's at the same setting (parallelism: tta_setting)
                "local_steps", "fragments", "outer_lr", "outer_momentum"}
_SETTING_FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig) if f.name not in _NOT_SETTING)


def tta_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs with a validation curve (time-to-accuracy runs), real data only."""
    return [r for r in runs if r.get("curve") and not r.get("speed_only", r.get("synthetic"))]


def link_label(r: dict[str, Any]) -> str:
    """The link a run's gradients crossed, as far as its row says: an emulated link's speed; NCCL over
    sockets (``NCCL_P2P_DISABLE=1`` recorded in ``env.links``); between emulated nodes; else ''."""
    if r.get("emulate_link"):
        return f"emulated {r['emulate_link']}"
    links = (r.get("env") or {}).get("links") or {}
    env = links.get("env") or {} if isinstance(links, dict) else {}
    if int(r.get("nodes", 1) or 1) > 1:
        return f"{r['nodes']} emulated nodes (sockets between)"
    if isinstance(env, dict) and env.get("NCCL_P2P_DISABLE") == "1":
        return "sockets"
    return ""


def tta_setting(r: dict[str, Any]) -> str:
    """A run's setting (module doc) as a string key."""
    d = {k: r.get(k) for k in _SETTING_FIELDS}
    if d.get("parallelism") == "localsgd":  # the same task as data parallelism's runs, in one table
        d["parallelism"] = "data"
    d["link"] = link_label(r)
    return json.dumps(d, sort_keys=True, default=str)


def setting_title(r: dict[str, Any]) -> str:
    """``gpt2_small, pysource, K=2, nccl/cuda, sockets``."""
    parts = [r["network"], r["dataset"], f"K={r['world_size']}", r["backend"] + ("/cuda" if r.get("device") == "cuda"
                                                                             else "/cpu")]
    link = link_label(r)
    if link:
        parts.append(link)
    return ", ".join(parts)


def tta_metric(runs: list[dict[str, Any]]) -> str:
    """``"accuracy"`` when the runs' target is an accuracy, else ``"loss"`` (the plotted curve)."""
    acc = any(r["summary"].get("target_accuracy") is not None for r in runs)
    loss = any(r["summary"].get("target_loss") is not None for r in runs)
    return "accuracy" if acc and not loss else "loss"


def references(runs: list[dict[str, Any]]) -> list[str]:
    """The reference configurations present: ``torch:fp16``, then every ``torch:powersgd:*``."""
    codecs = {r["codec"] for r in runs}
    return ([REFERENCE_FP16] if REFERENCE_FP16 in codecs else []) + sorted(c for c in codecs if c.startswith(_POWERSGD))


def tolerant_target(target_loss: float | None, from_baseline: bool) -> float | None:
    """The loss a run must reach under the target rule (module doc): ``target_loss * (1 + 1 %)`` for a
    target taken from a baseline's run, ``target_loss`` as given otherwise."""
    if target_loss is None:
        return None
    return float(target_loss) * (1 + TARGET_TOLERANCE) if from_baseline else float(target_loss)


def _first(curve: list[dict[str, Any]], loss: float | None, acc: float | None) -> dict[str, Any] | None:
    for p in curve:
        v, a = p.get("val_loss"), p.get("val_acc")
        if loss is not None and isinstance(v, (int, float)) and math.isfinite(v) and v <= loss:
            return p
        if acc is not None and isinstance(a, (int, float)) and a >= acc:
            return p
    return None


def _targets(r: dict[str, Any]) -> tuple[float | None, float | None, float | None]:
    """(loss under the rule, strict loss, accuracy) of a run (a report row)."""
    s = r["summary"]
    strict = s.get("target_loss") if isinstance(s.get("target_loss"), (int, float)) else None
    acc = s.get("target_accuracy") if isinstance(s.get("target_accuracy"), (int, float)) else None
    return tolerant_target(strict, bool(r.get("target_from") or s.get("target_from"))), strict, acc


def time_to_target(r: dict[str, Any]) -> float | None:
    """Training seconds until a run's first validation that met its target under the rule (module doc);
    None when none did."""
    loss, _, acc = _targets(r)
    hit = _first(r.get("curve") or [], loss, acc) if loss is not None or acc is not None else None
    return float(hit["train_s"]) if hit is not None else None


def time_to_target_strict(r: dict[str, Any]) -> float | None:
    """The same without the tolerance: at or below the baseline's final validation loss itself."""
    _, loss, acc = _targets(r)
    hit = _first(r.get("curve") or [], loss, acc) if loss is not None or acc is not None else None
    return float(hit["train_s"]) if hit is not None else None


def _steps_to_target(r: dict[str, Any]) -> float | None:
    loss, _, acc = _targets(r)
    hit = _first(r.get("curve") or [], loss, acc) if loss is not None or acc is not None else None
    return float(hit["step"]) if hit is not None and isinstance(hit.get("step"), (int, float)) else None


def _ttt(r: dict[str, Any]) -> float | None:
    return time_to_target(r)


def _ratio(base: dict[str, Any] | None, r: dict[str, Any]) -> float | None:
    """How many times sooner ``r`` reached the target than ``base`` (their seed's own target); None when
    either did not reach it."""
    if base is None:
        return None
    b, t = _ttt(base), _ttt(r)
    return b / t if b is not None and t is not None and t > 0 else None


def ratio_column(reference: str) -> str:
    """The runs.csv column of the ratios to ``reference``: ``tta_x_vs_torch_fp16``,
    ``tta_x_vs_torch_powersgd_rank_4_start_iter_2``."""
    return "tta_x_vs_" + re.sub(r"[^A-Za-z0-9]+", "_", reference).strip("_")


def run_ratios(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """key -> {:func:`ratio_column` of each reference: that reference's time to target over this run's, at
    the same setting and seed} for every time-to-accuracy run (None where either never reached the target)."""
    rs = tta_runs(runs)
    by: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rs:
        by.setdefault((tta_setting(r), r["seed"], r["codec"]), r)
    refs = references(rs)
    return {r["key"]: {ratio_column(ref): _ratio(by.get((tta_setting(r), r["seed"], ref)), r) for ref in refs}
            for r in rs}


def _mean_sd(xs: list[float]) -> tuple[float | None, float | None]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def tta_table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (setting, configuration) of the time-to-accuracy runs, settings in title order and
    configurations fastest to target first (those that never reached it last): ``setting``, ``label``,
    ``codec``, ``seeds``, ``reached`` (seeds that reached the target), ``target`` (mean over seeds),
    ``time_to_target_s`` / ``time_sd`` (over the seeds that reached it), ``steps_to_target``,
    ``final_val`` (loss or accuracy, as :func:`tta_metric`), ``stops`` (why the runs stopped) and
    ``ratios``: reference -> (mean over paired seeds of reference time / this time, pairs); and
    ``time_to_target_strict_s`` / ``reached_strict``, the strict time beside the rule's (module doc)."""
    rs = tta_runs(runs)
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rs:
        groups[tta_setting(r)].append(r)
    out = []
    for _, group in sorted(groups.items(), key=lambda kv: setting_title(kv[1][0])):
        metric = tta_metric(group)
        refs = references(group)
        by_seed = {(r["seed"], r["codec"]): r for r in group}
        labels: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in group:
            labels[r["label"]].append(r)
        rows = []
        for label, members in labels.items():
            times = [t for t in map(_ttt, members) if t is not None]
            strict = [t for t in map(time_to_target_strict, members) if t is not None]
            steps = [x for x in map(_steps_to_target, members) if x is not None]
            targets = [_targets(r)[2] if metric == "accuracy" else _targets(r)[0] for r in members]
            final = [r["summary"].get("final_val_acc" if metric == "accuracy" else "final_val_loss") for r in members]
            ratios = {}
            for ref in refs:
                vals = [x for x in (_ratio(by_seed.get((r["seed"], ref)), r) for r in members) if x is not None]
                ratios[ref] = (statistics.fmean(vals) if vals else None, len(vals))
            t_mean, t_sd = _mean_sd(times)
            rows.append({
                "setting": setting_title(members[0]), "label": label, "codec": members[0]["codec"],
                "metric": metric, "seeds": len(members), "reached": len(times),
                "target": _mean_sd([float(x) for x in targets if isinstance(x, (int, float))])[0],
                "time_to_target_s": t_mean, "time_sd": t_sd,
                "time_to_target_strict_s": _mean_sd(strict)[0], "reached_strict": len(strict),
                "bytes_sent": _mean_sd([float(r["summary"]["bytes_sent_total"]) for r in members
                                        if isinstance(r["summary"].get("bytes_sent_total"), (int, float))])[0],
                "steps_to_target": _mean_sd(steps)[0],
                "final_val": _mean_sd([float(x) for x in final if isinstance(x, (int, float))])[0],
                "stops": sorted({str(r["summary"].get("stop_reason")) for r in members}),
                "sets_target": any(r["summary"].get("target_from") == r["codec"] for r in members),
                "ratios": ratios,
            })
        rows.sort(key=lambda x: (x["reached"] == 0, x["time_to_target_s"] if x["time_to_target_s"] is not None
                                 else math.inf, x["label"]))
        out.extend(rows)
    return out
