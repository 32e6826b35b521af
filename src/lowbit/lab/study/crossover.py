"""The speed model's local SGD cross-over against a ``localsgd`` study (issue 45; docs/perfmodel.md,
section 11): ``lowbit predict --localsgd-check RESULTS``.

For every world size of the study's time-to-accuracy runs and every local SGD configuration, against the
best per-step configuration (the DDP row with the lowest median time to target at that link):

* **measured**, at each emulated link: median over seeds of the time to target (the rule's: the
  baseline's final validation loss + 1 %; a seed that never reached it counts as never), of the strict
  time, steps to target, final validation loss, bytes per step, training seconds per step; the
  winner; and the measured cross-over: where the ratio (local SGD's time / the per-step one's) crosses
  1, interpolated on ``log ratio`` against ``log bandwidth`` between two links (extrapolated beyond them,
  and said so), or none when local SGD reached the target at no link;
* **predicted** (:mod:`lowbit.lab.perfmodel.localsgd`, the emulated-link rule with each link's stated latency
  per collective, as many collectives as the run measured a step (``collectives_per_step``: DDP's
  messages, one per bucket; local SGD's exchanges and, on CPU, ``lowbit.all_reduce``'s per-call check of
  each; one per exchange where a record lacks it), codecs free):
  each scheme's step from the model's size and the compute per step measured at
  that world size (the median
  of the runs' ``epoch_compute_s / steps``), and the steps ratio ``rho`` (local SGD's steps to target
  over the per-step configuration's, measured at each link where both reached it). The model's cross-over
  is :func:`lowbit.lab.perfmodel.localsgd.crossover_bandwidth` at that ``rho`` (their geometric mean over the
  links), against the per-step configuration that was best at the slowest link, the latency along the way
  interpolated between the links' (on ``log bandwidth``; held beyond them); where ``rho`` is unknown (local
  SGD never reached the target) the check gives, per link, the break-even steps ratio: the most steps
  local SGD could take, relative to the per-step scheme, and still be sooner.

The verdict is "within 2x" only when both a measured and a predicted cross-over exist.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from lowbit.lab.perfmodel.collectives import modeled_algorithms
from lowbit.lab.perfmodel.links import Link, parse_emulated_link
from lowbit.lab.perfmodel.localsgd import crossover_bandwidth, ddp_step, localsgd_step, model_layers
from lowbit.lab.perfmodel.model import Cluster, bits_per_value
from lowbit.lab.study.report import load_runs
from lowbit.lab.study.tta import time_to_target, time_to_target_strict, tta_runs

__all__ = ["check", "format_check", "TARGET_FACTOR"]

#: The issue's target: the predicted cross-over within this factor of the measured one.
TARGET_FACTOR = 2.0

_TORCH_DDP = "torch:ddp"


def _median(xs: list[float | None]) -> float | None:
    """Median with None as +inf (a seed that never got there); None when the median is one of those."""
    vals = sorted(math.inf if x is None else float(x) for x in xs)
    if not vals:
        return None
    m = statistics.median(vals)
    return None if math.isinf(m) else m


def _config(r: dict[str, Any]) -> tuple:
    return (r.get("parallelism"), r["codec"], int(r.get("local_steps") or 0), int(r.get("fragments") or 1),
            bool(r.get("error_feedback")), int(r.get("overlap") or 0))


def _model_codec(r: dict[str, Any]) -> str:
    return "fp32" if r["codec"] == _TORCH_DDP else r["codec"]


def _steps_to_target(r: dict[str, Any]) -> float | None:
    """The step of the validation point at which the run met its target under the rule (from its curve)."""
    t = time_to_target(r)
    return next((float(p["step"]) for p in r.get("curve") or [] if p.get("train_s") == t), None) \
        if t is not None else None


def _median_of(summaries: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the summaries, None where one lacks it (a record older than the key)."""
    vals = [x.get(key) for x in summaries]
    return statistics.median(float(v) for v in vals) if vals and all(v is not None for v in vals) else None


