"""``lowbit report``: study results -> one HTML page with PNG plots beside it, in the seed's style.

Sections (seed figure in brackets):

1. Which codecs match fp32 within 0.5 accuracy points, per network and data set (mean +- std over
   seeds of the paired difference codec - fp32 at the same seed) [Sec. 5.1].
2. Test accuracy and training loss per epoch [Figure 5].
3. Time per epoch split into exposed communication and computation, per precision, and the thread
   time of encoding / communicating / decoding [Figures 6-9].
4. Scalability: samples/s relative to one worker at 32 bits, against the number of workers [12-15].
5. Samples/s tables with the seed's numbers beside ours where the network, precision and number of
   workers match [Figures 10-11] — on CPU they mostly won't, and the hardware never does.
6. Price vs accuracy [Figure 16 left] and speedup over fp32 against the communication/computation
   ratio with the seed's projection curve [Figure 16 right].

Time-to-accuracy runs (a target, a budget: docs/study.md) add a section before these: validation loss (or
accuracy) against training seconds, one panel per setting (network, data, workers, link), and a table of
the time each configuration took to reach the target, with its ratio to PyTorch's fp16 hook and PowerSGD's
(:mod:`lowbit.lab.study.tta`).

Synthetic-data runs appear only in the speed sections, labelled SYNTHETIC everywhere; their accuracy
means nothing and is never reported. Only finished runs are used; epochs of interrupted attempts are
counted and mentioned. Plots are drawn with matplotlib's Agg canvas (no window, no pyplot state).
"""

from __future__ import annotations

import html
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowbit.lab.study import seed_data
from lowbit.lab.study.export import output_folder, write_csv, write_curves_csv
from lowbit.lab.study.store import resolve_results_path
from lowbit.lab.study.tta import references, tta_runs, tta_table


from lowbit.lab.study.analysis import (DEFAULT_PRICE_PER_GPU_HOUR, MATCH_POINTS, VERDICT_SEEDS, _fmt_ms,  # noqa: F401
                                   _groups_across_k, _mean_std, _order, _title, accuracy_matches, diverged, load_runs)
from lowbit.lab.study.figures import (_bar_groups, _figure, _per_label, _plot_accuracy, _plot_breakdown,  # noqa: F401
                                  _plot_phases, _plot_price, _plot_scalability, _plot_speedup_ratio,
                                  _plot_time_to_accuracy, _ranges, _save, _word_ticks)

__all__ = ["write_report", "load_runs", "accuracy_matches", "diverged", "MATCH_POINTS", "DEFAULT_PRICE_PER_GPU_HOUR"]


