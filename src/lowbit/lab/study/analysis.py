"""The study report's reading of the results: runs loaded, grouped by setting, matched against fp32, and
the ones that diverged (:mod:`lowbit.lab.study.report` writes them out)."""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from lowbit.lab.baselines import get_baseline, is_baseline
from lowbit.codecs.base import get_codec
from lowbit.lab.study.config import LOCALSGD, policy_label
from lowbit.lab.study.runs import codec_label, localsgd_label
from lowbit.lab.study.store import read_runs


MATCH_POINTS = 0.5
#: Seeds (paired with fp32 at the same seed) a ✓/✗ mark needs: below, the report shows the difference
#: alone. One seed has no spread to judge by: a run of the one-seed default study marked 8-bit QSGD
#: "✗ −0.83" on mlp/digits, where the committed 3-seed study has −0.19 ± 0.16 points
#: (benchmarks/results/study_cpu_default).
VERDICT_SEEDS = 3
#: The seed's p2.xlarge price (1 x K80), $ per GPU-hour (Figure 2): the default price of a worker-hour.
DEFAULT_PRICE_PER_GPU_HOUR = 0.9

_VARIANT = ("codec", "algorithm", "error_feedback", "policy")
_NOT_SETTING = set(_VARIANT) | {"seed", "batch_preset"}