def _row(members: list[dict[str, Any]]) -> dict[str, Any]:
    r0 = members[0]
    s = [m["summary"] for m in members]
    steps = [float(x["steps"]) for x in s]
    h = int(r0.get("local_steps") or 0) if r0.get("parallelism") == "localsgd" else 1
    bytes_step = [x["bytes_sent_total"] / x["steps"] for x in s if x.get("steps") and x.get("bytes_sent_total")]
    return {
        "label": r0.get("label") or r0["codec"], "codec": r0["codec"], "parallelism": r0.get("parallelism"),
        "local_steps": h, "fragments": int(r0.get("fragments") or 1), "seeds": len(members),
        "reached": sum(time_to_target(m) is not None for m in members),
        "time_to_target_s": _median([time_to_target(m) for m in members]),
        "time_to_target_strict_s": _median([time_to_target_strict(m) for m in members]),
        "steps_to_target": _median([_steps_to_target(m) for m in members]),
        "target_loss": statistics.median(float(x["target_loss"]) for x in s if x.get("target_loss") is not None)
        if any(x.get("target_loss") is not None for x in s) else None,
        "final_val_loss": statistics.median(float(x["final_val_loss"]) for x in s),
        "steps": statistics.median(steps),
        "bytes_total": statistics.median(float(x.get("bytes_sent_total") or 0) for x in s),
        "bytes_per_step": statistics.median(bytes_step) if bytes_step else None,
        # a period's bytes (one fragment: every period sends the whole change; no sync at the run's end)
        "bytes_per_outer_step": statistics.median(x["bytes_sent_total"] / (x["steps"] // h) for x in s
                                                  if x.get("bytes_sent_total") and x["steps"] >= h)
        if h > 1 and int(r0.get("fragments") or 1) == 1 and any(x["steps"] >= h for x in s) else None,
        "train_s_per_step": statistics.median(float(x["train_s"]) / float(x["steps"]) for x in s if x.get("steps")),
        "compute_s_per_step": statistics.median(float(x["epoch_compute_s"]) / float(x["steps"]) for x in s
                                                if x.get("steps") and x.get("epoch_compute_s")),
        "stops": sorted({str(x.get("stop_reason")) for x in s}),
        "time_budget_s": _median_of(s, "time_budget_s"),
        # collectives issued a step (each pays the link's latency): measured where the records hold it
        "collectives_per_step": _median_of(s, "collectives_per_step"),
        "params": int(s[0]["params"]), "world_size": int(r0["world_size"]),
        "model_codec": _model_codec(r0),
        # the collective the run used, as the model names it (torch's hook: its native allreduce)
        "model_algorithm": r0.get("algorithm") if r0.get("algorithm") in modeled_algorithms() else "auto",
    }


def _latency_along(bw: dict[str, float], latency: dict[str, float]) -> Callable[[float], float]:
    """The latency at bandwidth ``b`` along the links measured: interpolated on ``log b`` between the two
    that bracket it, the nearest one's beyond them (the model's cross-over between a slow, far link and a
    fast, near one)."""
    pts = sorted((bw[k], latency[k]) for k in bw)

    def at(b: float) -> float:
        if b <= pts[0][0]:
            return pts[0][1]
        for (b1, l1), (b2, l2) in zip(pts, pts[1:]):
            if b <= b2 and b2 > b1:
                return l1 + (l2 - l1) * (math.log(b) - math.log(b1)) / (math.log(b2) - math.log(b1))
        return pts[-1][1]
    return at


def _interp_crossing(points: list[tuple[float, float]]) -> tuple[float | None, str]:
    """(bandwidth where the ratio crosses 1, how) from (bandwidth, ratio) points: interpolated between the
    two links that bracket it, else extrapolated from the two nearest ends (said so); None when no two points."""
    pts = sorted((b, r) for b, r in points if r is not None and math.isfinite(r) and r > 0)
    if len(pts) < 2:
        return None, "fewer than two links with a ratio"
    for (b1, r1), (b2, r2) in zip(pts, pts[1:]):
        if (r1 - 1) * (r2 - 1) <= 0 and r1 != r2:
            return _cross(b1, r1, b2, r2), "interpolated between the links"
    (b1, r1), (b2, r2) = pts[0], pts[-1]
    if r1 == r2:
        return None, "the ratio does not change with the link"
    x = _cross(b1, r1, b2, r2)
    return x, "extrapolated beyond the links measured"


def _bracket(points: list[tuple[float, float]], floors: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Where the cross-over lies when local SGD was sooner (ratio < 1) at a link and never reached the
    target within its budget at a faster one (``floors``: its ratio there at least budget / the per-step
    time): between the slower link and where the ratio would cross 1 were it only that floor (a larger
    ratio crosses sooner). None without such a pair."""
    wins = [(b, r) for b, r in points if r < 1]
    out = None
    for b1, r1 in wins:
        for b2, f in floors:
            if b2 > b1 and f > 1:
                hi = _cross(b1, r1, b2, f)
                out = (b1, hi) if out is None else (max(out[0], b1), min(out[1], hi))
    return out


def _cross(b1: float, r1: float, b2: float, r2: float) -> float:
    lb1, lb2, lr1, lr2 = math.log(b1), math.log(b2), math.log(r1), math.log(r2)
    return math.exp(lb1 + (0 - lr1) * (lb2 - lb1) / (lr2 - lr1))


def check(results: str) -> dict[str, Any]:
    """The measured and predicted cross-overs of a ``localsgd`` study (module doc).

    Args:
        results: a results directory (holding ``results.jsonl``) or the ``.jsonl``.

    Returns:
        ``{"results", "settings": [{"world_size", "compute_s_per_step", "links": {link: [rows]},
        "comparisons": [...]}], "notes"}``; each comparison names the local SGD row, the per-step row it is
        compared with at each link, the measured and predicted cross-overs (bytes/s or None) and the verdict.

    Raises:
        ValueError: the results hold no time-to-accuracy runs of local SGD and DDP over an emulated link.
    """
    runs = [r for r in tta_runs(load_runs(results)[0]) if r.get("emulate_link")]
    if not any(r.get("parallelism") == "localsgd" for r in runs) or not any(
            r.get("parallelism") == "data" for r in runs):
        raise ValueError(f"{results}: no time-to-accuracy runs of both local SGD and DDP over an emulated link "
                         "(run `lowbit study --preset localsgd`)")
    by: dict[int, dict[str, dict[tuple, list[dict[str, Any]]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in runs:
        by[int(r["world_size"])][r["emulate_link"]][_config(r)].append(r)
    settings = []
    for k in sorted(by):
        links = {link: [_row(m) for m in cfgs.values()] for link, cfgs in by[k].items()}
        bw = {link: parse_emulated_link(link)[0] for link in links}
        latency = {link: parse_emulated_link(link)[1] for link in links}
        lat_at = _latency_along(bw, latency)
        comp = [row["compute_s_per_step"] for rows in links.values() for row in rows
                if row["parallelism"] == "data" and row["codec"] == _TORCH_DDP]
        compute = statistics.median(comp) if comp else statistics.median(
            row["compute_s_per_step"] for rows in links.values() for row in rows)
        params = next(iter(links.values()))[0]["params"]
        layers = model_layers(params, compute)
        best = {}
        for link, rows in links.items():
            ddp = [row for row in rows if row["parallelism"] == "data"]
            best[link] = min(ddp, key=lambda row: (row["time_to_target_s"] is None,
                                                   row["time_to_target_s"] or 0.0))
        local_labels = sorted({row["label"] for rows in links.values() for row in rows
                               if row["parallelism"] == "localsgd"})
        comparisons = []
        for label in local_labels:
            per_link, ratios, rhos, floors = {}, [], [], []
            for link in sorted(links, key=lambda x: bw[x]):
                loc = next((row for row in links[link] if row["label"] == label), None)
                if loc is None:
                    continue
                ref = best[link]
                cl = Cluster(k, k, Link(latency[link], bw[link], link))
                d = ddp_step(layers, cl, ref["model_codec"], algorithm=ref["model_algorithm"], link_rule="emulated",
                             collectives=_collectives(ref))
                lo = localsgd_step(layers, cl, loc["model_codec"], loc["local_steps"], fragments=loc["fragments"],
                                   algorithm=loc["model_algorithm"], link_rule="emulated",
                                   collectives=_collectives(loc))
                ratio = (loc["time_to_target_s"] / ref["time_to_target_s"]
                         if loc["time_to_target_s"] and ref["time_to_target_s"] else None)
                rho = (loc["steps_to_target"] / ref["steps_to_target"]
                       if loc["steps_to_target"] and ref["steps_to_target"] else None)
                if ratio is not None:
                    ratios.append((bw[link], ratio))
                elif loc["time_to_target_s"] is None and ref["time_to_target_s"] and loc["time_budget_s"]:
                    # local SGD never got there within its budget: its ratio is at least budget / theirs
                    floors.append((bw[link], loc["time_budget_s"] / ref["time_to_target_s"]))
                if rho is not None:
                    rhos.append(rho)
                per_link[link] = {"versus": ref["label"], "measured_ratio": ratio, "steps_ratio": rho,
                                  "local_time_s": loc["time_to_target_s"], "per_step_time_s": ref["time_to_target_s"],
                                  "predicted_ddp_step_s": d.step_s, "predicted_local_step_s": lo.step_s,
                                  "break_even_steps_ratio": d.step_s / lo.step_s}
            measured, how = _interp_crossing(ratios)
            if not ratios:
                measured, how = None, "local SGD reached the target at no link: no measured cross-over"
            predicted = None
            if rhos:
                rho = math.exp(statistics.fmean(math.log(x) for x in rhos))
                ref_row = best[min(links, key=lambda x: bw[x])]
                loc_row = next(row for rows in links.values() for row in rows if row["label"] == label)

                def at(b: float, row: dict[str, Any] = ref_row) -> float:
                    return ddp_step(layers, Cluster(k, k, Link(lat_at(b), b)), row["model_codec"],
                                    algorithm=row["model_algorithm"], link_rule="emulated",
                                    collectives=_collectives(row)).step_s

                def loc_at(b: float, row: dict[str, Any] = loc_row) -> float:
                    return localsgd_step(layers, Cluster(k, k, Link(lat_at(b), b)), row["model_codec"], row["local_steps"],
                                         fragments=row["fragments"], algorithm=row["model_algorithm"],
                                         link_rule="emulated", collectives=_collectives(row)).step_s
                predicted = crossover_bandwidth(at, loc_at, rho)
            bracket = _bracket(ratios, floors) if measured is None else None
            if bracket is not None and predicted is not None and predicted not in (0.0, math.inf):
                lo, hi = bracket
                how = (f"local SGD sooner at {_bw(lo)}, never within its budget at a faster link: between "
                       f"{_bw(lo)} and {_bw(hi)} (from the budget's bound on the ratio there)")
                if lo <= predicted <= hi:
                    worst = max(hi / predicted, predicted / lo)  # from the bracket's farther end
                    verdict = (f"inside the measured bracket; {'within' if worst <= TARGET_FACTOR else 'NOT within'} "
                               f"{TARGET_FACTOR:g}x of all of it (factor at most {worst:.2f})")
                else:
                    f = lo / predicted if predicted < lo else predicted / hi
                    verdict = (f"{'within' if f <= TARGET_FACTOR else 'NOT within'} {TARGET_FACTOR:g}x of the "
                               f"measured bracket (factor {f:.2f} to its nearer end)")
            elif measured is None or predicted is None or predicted in (0.0, math.inf):
                verdict = "no verdict: " + ("no measured cross-over" if measured is None
                                            else "no predicted cross-over" if predicted is None
                                            else "the model predicts local SGD pays on every link or none")
            else:
                f = max(measured / predicted, predicted / measured)
                verdict = f"{'within' if f <= TARGET_FACTOR else 'NOT within'} {TARGET_FACTOR:g}x (factor {f:.2f})"
            comparisons.append({"local": label, "links": per_link, "measured_crossover_Bps": measured,
                                "measured_bracket_Bps": bracket,
                                "measured_how": how, "predicted_crossover_Bps": predicted,
                                "steps_ratio_used": math.exp(statistics.fmean(math.log(x) for x in rhos))
                                if rhos else None, "verdict": verdict})
        settings.append({"world_size": k, "compute_s_per_step": compute, "params": params, "links": links,
                         "comparisons": comparisons, "targets": _targets(by[k], links, best, comparisons)})
    counted = all(row["collectives_per_step"] is not None for st in settings for rows in st["links"].values()
                  for row in rows)
    return {"results": str(results), "settings": settings,
            "notes": "predicted: the emulated-link rule (the bytes a rank contributes / the link speed, plus the "
                     "link's stated one-way latency per collective: "
                     + ("the collectives per step each run measured" if counted else
                        "one per exchange, these records hold no collectives per step") + "), "
                     "codecs free, compute per step the median measured by the DDP fp32 runs at that world size"}


def _find(cfgs: dict[tuple, list[dict[str, Any]]], prefix: str, fragments: int = 1) -> list[dict[str, Any]]:
    """The local SGD runs whose codec spec starts with ``prefix`` (one fragment unless said)."""
    return next((m for (par, codec, _, f, _, overlap), m in cfgs.items()
                 if par == "localsgd" and codec.startswith(prefix) and f == fragments and not overlap), [])


def _paired(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Median over the seeds both ran of a's final validation loss / b's, and whether each pair ran the
    same steps."""
    fb = {r["seed"]: r["summary"] for r in b}
    pairs = [(r["summary"]["final_val_loss"] / fb[r["seed"]]["final_val_loss"],
              r["summary"]["steps"] == fb[r["seed"]]["steps"]) for r in a if r["seed"] in fb]
    if not pairs:
        return None
    return {"ratio": statistics.median(x for x, _ in pairs), "seeds": len(pairs),
            "equal_steps": all(e for _, e in pairs), "per_seed": sorted(x for x, _ in pairs)}


def _collectives(row: dict[str, Any]) -> float | None:
    """The collectives of one exchange the model prices for ``row``: a DDP step's, or one fragment's
    exchange of local SGD (a period's collectives over its fragments); None where not measured."""
    c = row.get("collectives_per_step")
    if c is None:
        return None
    return c if row["parallelism"] != "localsgd" else c * row["local_steps"] / row["fragments"]


def _targets(cfgs_by_link: dict[str, dict[tuple, list[dict[str, Any]]]], links: dict[str, list[dict[str, Any]]],
             best: dict[str, dict[str, Any]], comparisons: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 45's targets (item 3) at one world size, from the measured rows (module doc)."""
    out: dict[str, Any] = {}
    slow = min(links, key=lambda link: parse_emulated_link(link)[0])
    q4 = next((row for row in links[slow] if row["parallelism"] == "localsgd" and row["fragments"] == 1
               and row["codec"].startswith("qsgd:bits=4")), None)
    ref = best[slow]
    if q4 is not None:
        t, b = q4["time_to_target_s"], ref["time_to_target_s"]
        x = b / t if t and b else None
        out["sooner_at_slowest"] = {
            "link": slow, "local": q4["label"], "versus": ref["label"], "local_time_s": t, "per_step_time_s": b,
            "times_sooner": x, "met": x is not None and x >= 3.0,
            "note": None if x is not None else ("local SGD's median run never reached the target" if t is None
                                                else "the per-step configuration never reached it")}
    losses: dict[str, Any] = {}
    for link, cfgs in cfgs_by_link.items():
        fp, dt = _find(cfgs, "fp32"), _find(cfgs, "dettmers")
        for name, prefix in (("4bit", "qsgd:bits=4"), ("2bit", "qsgd:bits=2")):
            runs = _find(cfgs, prefix)
            vs_fp = _paired(runs, fp)
            vs_dt = _paired(runs, dt)
            losses[f"{link} {name}"] = {"vs_fp32": vs_fp, "vs_8bit_rowscaled": vs_dt,
                                        "met_within_1pct": vs_fp is not None and vs_fp["ratio"] <= 1.01,  # lower is no miss
                                        "at_most_8bit": vs_dt is not None and vs_dt["ratio"] <= 1.0}
    out["final_loss_at_equal_steps"] = losses
    ratios: dict[str, Any] = {}
    for link, rows in links.items():
        fp = next((r for r in rows if r["parallelism"] == "localsgd" and r["codec"] == "fp32"), None)
        for row in rows:
            if row["parallelism"] != "localsgd" or row is fp or fp is None or row["bytes_per_outer_step"] is None:
                continue
            from_codec = bits_per_value(row["model_codec"], row["params"]) / 32
            k = int(row["world_size"])
            layers, cl = model_layers(row["params"], 1.0), Cluster(k, k, Link(0.0, 1e9))
            model = (localsgd_step(layers, cl, row["model_codec"], row["local_steps"],
                                   algorithm=row["model_algorithm"]).bytes_per_exchange
                     / localsgd_step(layers, cl, "fp32", fp["local_steps"],
                                     algorithm=fp["model_algorithm"]).bytes_per_exchange)
            got = row["bytes_per_outer_step"] / fp["bytes_per_outer_step"]
            ratios[f"{link} {row['label']}"] = {"ratio": got, "codec_framed": from_codec, "algorithm":
                                                 row["model_algorithm"], "with_algorithms": model,
                                                 "met": abs(got / from_codec - 1) < 0.01,
                                                 "as_modelled": abs(got / model - 1) < 0.01}
    out["bytes_per_outer_step_vs_fp32"] = ratios
    out["crossover"] = {c["local"]: c["verdict"] for c in comparisons}
    return out


def _bw(b: float | None) -> str:
    if b is None:
        return "-"
    if math.isinf(b):
        return "every link"
    if b <= 0:
        return "no link"
    return f"{b * 8 / 1e6:.3g} Mbit/s"


def _n(x: float | None) -> str:
    return "never" if x is None else f"{x:.0f}"


def _s(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f}"


def format_check(rep: dict[str, Any]) -> str:
    """:func:`check`'s report as text: the measured rows per link, then each comparison."""
    lines = [f"local SGD vs per-step compression, measured ({rep['results']}) and predicted", rep["notes"]]
    for st in rep["settings"]:
        lines += ["", f"K={st['world_size']}: {st['params']:,} params, compute {st['compute_s_per_step'] * 1e3:.1f} "
                  "ms/step (measured)"]
        head = (f"  {'link':<12} {'configuration':<40} {'seeds':>5} {'reached':>7} {'tta s':>7} {'strict s':>8} "
                f"{'to tgt':>6} {'steps':>6} {'final loss':>10} {'kB/step':>8} {'ms/step':>8} stops")
        lines += [head, "  " + "-" * (len(head) - 2)]
        for link, rows in sorted(st["links"].items(), key=lambda kv: parse_emulated_link(kv[0])[0]):
            for row in sorted(rows, key=lambda r: (r["time_to_target_s"] is None, r["time_to_target_s"] or 0)):
                lines.append(
                    f"  {link:<12} {row['label'][:40]:<40} {row['seeds']:>5} {row['reached']:>7} "
                    f"{_s(row['time_to_target_s']):>7} {_s(row['time_to_target_strict_s']):>8} "
                    f"{_n(row['steps_to_target']):>6} {row['steps']:>6.0f} "
                    f"{row['final_val_loss']:>10.4f} {(row['bytes_per_step'] or 0) / 1e3:>8.1f} "
                    f"{row['train_s_per_step'] * 1e3:>8.1f} {','.join(row['stops'])}")
        for c in st["comparisons"]:
            lines.append(f"  {c['local']}:")
            for link, v in c["links"].items():
                lines.append(
                    f"    {link}: vs {v['versus']}: time ratio {_s(v['measured_ratio'])}, steps ratio "
                    f"{_s(v['steps_ratio'])}; model's steps {v['predicted_local_step_s'] * 1e3:.1f} vs "
                    f"{v['predicted_ddp_step_s'] * 1e3:.1f} ms: sooner if it needs < "
                    f"{v['break_even_steps_ratio']:.2f}x the steps")
            lines.append(f"    measured cross-over {_bw(c['measured_crossover_Bps'])} ({c['measured_how']}); "
                         f"predicted {_bw(c['predicted_crossover_Bps'])}"
                         + (f" at steps ratio {c['steps_ratio_used']:.2f}" if c["steps_ratio_used"] else
                            " (no steps ratio: local SGD never reached the target)") + f"; {c['verdict']}")
        t = st["targets"]
        lines.append("  issue 45's targets (item 3):")
        s3 = t.get("sooner_at_slowest")
        if s3:
            lines.append(f"    {s3['local']} vs {s3['versus']} at {s3['link']}: "
                         + (f"{s3['times_sooner']:.2f}x sooner" if s3["times_sooner"] is not None else s3["note"])
                         + f" (target >= 3x: {'met' if s3['met'] else 'NOT met'})")
        for key, v in t["final_loss_at_equal_steps"].items():
            def pct(p: dict[str, Any] | None) -> str:
                if p is None:
                    return "-"
                return (f"{100 * (p['ratio'] - 1):+.2f} % (median of {p['seeds']} seeds"
                        + ("" if p["equal_steps"] else ", NOT at equal steps") + ")")
            if v["vs_fp32"] is None and v["vs_8bit_rowscaled"] is None:
                lines.append(f"    final loss {key}: no runs to compare")
                continue
            lines.append(f"    final loss {key}: vs fp32 deltas {pct(v['vs_fp32'])} (at most +1 %: "
                         f"{'met' if v['met_within_1pct'] else 'NOT met'}); vs 8-bit row-scaled "
                         f"{pct(v['vs_8bit_rowscaled'])}, at equal steps, not equal bytes "
                         f"({'at most' if v['at_most_8bit'] else 'above'})")
        for key, v in t["bytes_per_outer_step_vs_fp32"].items():
            lines.append(f"    bytes per outer step {key}: {v['ratio']:.4f} of fp32 deltas' (the codec's framed "
                         f"size {v['codec_framed']:.4f}: {'met' if v['met'] else 'NOT met'}; with {v['algorithm']} "
                         f"against fp32's ring allreduce the model counts {v['with_algorithms']:.4f}: "
                         f"{'as modelled' if v['as_modelled'] else 'NOT as modelled'})")
    return "\n".join(lines)