# ------------------------------------------------------------------------------------ HTML
def _tta_section(runs: list[dict[str, Any]], fig: str | None) -> str:
    rows = tta_table(runs)
    if not rows:
        return ""
    refs = references(tta_runs(runs))
    ref_names = {r["codec"]: r["label"] for r in rows}
    parts = ["<h2>Time to accuracy</h2>",
             "<p class='note'>Validation on a fixed held-out subset against the training clock (each step timed "
             "between device synchronisations; validation time left out). The target (dashed) is the run's "
             "<code>target_loss</code> / <code>target_accuracy</code>, or, with <code>target_from</code>, the final "
             "validation loss of that configuration's run at the same setting and seed. ● where a run first met "
             "it; × a run that never did (it stopped at its budget or at the end of its schedule).</p>",
             _img(fig, "validation against training seconds")]
    header = ["setting", "configuration", "target", "time to target (s)", "strict time (s)", "steps to target",
              "final val", "MB sent per rank"]
    header += [f"× sooner than {ref_names.get(ref, ref)}" for ref in refs] + ["stopped"]
    lines, classes = [], []
    for r in rows:
        never = r["reached"] == 0
        if never:
            ttt = "not reached"
        else:
            ttt = f"{r['time_to_target_s']:.1f}" + (f" ± {r['time_sd']:.1f}" if r["time_sd"] is not None else "")
            if r["reached"] < r["seeds"]:
                ttt += f" ({r['reached']} of {r['seeds']} seeds reached it)"
            elif r["seeds"] > 1:
                ttt += f" (n={r['seeds']})"
        cells = [r["setting"], r["label"] + (" (sets the target)" if r["sets_target"] else ""),
                 "—" if r["target"] is None else f"{r['target']:.4g}", ttt,
                 "not reached" if r["time_to_target_strict_s"] is None else f"{r['time_to_target_strict_s']:.1f}",
                 "—" if r["steps_to_target"] is None else f"{r['steps_to_target']:.0f}",
                 "—" if r["final_val"] is None else f"{r['final_val']:.4g}",
                 "—" if r.get("bytes_sent") is None else f"{r['bytes_sent'] / 1e6:.1f}"]
        for ref in refs:
            ratio, n = r["ratios"].get(ref, (None, 0))
            cells.append("—" if r["codec"] == ref else "not reached" if never else
                         "—" if ratio is None else f"{ratio:.2f}x" + (f" (n={n})" if n > 1 else ""))
        cells.append(", ".join(r["stops"]))
        lines.append(cells)
        fp16 = (r["ratios"].get(refs[0]) or (None, 0))[0] if refs else None
        classes.append("bad" if never else "base" if r["codec"] in refs else "ok" if fp16 and fp16 >= 1 else "")
    parts.append(_table(header, lines, left=2, classes=classes))
    parts.append("<p class='note'>The target rule: a target taken from a baseline's run (<code>target_from</code>) is "
                 "its final validation loss plus 1 % (relative); the strict time, beside it, is to the baseline's final "
                 "loss itself. Time to target: training seconds until the first validation that met the target "
                 "(mean over the seeds that reached it; validations are every <code>eval_every</code> steps or "
                 "<code>eval_every_s</code> seconds, so this is the first validation at or after the moment, not the "
                 "moment itself). × sooner: the reference's time to target over this configuration's, at the same "
                 "setting and seed, then averaged over seeds (above 1: this configuration is faster); only seeds where "
                 "both reached the target count. <b>not reached</b>: the run stopped (budget, end of its learning-rate "
                 "schedule, epochs) above the target. The runs are in <a href='runs.csv'>runs.csv</a> "
                 "(<code>time_to_target_s</code>, <code>steps_to_target</code>, <code>reached_target</code>, "
                 "<code>tta_x_vs_…</code>) and their curves in <a href='curves.csv'>curves.csv</a>.</p>")
    return "\n".join(parts)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em auto;max-width:1300px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ccc}h3{font-size:1.0em}