# ------------------------------------------------------------------------------------ loading
def load_runs(results: str | os.PathLike[str], *, strict: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The finished runs of :func:`lowbit.lab.study.store.read_runs` as the report reads them (flattened:
    config fields at top level, plus summary/epochs/labels/env) and its notes."""
    rows, notes = read_runs(results, strict=strict)
    runs = []
    for row in rows:
        cfg = dict(row["config"])
        cfg.setdefault("nodes", 1)  # rows from before emulated nodes
        cfg.setdefault("policy", {})  # ... and before per-layer policies
        cfg.setdefault("parallelism", "data")  # ... and before model parallelism
        cfg.setdefault("sub_batches", 1)
        r = {**cfg, "key": row["key"], "summary": row.get("summary", {}), "epoch_rows": row.get("epochs", []),
             "labels": row.get("labels", {}), "env": row.get("env", {}), "study": row.get("study", ""),
             "finished": row.get("finished", ""), "curve": row.get("curve") or []}
        r["label"] = codec_label(cfg["codec"], bool(cfg.get("error_feedback"))) + policy_label(cfg["policy"])
        if cfg["parallelism"] == LOCALSGD:  # the weight change every H steps, not gradients every step
            r["label"] += localsgd_label(cfg)
        elif cfg["parallelism"] != "data":  # the codec carries activations too: say which parallelism
            r["label"] += f" [{cfg['parallelism']}" + (f", {cfg['sub_batches']} sub-batches" if cfg["sub_batches"] > 1
                                                        else "") + "]"
        if cfg.get("algorithm") == "hierarchical":  # (the flat algorithms share their codec's label)
            r["label"] += " [hierarchical]"
        if cfg["nodes"] > 1:  # a layout of its own in the scalability figures and tables
            r["label"] += f" ({cfg['nodes']} nodes)"
        r["synthetic"] = bool(r["labels"].get("synthetic"))
        # Grubic et al.'s simulated low-precision NCCL leaves gradients unreduced: its accuracy means nothing
        r["simulated"] = cfg.get("algorithm") == "simulated"
        r["speed_only"] = r["synthetic"] or r["simulated"]
        if r["simulated"]:
            r["label"] += " (NCCL simulated)"
        r["bits"] = _bits(cfg["codec"])
        runs.append(r)
    return runs, notes


def _bits(spec: str) -> float:
    if is_baseline(spec):
        return get_baseline(spec).bits
    try:
        return float(get_codec(spec).bits_per_value(1 << 20))
    except Exception:  # noqa: BLE001
        return math.nan


def _order(label_bits: Iterable[tuple[str, float]]) -> list[str]:
    """Labels from most to fewest bits (32bit first), as the seed orders its bars."""
    seen: dict[str, float] = {}
    for label, bits in label_bits:
        seen.setdefault(label, bits)
    return sorted(seen, key=lambda lab: (-seen[lab] if seen[lab] == seen[lab] else 0, lab))


def _setting(r: dict[str, Any], drop: Iterable[str] = ()) -> tuple:
    skip = _NOT_SETTING | set(drop)
    return tuple(sorted((k, _hashable(v)) for k, v in r.items()
                        if k not in skip and k in _CONFIG_FIELDS))


def _hashable(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    return v


_CONFIG_FIELDS = {
    "network", "dataset", "codec", "algorithm", "error_feedback", "world_size", "backend", "device", "batch_size",
    "epochs", "seed", "lr", "momentum", "weight_decay", "lr_schedule", "optimizer", "threads_per_worker",
    "max_train_samples", "max_test_samples", "max_steps_per_epoch", "start_iter", "model_args", "dataset_args",
    "nodes", "policy", "parallelism", "sub_batches",
}


def _title(r: dict[str, Any], with_k: bool = True, with_batch: bool = True) -> str:
    data = r["dataset"] + (" (SYNTHETIC)" if r["synthetic"] else "")
    parts = [r["network"], data]
    if with_k:
        parts.append(f"K={r['world_size']}" + (f" as {r['nodes']} nodes" if r.get("nodes", 1) > 1 else ""))
    parts.append(r["backend"] + ("/cuda" if r.get("device") == "cuda" else "/cpu"))
    if with_batch:
        parts.append(f"b={r['batch_preset'] or r['batch_size']}/worker")
    return ", ".join(parts)


def _mean_std(xs: Sequence[float]) -> tuple[float, float, int]:
    xs = [x for x in xs if x is not None and x == x]
    if not xs:
        return math.nan, math.nan, 0
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0), len(xs)


def _fmt_ms(m: float, s: float, n: int, scale: float = 100.0, digits: int = 2) -> str:
    if n == 0 or m != m:
        return "—"
    if n == 1:
        return f"{m * scale:.{digits}f} (1 seed)"
    return f"{m * scale:.{digits}f} ± {s * scale:.{digits}f} (n={n})"


# ------------------------------------------------------------------------------------ analysis
def _groups(runs: list[dict[str, Any]], drop: Iterable[str] = ()) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        out[_setting(r, drop)].append(r)
    return out


def _groups_across_k(runs: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Settings that differ only in the number of workers (and the per-worker batch a preset derives
    from it: "fig4" gives VGG19 32 per GPU at 1 GPU and 16 at 8) and in the node layout (a K-worker run as
    2 emulated nodes is its own series, labelled "(2 nodes)", beside the one-node runs and their
    one-worker baseline)."""
    out: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        out[_setting(r, ("world_size", "batch_size", "nodes")) + (("batch", r.get("batch_preset") or r["batch_size"]),)].append(r)
    return out


#: Classes of the data sets whose rows predate ``summary.num_classes``.
_KNOWN_CLASSES = {"digits": 10, "mnist1d": 10}


def _chance(r: dict[str, Any]) -> float | None:
    k = r["summary"].get("num_classes") or _KNOWN_CLASSES.get(r["dataset"])
    return 1.0 / k if isinstance(k, int) and k > 1 else None


def _learned(base_accs: list[float], chance: float | None) -> bool:
    """A verdict needs a baseline that learned: fp32's mean accuracy at least twice chance and 10 points
    above it (a codec "matching" an fp32 run at chance level says nothing)."""
    accs = [a for a in base_accs if a is not None and a == a]
    if not accs or chance is None:
        return bool(accs)
    m = sum(accs) / len(accs)
    return m >= 2 * chance and m >= chance + 0.10


def diverged(r: dict[str, Any]) -> bool:
    """A run that diverged: its training loss went non-finite at some epoch, or it ended where it began,
    at chance: a final training loss no lower than 0.95 of the uniform guess's (ln of the number of
    classes: 2.30 for ten) with a final test accuracy below twice chance (1bitSGD* on small_cnn/MNIST-1D
    once ended at 8.9 %, its loss flat at 2.30). The report labels it "diverged" in its tables and plots
    and leaves it out of the axis limits of the others."""
    s = r["summary"]
    losses = [e.get("train_loss") for e in r.get("epoch_rows", [])] + [s.get("final_train_loss")]
    if s.get("diverged") or any(isinstance(v, float) and not math.isfinite(v) for v in losses):
        return True
    chance, loss, acc = _chance(r), s.get("final_train_loss"), s.get("final_test_acc")
    if chance is None or not isinstance(loss, (int, float)) or not isinstance(acc, (int, float)):
        return False
    return loss >= 0.95 * math.log(1 / chance) and acc < 2 * chance


def _speed_only(r: dict[str, Any]) -> bool:
    """Runs whose accuracy means nothing: synthetic inputs, or the simulated NCCL (unreduced gradients)."""
    return bool(r.get("speed_only", r.get("synthetic")))


def accuracy_matches(runs: list[dict[str, Any]], points: float = MATCH_POINTS) -> list[dict[str, Any]]:
    """Per (setting, codec) of real-data multi-worker runs: accuracy mean/std over seeds, the paired
    difference to fp32 (same seed), and whether the codec matches fp32 within ``points`` (no verdict when
    fp32 itself did not learn: "fp32 did not learn")."""
    out = []
    for _, rs in _groups([r for r in runs if not _speed_only(r) and r["world_size"] > 1]).items():
        base = {r["seed"]: r["summary"].get("final_test_acc") for r in rs if r["codec"] == "fp32"}
        learned = _learned(list(base.values()), _chance(rs[0]))
        by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rs:
            by_label[r["label"]].append(r)
        for label in _order((r["label"], r["bits"]) for r in rs):
            group = by_label[label]
            accs = [r["summary"].get("final_test_acc") for r in group]
            m, s, n = _mean_std(accs)
            diffs = [r["summary"].get("final_test_acc") - base[r["seed"]] for r in group
                     if r["seed"] in base and base[r["seed"]] is not None and r["summary"].get("final_test_acc") is not None]
            dm, ds, dn = _mean_std(diffs)
            is_base = group[0]["codec"] == "fp32"
            gone = any(diverged(r) for r in group)
            verdict = "baseline" if is_base else ("no fp32 run" if dn == 0 else "fp32 did not learn" if not learned
                                                   else "diverged" if gone
                                                   else ("matches" if dm * 100 >= -points else "does not match"))
            out.append({
                "setting": _title(group[0]), "network": group[0]["network"], "dataset": group[0]["dataset"],
                "world_size": group[0]["world_size"], "label": label, "codec": group[0]["codec"],
                "bits": group[0]["bits"], "acc_mean": m, "acc_std": s, "n": n, "diff_mean": dm, "diff_std": ds,
                "n_pairs": dn, "verdict": verdict,
                # the -points line lies within one standard deviation of the mean difference
                "noisy": (not is_base and dn > 1 and abs(dm * 100 + points) < ds * 100),
                "diverged": gone,
            })
    return out


def _speedups(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """samples/s of each multi-worker run over fp32's at the same setting, world size and seed."""
    out = []
    for _, rs in _groups([r for r in runs if r["world_size"] > 1]).items():
        base = {r["seed"]: r["summary"].get("samples_per_s") for r in rs if r["codec"] == "fp32"}
        for r in rs:
            b = base.get(r["seed"])
            sps = r["summary"].get("samples_per_s")
            if r["codec"] == "fp32" or not b or not sps:
                continue
            out.append({"run": r, "speedup": sps / b, "ratio": r["summary"].get("comm_comp_ratio")})
    return out
