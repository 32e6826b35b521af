"""The study report's figures (matplotlib's Agg canvas, no pyplot state): accuracy curves, time breakdowns,
scalability, price, speed-up against the model, time to accuracy (:mod:`lowbit.lab.study.report` places them)."""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowbit.extras import require
from lowbit.lab.perfmodel.projection import projection_curve, speedup_bound
from lowbit.lab.study.tta import setting_title, tta_metric, tta_runs, tta_setting
from lowbit.lab.study.analysis import _groups, _groups_across_k, _mean_std, _order, _speed_only, _speedups, _title, diverged


# ------------------------------------------------------------------------------------ plots
_PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
            "#17becf", "#393b79", "#637939"]


def _colors(labels: Sequence[str]) -> dict[str, str]:
    out, i = {}, 0
    for lab in labels:
        if lab.startswith("32bit"):
            out[lab] = "#00bcd4"  # the seed's "Cyan = 32bit"
        else:
            out[lab] = _PALETTE[i % len(_PALETTE)]
            i += 1
    return out


def _figure(n_panels: int, width: float = 4.6, height: float = 3.4, max_cols: int = 3):

    Figure = require("matplotlib.figure", "study", "lowbit report's plots").Figure  # noqa: N806
    backend_agg = require("matplotlib.backends.backend_agg", "study", "lowbit report's plots")

    cols = min(max_cols, max(1, n_panels))
    rows = max(1, math.ceil(n_panels / cols))
    fig = Figure(figsize=(width * cols, height * rows), dpi=90)
    backend_agg.FigureCanvasAgg(fig)  # the canvas savefig draws on; its renderer measures text before the layout
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    return fig, axes[:n_panels]


def _legend_above(fig: Any, axes: Sequence[Any], fontsize: float = 7.0, extra: Sequence[tuple[Any, str]] = ()) -> Any:
    """One legend for all panels, above them (the figure grows by its height; :func:`_save` lays the panels
    out below it). Inside a panel a legend covered curves and bars, and named only that panel's series.

    Args:
        fig: the figure, from :func:`_figure`.
        axes: its panels; every labelled artist of any of them gets one entry (the first of each label).
        fontsize: of the entries.
        extra: (handle, label) entries added at the end (a key for a marker style, say).

    Returns:
        The legend, or None when nothing is labelled. It has as many columns as fit the figure's width.
    """
    handles: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    for handle, label in extra:
        handles.setdefault(label, handle)
    if not handles:
        return None
    renderer = fig.canvas.get_renderer()
    for ncols in range(len(handles), 0, -1):
        leg = fig.legend(list(handles.values()), list(handles), loc="upper center", bbox_to_anchor=(0.5, 1.0),
                         ncols=ncols, fontsize=fontsize, frameon=False, columnspacing=1.5)
        for text in leg.get_texts():  # labels are names, drawn as written (measured now, before _save)
            text.set_parse_math(False)
        if ncols == 1 or leg.get_window_extent(renderer).width <= 0.97 * fig.bbox.width:
            break
        leg.remove()
    w, h = fig.get_size_inches()
    fig.set_size_inches(w, h + leg.get_window_extent(renderer).height / fig.dpi)
    return leg


def _word_ticks(ax: Any, labels: Sequence[str], **kwargs: Any) -> None:
    """Label the x ticks 0..n-1 with ``labels`` drawn as written (their '$' escaped: tick labels are
    mathtext, see :func:`_save`)."""
    ax.set_xticks(range(len(labels)), [lab.replace("$", "\\$") for lab in labels], **kwargs)


def _save(fig: Any, out: Path, name: str) -> str:
    """Lay ``fig`` out and write it to ``out / name`` (the format from the name's suffix).

    Words from the results (codec, network and data set names in titles, legends, notes and category tick
    labels) are drawn as written: a '$' there is not mathtext. Tick labels stay mathtext, as matplotlib's
    formatters write them (a log axis labels its ticks ``$\\mathdefault{10^{-3}}$``, drawn as 10⁻³); words
    as tick labels go through :func:`_word_ticks`, which escapes their '$'."""
    formatted: set[int] = set()  # tick labels keep parse_math on (words among them: _word_ticks)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            formatted.add(id(axis.offsetText))
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                formatted.update((id(tick.label1), id(tick.label2)))
    for text in fig.findobj(lambda a: hasattr(a, "set_parse_math")):
        if id(text) not in formatted:
            text.set_parse_math(False)
    # the panels go under the figure's legend (see _legend_above), which sits at the top edge
    renderer = fig.canvas.get_renderer()
    top = max([(leg.get_window_extent(renderer).height + 4) / fig.bbox.height for leg in fig.legends], default=0.0)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 1.0 - top))
    fig.savefig(out / name)
    return name