table{border-collapse:collapse;margin:.6em 0;font-size:.85em}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.ok{background:#e8f5e9}.bad{background:#ffebee}.base{background:#e0f7fa}
tr.first td{border-top:2px solid #999}.note{color:#555;font-size:.9em}img{max-width:100%;border:1px solid #eee;margin:.4em 0}code{background:#f5f5f5;padding:0 3px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1,
           classes: Sequence[str] | None = None) -> str:
    out = ["<table><tr>" + "".join(f"<th class='{'l' if i < left else ''}'>{_e(h)}</th>" for i, h in enumerate(header)) + "</tr>"]
    for j, row in enumerate(rows):
        cls = f" class='{classes[j]}'" if classes and classes[j] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td class='{'l' if i < left else ''}'>{_e(c)}</td>" for i, c in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _img(name: str | None, alt: str) -> str:
    return f"<img src='{_e(name)}' alt='{_e(alt)}'>" if name else f"<p class='note'>(no data for: {_e(alt)})</p>"


def _match_section(runs: list[dict[str, Any]]) -> str:
    rows = accuracy_matches(runs)
    if not rows:
        return "<p class='note'>No multi-worker runs on real data: nothing to compare with fp32.</p>"
    parts = []
    # Matrix: codec x (network / data set / K)
    cols = sorted({(r["network"], r["dataset"], r["world_size"]) for r in rows})
    labels = _order((r["label"], r["bits"]) for r in rows)
    cell: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        cell[(r["label"], r["network"], r["dataset"], r["world_size"])] = r
    header = ["codec"] + [f"{n} / {d} / K={k}" for n, d, k in cols]
    mrows = []
    for lab in labels:
        line = [lab]
        for n, d, k in cols:
            r = cell.get((lab, n, d, k))
            if r is None:
                line.append("")
            elif r["verdict"] == "baseline":
                line.append(f"fp32 {r['acc_mean'] * 100:.2f}%" + (f" ± {r['acc_std'] * 100:.2f}" if r["n"] > 1 else ""))
            elif r["verdict"] in ("no fp32 run", "fp32 did not learn"):
                line.append(r["verdict"])
            elif r["verdict"] == "diverged":  # not a difference to weigh: it learned nothing
                line.append(f"✗ diverged ({r['acc_mean'] * 100:.1f}%)")
            else:
                sd = f" ± {r['diff_std'] * 100:.2f}" if r["n_pairs"] > 1 else ""
                if r["n_pairs"] < VERDICT_SEEDS:  # the difference alone: too few seeds to judge
                    seeds = f" ({r['n_pairs']} seed{'s' if r['n_pairs'] > 1 else ''}, no verdict)"
                    line.append(f"{r['diff_mean'] * 100:+.2f}{sd}{seeds}")
                    continue
                mark = "✓" if r["verdict"] == "matches" else "✗"
                line.append(f"{mark} {r['diff_mean'] * 100:+.2f}{sd}" + (" (noisy)" if r["noisy"] else ""))
        mrows.append(line)
    parts.append(_table(header, mrows))
    nseeds = max(r["n"] for r in rows)
    few = any(r["verdict"] in ("matches", "does not match") and r["n_pairs"] < VERDICT_SEEDS for r in rows)
    parts.append(
        f"<p class='note'>✓: the mean over seeds of (codec − fp32 at the same seed) in final test accuracy is at "
        f"least −{MATCH_POINTS} points; ✗: it is lower. Numbers are that mean ± its standard deviation over seeds, in "
        f"points. (noisy): −{MATCH_POINTS} lies within one standard deviation of the mean, so the verdict could flip "
        f"with other seeds. No verdict where fp32 itself did not learn (below twice chance accuracy, or less than 10 "
        f"points above it), nor with fewer than {VERDICT_SEEDS} seeds paired with fp32: one seed's difference has "
        f"no spread to judge it by (only the difference is shown). ✗ diverged (final accuracy): a seed's training "
        f"loss went non-finite, or it ended at chance (final training loss at least 0.95 × ln(classes), the "
        f"uniform guess's, and test accuracy below twice chance), whatever the number of seeds. "
        f"Up to {nseeds} seed(s) per cell."
        + (f" <b>Too few seeds for a verdict here</b>: run {VERDICT_SEEDS} or more (<code>seeds = [0, 1, 2]</code>, "
           "as the <code>seeds</code> preset does)." if few else "")
        + "</p>")
    # Detail table
    drows, classes = [], []
    for r in rows:
        judged = r["verdict"] in ("matches", "does not match")
        verdict = (f"no verdict ({r['n_pairs']} of {VERDICT_SEEDS} seeds)"
                   if judged and r["n_pairs"] < VERDICT_SEEDS else r["verdict"])
        drows.append([r["setting"], r["label"], f"{r['bits']:.2f}", _fmt_ms(r["acc_mean"], r["acc_std"], r["n"]),
                      "" if r["verdict"] == "baseline" else _fmt_ms(r["diff_mean"], r["diff_std"], r["n_pairs"]),
                      verdict])
        classes.append("base" if r["verdict"] == "baseline" else "" if verdict.startswith("no verdict (")
                       else "ok" if verdict == "matches" else "bad")
    parts.append("<details><summary>Per setting (accuracy in %, difference in points)</summary>"
                 + _table(["setting", "codec", "bits/value", "final test accuracy", "vs fp32 (paired)", "verdict"],
                          drows, left=2, classes=classes) + "</details>")
    return "\n".join(parts)


def _sps_tables(runs: list[dict[str, Any]]) -> str:
    groups = _groups_across_k(runs)
    if not groups:
        return ""
    parts = []
    any_seed = False
    for rs in sorted(groups.values(), key=lambda rs: _title(rs[0], with_k=False)):
        ks = sorted({r["world_size"] for r in rs})
        labels = _order((r["label"], r["bits"]) for r in rs)
        rows = []
        for lab in labels:
            group = [r for r in rs if r["label"] == lab]
            spec = group[0]["codec"]
            seed_label, bucket = seed_data.seed_precision(spec)
            line: list[Any] = [lab, seed_label or "—", bucket or "—"]
            for k in ks:
                here = [r for r in group if r["world_size"] == k]
                m, s, n = _mean_std([r["summary"].get("samples_per_s") for r in here])
                ours = "" if n == 0 else (f"{m:,.0f}" + (f" ± {s:,.0f}" if n > 1 else ""))
                seed_v, _fig = seed_data.seed_samples_per_s(rs[0]["network"], spec, k, rs[0]["backend"])
                if seed_v is not None:
                    any_seed = True
                    ours = f"{ours or '—'}  [seed {seed_v:,.1f}]"
                line.append(ours)
            rows.append(line)
        fig = "Figure 11 (NCCL)" if rs[0]["backend"] == "nccl" else "Figure 10 (MPI)"
        parts.append(f"<h3>{_e(_title(rs[0], with_k=False))}</h3>")
        parts.append(_table(["precision", "seed's name", "bucket"] + [f"{k} worker{'s' if k > 1 else ''}" for k in ks],
                            rows, left=3))
        if rs[0]["network"] in seed_data.FIG10_MPI:
            parts.append(f"<p class='note'>[seed …]: the seed's samples/s for {_e(rs[0]['network'])} in its {fig}, "
                         f"on {_e(seed_data.SEED_MACHINE)} with real ImageNet/CIFAR-10 data and its Figure 4 batches. "
                         "Only the network, precision and number of workers match; the hardware and data do not, so "
                         "compare shapes (how samples/s changes with bits and workers), not values.</p>")
    if not any_seed:
        parts.append("<p class='note'>No seed numbers appear: the seed's Figures 10-11 cover AlexNet, VGG19, "
                     "ResNet-50/110/152 and BN-Inception on K80 GPUs; none of these settings was run here.</p>")
    return "\n".join(parts)


def _volume_table(runs: list[dict[str, Any]]) -> str:
    rows = []
    for rs in _bar_groups(runs):
        base = _mean_std([r["summary"].get("bytes_per_step_per_rank") for r in rs if r["codec"] == "fp32"])[0]
        labels, v = _per_label(rs, ("bytes_per_step_per_rank", "epoch_train_s", "epoch_exposed_comm_s",
                                    "epoch_encode_s", "epoch_comm_s", "epoch_decode_s", "compressed_fraction"))
        for i, lab in enumerate(labels):
            x = v[lab]
            ratio = (base / x["bytes_per_step_per_rank"]) if base and x["bytes_per_step_per_rank"] else math.nan
            # the setting once, on its first row: repeated on every row it wrapped into a column of its own
            rows.append([_title(rs[0]) if i == 0 else "", lab, f"{x['bytes_per_step_per_rank'] / 1e3:,.1f}",
                         "—" if ratio != ratio else f"{ratio:.1f}x", f"{x['compressed_fraction'] * 100:.1f}%",
                         f"{x['epoch_train_s']:.2f}", f"{x['epoch_exposed_comm_s']:.2f}", f"{x['epoch_encode_s']:.2f}",
                         f"{x['epoch_comm_s']:.2f}", f"{x['epoch_decode_s']:.2f}"])
    if not rows:
        return ""
    return _table(["setting", "precision", "kB sent/step/rank", "less than fp32", "params compressed",
                   "s/epoch", "exposed comm", "encode", "communicate", "decode"], rows, left=2,
                  classes=["first" if row[0] else "" for row in rows])


def _env_section(runs: list[dict[str, Any]], notes: dict[str, Any]) -> str:
    envs = defaultdict(set)
    for r in runs:
        for k in ("cpu", "device_name", "cpu_count", "torch", "lowbit", "launcher", "torch_threads"):
            if k in r["env"]:
                envs[k].add(str(r["env"][k]))
    loads = [r["env"].get("loadavg_at_start") for r in runs if r["env"].get("loadavg_at_start")]
    rows = [[k, ", ".join(sorted(v))] for k, v in sorted(envs.items())]
    if loads:
        one = [l[0] for l in loads]
        rows.append(["1-min load average at run start", f"{min(one):.1f} … {max(one):.1f}"])
    studies = sorted({r["study"] for r in runs if r["study"]})
    rows.append(["studies", ", ".join(studies) or "—"])
    rows.append(["finished runs", str(len(runs))])
    rows.append(["interrupted attempts (epoch rows kept, not used)", f"{notes['incomplete_attempts']} ({notes['incomplete_epochs']} epochs)"])
    if notes["skipped_lines"]:
        rows.append(["unreadable lines skipped", str(notes["skipped_lines"])])
    return _table(["", ""], rows, left=2)


def write_report(
    results: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR,
    *,
    strict: bool = False,
) -> Path:
    """Write ``index.html``, its PNGs and the tables ``runs.csv`` / ``epochs.csv`` into ``out`` (default:
    ``report/`` beside the results file).

    Returns the HTML file's path. Raises ``ValueError`` when there are no finished runs, when ``out`` is
    not a folder, or (``strict``) when the results hold lines that are not readable rows.
    """
    path = resolve_results_path(results)
    outdir = output_folder(out if out is not None else path.parent / "report", "report folder (--out)")
    runs, notes = load_runs(path, strict=strict)
    if not runs:
        raise ValueError(f"no finished runs in {path}")
    if price_per_gpu_hour <= 0:
        raise ValueError(f"--price-per-gpu-hour must be > 0, got {price_per_gpu_hour}")
    outdir.mkdir(parents=True, exist_ok=True)
    for old in [*outdir.glob("fig*.png"), *outdir.glob("tta*.png")]:
        old.unlink()

    write_csv(runs, outdir)  # runs.csv, epochs.csv: the same runs as tables
    write_curves_csv(runs, outdir)  # curves.csv: time-to-accuracy runs' validation points (when there are any)

    figs = {
        "acc": _plot_accuracy(runs, outdir, "test_acc", "test accuracy (%)", "fig5_accuracy.png"),
        "loss": _plot_accuracy(runs, outdir, "train_loss", "training loss", "fig5_train_loss.png"),
        "bars": _plot_breakdown(runs, outdir),
        "phases": _plot_phases(runs, outdir),
        "scal": _plot_scalability(runs, outdir),
        "price": _plot_price(runs, outdir, price_per_gpu_hour),
        "ratio": _plot_speedup_ratio(runs, outdir),
        "tta": _plot_time_to_accuracy(runs, outdir),
    }
    synthetic = any(r["synthetic"] for r in runs)
    on_cpu = all(r.get("device") != "cuda" for r in runs)
    h: list[str] = [
        "<!doctype html><html><head><meta charset='utf-8'><title>lowbit study report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>lowbit study: low-precision gradient communication</h1>",
        f"<p>{len(runs)} finished runs from <code>{_e(path)}</code>. In the style of Grubic et al., "
        "<i>Synchronous Multi-GPU Deep Learning with Low-Precision Communication: An Experimental Study</i> "
        "(EDBT 2018); figure numbers refer to that paper. The same runs as tables: "
        "<a href='runs.csv'>runs.csv</a> (one row per run), <a href='epochs.csv'>epochs.csv</a> (one per epoch).</p>",
    ]
    if on_cpu:
        h.append("<p class='note'>All runs are on CPU: each worker is a process with its own thread(s), the "
                 "workers exchange gradients through gloo over the loopback interface, and encoding and decoding run "
                 "on the same cores as training. With few cores (and other load on the machine) more workers can "
                 "well be slower than one, and the latency of a collective can outweigh the compute of a small "
                 "network: read the speed sections as a measurement of this machine, not of the seed's GPUs.</p>")
    if any(r.get("simulated") for r in runs):
        h.append("<p class='note'><b>NCCL simulated</b>: runs with algorithm <code>simulated</code> time a native "
                 "fp32 allreduce of a buffer cut to the codec's wire size (Grubic et al.'s simulation of "
                 "low-precision NCCL, Figures 7, 9 and 11) and leave the gradients unreduced: they measure speed "
                 "only and are left out of every accuracy table and plot.</p>")
    if synthetic:
        h.append("<p class='note'><b>SYNTHETIC</b>: some runs train on random inputs (labelled SYNTHETIC); they "
                 "measure speed only and are left out of every accuracy table and plot.</p>")
    h += [_tta_section(runs, figs["tta"]),
          "<h2>1. Which codecs match fp32 within 0.5 points (Sec. 5.1)</h2>", _match_section(runs),
          "<h2>2. Accuracy per epoch (Figure 5)</h2>",
          "<p class='note'>Test accuracy after each epoch, mean over seeds (band: ± one standard deviation). "
          "Cyan = 32bit, as in the seed. The accuracy axes are zoomed on the final accuracies: an epoch whose "
          "mean lies below (above) the axis is drawn as ▼ on the bottom (▲ on the top) edge, and a line under "
          "the panel names that curve, those epochs and its lowest (highest) value there (one line for the "
          "curves that left at the same epochs). A run that diverged (non-finite loss, or ended at chance: see "
          "section 1) is dotted, labelled (diverged) and left out of the axis limits. One legend, above the "
          "panels, for all of them.</p>",
          _img(figs["acc"], "accuracy per epoch"), _img(figs["loss"], "training loss per epoch"),
          "<h2>3. Where an epoch's time goes (Figures 6-9)</h2>",
          "<p class='note'>Bottom: <b>exposed communication</b> — time the training thread spends after the last "
          "gradient is computed (last bucket's encode, waiting for collectives and decodes, copying back). Top: "
          "<b>computation</b> — the rest of the step (forward, backward, optimizer, and any encoding/decoding that "
          "overlapped the backward pass), as the seed's bars include compression in computation. Seconds per "
          "epoch, mean over the timed epochs (all but the first, which pays warm-up) and over seeds.</p>",
          _img(figs["bars"], "time breakdown"),
          "<p class='note'>Thread time of each phase from lowbit's CommStats (encode on the training thread and, "
          "for scatter_gather's server re-encode, the communication thread; communicate and decode on the "
          "communication thread). These overlap the backward pass, so they can exceed the exposed part.</p>",
          _img(figs["phases"], "encode / communicate / decode"),
          _volume_table(runs),
          "<h2>4. Scalability (Figures 12-15)</h2>",
          "<p class='note'>Samples/s divided by the samples/s of one worker at 32 bits (same network, data, batch "
          "per worker). The seed defines scalability the same way.</p>",
          _img(figs["scal"], "scalability"),
          "<h2>5. Samples per second (Figures 10-11)</h2>",
          "<p class='note'>Global samples per second over the timed epochs, mean ± std over seeds.</p>",
          _sps_tables(runs),
          "<h2>6. Price and the communication/computation ratio (Figure 16)</h2>",
          f"<p class='note'>Left: price of the training time (workers × seconds of training × "
          f"${price_per_gpu_hour:g} per worker-hour; the seed's p2.xlarge K80 is $0.9/GPU-hour) against final "
          "test accuracy, real data only, mean over seeds. A hollow, crossed point is runs that diverged (see "
          "section 1), never averaged with seeds that learned.</p>",
          _img(figs["price"], "price vs accuracy"),
          "<p class='note'>Right: speedup of each codec over fp32 at the same number of workers against MB of fp32 "
          "gradients per GFLOP of forward+backward per worker-step (FLOPs counted by torch's FlopCounterMode). "
          "The curves are the seed's projection for 8-bit (and 4-bit) on its AlexNet/8×K80/NCCL setting "
          "(lowbit.lab.perfmodel.projection), calibrated on the seed's throughputs: they describe that machine, "
          "not this one.</p>",
          _img(figs["ratio"], "speedup vs ratio"),
          "<h2>Environment</h2>", _env_section(runs, notes),
          "<p class='note'>How each number is measured: docs/study.md and lowbit/lab/study/metrics.py.</p>",
          "</body></html>"]
    index = outdir / "index.html"
    index.write_text("\n".join(h), encoding="utf-8")
    return index