def _plot_accuracy(runs: list[dict[str, Any]], out: Path, field: str, ylabel: str, name: str) -> str | None:
    groups = [rs for rs in _groups([r for r in runs if not _speed_only(r) and r["world_size"] > 1]).values()]
    if not groups:
        return None
    groups.sort(key=lambda rs: _title(rs[0]))
    labels = _order((r["label"], r["bits"]) for rs in groups for r in rs)
    colors = _colors(labels)
    fig, axes = _figure(len(groups))
    for ax, rs in zip(axes, groups):
        by: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in rs:
            by[r["label"]].append(r)
        gone = {label for label, group in by.items() if any(diverged(r) for r in group)}
        scale = 100.0 if field == "test_acc" else 1.0
        lo, hi = -math.inf, math.inf
        if field == "test_acc":
            # zoomed on the final accuracies of the runs that learned, so that close codecs stay apart; what
            # falls outside is marked at the edge below
            finals = [r["summary"].get("final_test_acc") or 0 for r in rs if r["label"] not in gone] or [0.0, 1.0]
            lo = max(0.0, min(finals) * 100 - 12)
            hi = min(100.0, max(finals) * 100 + 4)
            ax.set_ylim(lo, hi)
        elif gone and len(gone) < len(by):  # the others' range: a diverged curve would flatten theirs
            kept = [e.get(field) for r in rs if r["label"] not in gone for e in r["epoch_rows"]]
            kept = [v * scale for v in kept if isinstance(v, (int, float)) and math.isfinite(v)]
            if kept:
                pad = 0.06 * (max(kept) - min(kept)) or 0.1
                lo, hi = min(kept) - pad, max(kept) + pad
                ax.set_ylim(lo, hi)
        off: list[tuple[str, str, list[tuple[str, str, float]]]] = []  # (curve, colour, where it left)
        for label in [lab for lab in labels if lab in by]:
            curves = [[e.get(field) for e in r["epoch_rows"]] for r in by[label]]
            n_ep = min(len(c) for c in curves)
            xs = list(range(1, n_ep + 1))
            stats = [_mean_std([c[i] for c in curves]) for i in range(n_ep)]
            m = [s[0] * scale for s in stats]
            sd = [s[1] * scale for s in stats]
            lw = 2.4 if label.startswith("32bit") else 1.3
            shown = f"{label} (diverged)" if label in gone else label
            ax.plot(xs, m, label=shown, color=colors[label], lw=lw, marker="o", ms=2.5,
                    ls=":" if label in gone else "-")
            parts = _off_axis(ax, xs, m, lo, hi, colors[label], shown)
            if parts:
                off.append((shown, colors[label], parts))
            if len(curves) > 1:
                ax.fill_between(xs, [a - b for a, b in zip(m, sd)], [a + b for a, b in zip(m, sd)],
                                color=colors[label], alpha=0.12, lw=0)
        ax.set_title(_title(rs[0]), fontsize=8.5)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        # said under the panel, below its x label, one note under the other: outside the axes, so a note never
        # covers a curve, the legend (above the panels) or another note
        cols = ax.get_subplotspec().get_gridspec().ncols
        width = int(fig.get_figwidth() / cols * 72 * 0.8 / (_NOTE_PT * 0.56))  # characters in a panel's width
        offset = -2.0
        panel = [f"{lab} (diverged)" if lab in gone else lab for lab in labels if lab in by]
        for text, color, who in _off_axis_notes(off, panel, width):
            ax.annotate(text, xy=(0.0, 0.0), xycoords=("axes fraction", ax.xaxis.label), ha="left", va="top",
                        xytext=(0, offset), textcoords="offset points", fontsize=_NOTE_PT, color=color,
                        annotation_clip=False, gid=f"off-axis note: {who}")
            offset -= _NOTE_PT * 1.25 * (text.count("\n") + 1) + 1.5
    _legend_above(fig, axes)
    return _save(fig, out, name)


#: Font size (points) of Figure 5's notes under a panel.
_NOTE_PT = 7.0


def _off_axis(ax: Any, xs: Sequence[float], ys: Sequence[float], lo: float, hi: float, color: str,
              label: str) -> list[tuple[str, str, float]]:
    """Mark the points of a curve that lie outside the axis's [lo, hi]: a triangle on the edge they left
    by (▼ bottom, ▲ top), at their epoch. Returns where it left, ``(side, epochs, lowest or highest value)``
    per side ("below" / "above"; epochs as :func:`_ranges` writes them), and ``("not finite", epochs, nan)``
    for epochs whose mean is NaN or infinite (a diverged loss); empty when the curve stays on the axis."""
    out = []
    below = [(x, y) for x, y in zip(xs, ys) if y < lo]
    above = [(x, y) for x, y in zip(xs, ys) if y > hi and math.isfinite(y)]
    for pts, edge, marker, side in ((below, lo, "v", "below"), (above, hi, "^", "above")):
        if not pts:
            continue
        ax.plot([x for x, _ in pts], [edge] * len(pts), ls="none", marker=marker, ms=7, color=color,
                clip_on=False, zorder=5, gid=f"off-axis {side}: {label}")
        value = min(y for _, y in pts) if side == "below" else max(y for _, y in pts)
        out.append((side, _ranges([x for x, _ in pts]), value))
    bad = [x for x, y in zip(xs, ys) if not math.isfinite(y)]
    if bad:
        out.append(("not finite", _ranges(bad), math.nan))
    return out


def _off_axis_notes(off: Sequence[tuple[str, str, list[tuple[str, str, float]]]], panel: Sequence[str],
                    width: int) -> list[tuple[str, str, str]]:
    """The lines under a Figure 5 panel whose curves (labelled as in ``panel``) left the axis as ``off`` says:
    curves that left at the same epochs share one note ("every curve: ▼ below the axis at epoch 1–2 (min
    42.2)" when all did, as every curve starts below an axis zoomed on the final accuracies; "every curve but
    ..." when most did), in the curve's colour when it is one, grey otherwise; wrapped at ``width``
    characters. Returns ``(text, colour, the note's curves' labels joined by '|')`` per note."""
    groups: dict[tuple, list[tuple[str, str, list[tuple[str, str, float]]]]] = defaultdict(list)
    for item in off:
        groups[tuple((side, epochs) for side, epochs, _ in item[2])].append(item)
    notes = []
    for where, items in groups.items():
        labels = [label for label, _, _ in items]
        others = [label for label in panel if label not in labels]
        who = (labels[0] if len(labels) == 1 else "every curve" if not others
               else f"every curve but {', '.join(others)}" if len(others) < min(len(labels), 4) else ", ".join(labels))
        said = []
        for i, (side, epochs) in enumerate(where):
            values = [item[2][i][2] for item in items]
            if side == "not finite":
                said.append(f"not finite at epoch {epochs}")
            else:
                value = min(values) if side == "below" else max(values)
                arrow, extreme = ("▼", "min") if side == "below" else ("▲", "max")
                said.append(f"{arrow} {side} the axis at epoch {epochs} ({extreme} {value:.1f})")
        text = textwrap.fill(f"{who}: {'; '.join(said)}", width=max(30, width), break_on_hyphens=False)
        notes.append((text, items[0][1] if len(items) == 1 else "#444444", "|".join(labels)))
    return notes


def _ranges(xs: Sequence[float]) -> str:
    """Epochs as runs of consecutive ones: [1, 2, 3, 5] -> "1–3, 5"."""
    out: list[list[float]] = []
    for x in xs:
        if out and x == out[-1][-1] + 1:
            out[-1].append(x)
        else:
            out.append([x])
    return ", ".join(f"{r[0]:g}" if len(r) == 1 else f"{r[0]:g}–{r[-1]:g}" for r in out)


def _bar_groups(runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Multi-worker settings at their largest world size (the seed's bars are for its largest machine)."""
    groups = _groups([r for r in runs if r["world_size"] > 1]).values()
    return sorted(groups, key=lambda rs: _title(rs[0]))


def _per_label(rs: list[dict[str, Any]], fields: Sequence[str]) -> tuple[list[str], dict[str, dict[str, float]]]:
    labels = _order((r["label"], r["bits"]) for r in rs)
    vals: dict[str, dict[str, float]] = {}
    for lab in labels:
        group = [r for r in rs if r["label"] == lab]
        vals[lab] = {f: _mean_std([r["summary"].get(f) for r in group])[0] for f in fields}
    return labels, vals


def _plot_breakdown(runs: list[dict[str, Any]], out: Path) -> str | None:
    groups = _bar_groups(runs)
    if not groups:
        return None
    fig, axes = _figure(len(groups), width=5.2, height=3.6)
    for ax, rs in zip(axes, groups):
        labels, v = _per_label(rs, ("epoch_exposed_comm_s", "epoch_compute_s"))
        comm = [v[lab]["epoch_exposed_comm_s"] for lab in labels]
        comp = [v[lab]["epoch_compute_s"] for lab in labels]
        xs = range(len(labels))
        ax.bar(xs, comm, color="#37474f", label="communication (exposed)")
        ax.bar(xs, comp, bottom=comm, color="#90caf9", label="computation (incl. overlapped encode/decode)")
        _word_ticks(ax, labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("seconds per epoch")
        ax.set_title(_title(rs[0]), fontsize=8.5)
        ax.grid(axis="y", alpha=0.3)
    _legend_above(fig, axes)
    return _save(fig, out, "fig6_9_time_breakdown.png")


def _plot_phases(runs: list[dict[str, Any]], out: Path) -> str | None:
    groups = _bar_groups(runs)
    if not groups:
        return None
    fig, axes = _figure(len(groups), width=5.2, height=3.6)
    fields = (("epoch_encode_s", "encode", "#ffb74d"), ("epoch_comm_s", "communicate", "#37474f"),
              ("epoch_decode_s", "decode", "#81c784"))
    for ax, rs in zip(axes, groups):
        labels, v = _per_label(rs, [f for f, _, _ in fields])
        w = 0.27
        for j, (f, name, color) in enumerate(fields):
            ax.bar([i + (j - 1) * w for i in range(len(labels))], [v[lab][f] for lab in labels], width=w,
                   color=color, label=name)
        _word_ticks(ax, labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("thread seconds per epoch")
        ax.set_title(_title(rs[0]), fontsize=8.5)
        ax.grid(axis="y", alpha=0.3)
    _legend_above(fig, axes)
    return _save(fig, out, "fig6_9_phases.png")


def _scaling_groups(runs: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    groups = _groups_across_k(runs).values()
    keep = []
    for rs in groups:
        ks = {r["world_size"] for r in rs}
        if 1 in ks and len(ks) > 1 and any(r["codec"] == "fp32" and r["world_size"] == 1 for r in rs):
            keep.append(rs)
    return sorted(keep, key=lambda rs: _title(rs[0], with_k=False))


def _plot_scalability(runs: list[dict[str, Any]], out: Path) -> str | None:
    groups = _scaling_groups(runs)
    if not groups:
        return None
    labels_all = _order((r["label"], r["bits"]) for rs in groups for r in rs)
    colors = _colors(labels_all)
    fig, axes = _figure(len(groups))
    for ax, rs in zip(axes, groups):
        base = _mean_std([r["summary"].get("samples_per_s") for r in rs if r["codec"] == "fp32" and r["world_size"] == 1])[0]
        kmax = max(r["world_size"] for r in rs)
        for lab in [x for x in labels_all if any(r["label"] == x for r in rs)]:
            pts = {1: 1.0}
            for k in sorted({r["world_size"] for r in rs if r["label"] == lab and r["world_size"] > 1}):
                sps = _mean_std([r["summary"].get("samples_per_s") for r in rs if r["label"] == lab and r["world_size"] == k])[0]
                pts[k] = sps / base if base else math.nan
            if len(pts) < 2:
                continue
            ks = sorted(pts)
            ax.plot(ks, [pts[k] for k in ks], marker="o", label=lab, color=colors[lab],
                    lw=2.4 if lab.startswith("32bit") else 1.3)
        ax.plot([1, kmax], [1, kmax], ls="--", color="grey", lw=0.8, label="linear")
        ax.set_xlabel("number of workers")
        ax.set_ylabel("speedup over 1 worker, 32bit")
        ax.set_title(_title(rs[0], with_k=False), fontsize=8.5)
        ax.set_xticks(sorted({r["world_size"] for r in rs}))
        ax.grid(alpha=0.3)
    _legend_above(fig, axes)
    return _save(fig, out, "fig12_15_scalability.png")


def _plot_price(runs: list[dict[str, Any]], out: Path, price: float) -> str | None:
    """Price of the training time against final test accuracy, one point per (setting, precision, workers),
    the mean over seeds. Runs that diverged (:func:`diverged`) are never averaged with the others: their
    point is hollow and crossed, with a key in the legend, as the table marks them "✗ diverged"."""
    real = [r for r in runs if not _speed_only(r)]
    if not real:
        return None
    pts: dict[tuple[str, str, int, bool], list[dict[str, Any]]] = defaultdict(list)
    for r in real:
        pts[(_title(r, with_k=False, with_batch=False), r["label"], r["world_size"], diverged(r))].append(r)
    settings = sorted({k[0] for k in pts})
    labels = _order((r["label"], r["bits"]) for r in real)
    colors = _colors(labels)
    markers = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]
    fig, axes = _figure(1, width=7.5, height=4.6)
    ax = axes[0]
    extra: list[tuple[Any, str]] = []
    for (setting, lab, k, gone), rs in pts.items():
        cost = _mean_std([r["summary"].get("train_s", 0) * k / 3600 * price for r in rs])[0]
        acc = _mean_std([r["summary"].get("final_test_acc") for r in rs])[0] * 100
        color, marker = colors.get(lab, "k"), markers[settings.index(setting) % len(markers)]
        if gone:  # hollow and crossed, as the table's "✗ diverged" (a word beside each would overlap the next)
            ax.scatter([cost], [acc], facecolors="none", edgecolors=color, marker=marker, s=70, lw=1.3, zorder=4,
                       gid=f"diverged: {lab}, {setting}, K={k}")
            ax.scatter([cost], [acc], color=color, marker="x", s=28, lw=1.3, zorder=4)
            continue
        ax.scatter([cost], [acc], color=color, marker=marker,
                   s=28 if k > 1 else 50, edgecolor="k" if k == 1 else "none", lw=0.6)
    for lab in labels:
        ax.scatter([], [], color=colors[lab], marker="o", label=lab)
    for i, s in enumerate(settings):
        ax.scatter([], [], color="grey", marker=markers[i % len(markers)], label=s)
    if any(k[3] for k in pts):
        key = (ax.scatter([], [], facecolors="none", edgecolors="grey", marker="o", s=70, lw=1.3),
               ax.scatter([], [], color="grey", marker="x", s=28, lw=1.3))
        extra = [(key, "hollow, crossed: diverged (ended at chance, or a non-finite loss)")]
    ax.set_xscale("log")
    ax.set_xlabel(f"price of the training time ($, {price:g} per worker-hour)")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("Price vs accuracy (outlined: 1 worker)", fontsize=9)
    ax.grid(alpha=0.3)
    _legend_above(fig, axes, fontsize=6.5, extra=extra)
    return _save(fig, out, "fig16_price_accuracy.png")


def _plot_speedup_ratio(runs: list[dict[str, Any]], out: Path) -> str | None:
    sp = [s for s in _speedups(runs) if s["ratio"]]
    if not sp:
        return None
    labels = _order((s["run"]["label"], s["run"]["bits"]) for s in sp)
    colors = _colors(labels)
    fig, axes = _figure(1, width=7.5, height=4.6)
    ax = axes[0]
    agg: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for s in sp:
        agg[(s["run"]["label"], _title(s["run"]))].append(s)
    for (lab, _), ss in agg.items():
        ax.scatter([ss[0]["ratio"]], [_mean_std([s["speedup"] for s in ss])[0]], color=colors[lab], s=26)
    for lab in labels:
        ax.scatter([], [], color=colors[lab], label=f"ours: {lab}")
    ratios = [s["ratio"] for s in sp]
    lo, hi = min(ratios), max(ratios)
    try:

        xs = [10 ** (math.log10(min(lo, 0.01)) + i * (math.log10(max(hi, 100)) - math.log10(min(lo, 0.01))) / 80)
              for i in range(81)]
        for bits, ls in ((8, "-"), (4, "--")):
            curve = projection_curve(xs, bits=bits)
            ax.plot([c[0] for c in curve], [c[1] for c in curve], color="k", ls=ls, lw=1.2,
                    label=f"seed's projection, {bits}-bit (AlexNet, 8 K80s, NCCL)")
        ax.axhline(speedup_bound(8), color="grey", lw=0.8, ls=":", label="bound 32/8 = 4x")
    except Exception:  # noqa: BLE001 - the projection is optional
        pass
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("communication / computation (MB of fp32 gradients per GFLOP, per worker-step)")
    ax.set_ylabel("speedup over fp32 (same workers)")
    ax.set_title("Speedup vs communication/computation ratio", fontsize=9)
    ax.grid(alpha=0.3)
    _legend_above(fig, axes)
    return _save(fig, out, "fig16_speedup_ratio.png")


def _plot_time_to_accuracy(runs: list[dict[str, Any]], out: Path) -> str | None:
    """Validation loss (or accuracy) against training seconds: one panel per setting, every configuration
    (one line per seed), the target dashed, each run's arrival at it marked ●, a run that never reached it
    ending in ×."""
    rs = tta_runs(runs)
    if not rs:
        return None
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rs:
        groups[tta_setting(r)].append(r)
    panels = sorted(groups.values(), key=lambda g: setting_title(g[0]))
    labels = _order((r["label"], r["bits"]) for r in rs)
    colors = _colors(labels)
    fig, axes = _figure(len(panels), width=6.0, height=4.2, max_cols=2)
    for ax, group in zip(axes, panels):
        metric = tta_metric(group)
        field, scale = ("val_acc", 100.0) if metric == "accuracy" else ("val_loss", 1.0)
        seen: set[str] = set()
        for r in sorted(group, key=lambda r: labels.index(r["label"])):
            pts = [(p["train_s"], p[field] * scale) for p in r["curve"]
                   if isinstance(p.get("train_s"), (int, float)) and isinstance(p.get(field), (int, float))]
            if not pts:
                continue
            s, color = r["summary"], colors[r["label"]]
            ax.plot([x for x, _ in pts], [y for _, y in pts], color=color, lw=1.3 if r["label"] in seen else 1.6,
                    marker="o", ms=2, label=None if r["label"] in seen else r["label"])
            seen.add(r["label"])
            hit = s.get("time_to_target_s")
            if s.get("reached_target") and isinstance(hit, (int, float)):
                y = next((v for x, v in pts if x == hit), pts[-1][1])
                ax.plot([hit], [y], marker="o", ms=7, mfc=color, mec="k", ls="none", zorder=5)
            elif s.get("reached_target") is False:
                ax.plot([pts[-1][0]], [pts[-1][1]], marker="X", ms=8, color=color, mec="k", ls="none", zorder=5,
                        gid=f"not reached: {r['label']}")
        targets = sorted({round(float(t) * scale, 6) for r in group
                          for t in [r["summary"].get("target_accuracy" if metric == "accuracy" else "target_loss")]
                          if isinstance(t, (int, float))})
        for t in targets:
            ax.axhline(t, color="k", ls="--", lw=0.9, alpha=0.7)
        if targets:
            ax.text(0.99, 0.99, f"target{'s' if len(targets) > 1 else ''} (dashed): "
                    + ", ".join(f"{t:.4g}" for t in targets), transform=ax.transAxes, ha="right", va="top",
                    fontsize=7)
        finals = [y for r in group for p in r["curve"][-1:] for y in [p.get(field)] if isinstance(y, (int, float))]
        if metric == "loss" and finals:  # the start of training is far above: zoom on where the target is
            lo, hi = min(finals + targets), max(finals + targets)
            pad = max(0.05 * hi, (hi - lo))
            ax.set_ylim(lo - 0.3 * pad, hi + 2.5 * pad)
        ax.set_title(setting_title(group[0]), fontsize=8.5)
        ax.set_xlabel("training seconds (validation excluded)")
        ax.set_ylabel("validation accuracy (%)" if metric == "accuracy" else "validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="upper right" if metric == "loss" else "lower right", bbox_to_anchor=(1, 0.93))
    return _save(fig, out, "tta_validation_vs_time.png")
