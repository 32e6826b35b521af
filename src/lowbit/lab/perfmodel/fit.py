"""The model applied to recorded study runs (:func:`model_step`), the per-step overhead it leaves
(:func:`fit_overhead`), and :func:`calibrate`, which needs both (:mod:`lowbit.lab.perfmodel.calibrate` fits the
parts; :mod:`lowbit.lab.perfmodel.validate` predicts held-out runs with these)."""

from __future__ import annotations

import datetime
import functools
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from lowbit.timeline import DDP_FIRST_BUCKET_BYTES
from lowbit.lab.perfmodel.calibrate import Calibration, Run, fit_bench, fit_comm_in_situ, fit_study, run_layers
from lowbit.lab.perfmodel.collectives import Topology
from lowbit.lab.perfmodel.links import Link
from lowbit.lab.perfmodel.model import Breakdown, Layer, LayerCodec, bits_per_value, short_codec, simulate_step

__all__ = ["model_step", "fit_overhead", "calibrate"]


def _compute_for(run: Run, cal: Calibration) -> tuple[float | None, str]:
    one = cal.compute.get(run.compute_key)
    if run.world == 1:
        return (one["step_s"], "1-worker fp32 runs") if one else (
            None, "no other 1-worker fp32 run of this network/data/batch to take its compute from")
    at_k = cal.compute_at_world.get(run.setting_key)
    if at_k:
        return at_k["step_s"], f"measured at K={run.world} (other configs)"
    if one:
        f = cal.world_factor.get(run.scale_key)
        if f:
            return one["step_s"] * f["factor"], f"1 worker x {f['factor']:.2f} (factor of other settings)"
        return one["step_s"], "1 worker (no factor for this K: none applied)"
    return None, "no compute measured for this network/data/batch"


_bits = functools.lru_cache(maxsize=256)(bits_per_value)  # a spec's bits per value, parsed once


def model_step(run: Run, cal: Calibration) -> tuple[float, Breakdown, str, str] | str:
    """The modelled step of ``run`` without the overhead term: ``(step_s, breakdown, compute source,
    communication source)``, or a string saying why it cannot be predicted. Layers as
    :func:`lowbit.lab.perfmodel.calibrate.run_layers` builds them, DDP's buckets (1 MiB first, then 25 MiB)."""
    compute, compute_src = _compute_for(run, cal)
    if compute is None:
        return compute_src
    if run.world == 1 or run.params <= 0:  # nothing to exchange: the step is its compute
        step, br, _, _ = simulate_step([Layer("net", 1, compute)], Topology(1, 1, Link(0.0, 1e15)),
                                       algorithm="allreduce", bits=32.0)
        return step, br, compute_src, "-"
    notes: set[str] = set()
    sources: set[str] = set()
    nodes = max(1, run.nodes)
    intra_Bps = run.intra_Bps if run.world // nodes > 1 else run.inter_Bps  # (one rank a node: no intra link)
    if nodes > 1 and not (intra_Bps > 0 and run.inter_Bps > 0):
        return f"a run as {nodes} emulated nodes without the links it measured (env.links)"
    comp = run.compressed_params if run.codec_name != "fp32" else 0
    specs = [(run.codec, run.algorithm)] if comp > 0 else []
    if comp < run.params:
        specs.append(("fp32", "allreduce"))
    lcs: dict[str, LayerCodec] = {}
    for spec, algo in specs:
        link = None
        if nodes > 1:  # as emulated nodes: the links the run's group measured (the one-node fit's latency)
            sources.add(f"measured links (intra {intra_Bps / 1e9:.3g} GB/s, inter {run.inter_Bps / 1e9:.3g} GB/s)")
        else:
            fit, note = cal.link_for(run.backend, algo)
            if fit is None:
                return f"no link calibrated for backend {run.backend!r}"
            if note:
                notes.add(note)
            sources.add(fit.source.split(":", 1)[0].split(",", 1)[0])
            link = fit.link()
        terms: dict[str, Any] = {}
        if spec != "fp32":
            cost, cnote = cal.codec_for(run.backend, algo, spec)
            if cost is None:
                notes.add(f"no cost for {short_codec(spec)}: free")
            else:
                if cnote:
                    notes.add(f"{short_codec(spec)}: {cnote}")
                terms = cost.terms()
        lcs[spec] = LayerCodec(_bits(spec), algo, link=link, **terms)
    layers, layer_specs = run_layers(run, compute)
    codecs = [lcs[spec] for spec in layer_specs]
    if nodes > 1:
        fit, _ = cal.link_for(run.backend, "allreduce")
        alpha = fit.latency_s if fit is not None else 0.0
        topo = Topology(run.world, run.world // nodes, Link(alpha, intra_Bps), Link(alpha, run.inter_Bps))
    else:
        topo = Topology(run.world, run.world, next(iter(lcs.values())).link or Link(0.0, 1e15))
    step, br, _, _ = simulate_step(layers, topo, algorithm="allreduce", bits=32.0, layer_codecs=codecs,
                                   first_bucket_bytes=DDP_FIRST_BUCKET_BYTES)  # DDP's buckets: 1 MiB, then 25 MiB
    comm_src = "; ".join(sorted(sources))
    if notes:
        comm_src += " (" + "; ".join(sorted(notes)) + ")"
    return step, br, compute_src, comm_src


def fit_overhead(runs: Sequence[Run], cal: Calibration) -> dict[str, dict[str, Any]]:
    """Per backend / device / K, for native and compressed codecs apart and together: the median of
    (measured - modelled step) over the multi-worker ``runs``."""
    res: dict[str, list[float]] = {}
    for r in runs:
        if r.world <= 1:
            continue
        m = model_step(r, cal)
        if not isinstance(m, str):
            res.setdefault(r.scale_key, []).append(r.step_s - m[0])
            res.setdefault(r.overhead_key, []).append(r.step_s - m[0])
    return {k: {"seconds": statistics.median(v), "runs": len(v)} for k, v in res.items()}


def calibrate(benches: Sequence[dict[str, Any]] = (),
              results: Mapping[str, Sequence[Run]] | Sequence[Run] = (), *,
              in_situ_comm: bool | None = None) -> Calibration:
    """A :class:`Calibration` from bench files and study runs (docs/perfmodel.md).

    ``benches``: ``lowbit bench allreduce --json`` files as :func:`lowbit.lab.cli.bench.load_bench` reads them;
    ``results``: the study runs (:func:`lowbit.lab.study.store.load_run_records` reads them from a results
    file), or ``{results path: its runs}`` so that the calibration records where they came from.
    ``in_situ_comm`` (default: only when no bench file is given) also fits links and codec costs from
    the study runs; bench fits take precedence where both exist.
    """
    by_source = dict(results) if isinstance(results, Mapping) else ({"(runs given)": list(results)} if results else {})
    for source, rs in by_source.items():
        paths = [rs] if isinstance(rs, (str, os.PathLike)) else [r for r in rs if isinstance(r, (str, os.PathLike))]
        if paths:
            raise ValueError(f"calibrate: study results are given as runs (lowbit.lab.study.store.load_run_records(path)), "
                             f"not as paths; got {paths[0]!r} for {source!r}")
    if not benches and not by_source:
        raise ValueError("nothing to calibrate from: give a bench JSON and/or study results")
    cal = Calibration(sources={"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "bench": [], "results": []})
    for bench in benches:
        transport, links, codecs = fit_bench(bench)
        for a, f in links.items():
            cal.links.setdefault(transport, {})[a] = f
        for a, by in codecs.items():
            cal.codecs.setdefault(transport, {}).setdefault(a, {}).update(by)
        m = bench["meta"]
        cal.sources["bench"].append({k: m.get(k) for k in (
            "path", "backend", "world_size", "device_name", "hostname", "timestamp", "kernel_backend",
            "loadavg_1_5_15_before", "loadavg_1_5_15_after", "nccl_env", "label")})
    runs: list[Run] = []
    for source, rs in by_source.items():
        runs += rs
        cal.sources["results"].append({"path": source, "runs": len(rs)})
    if runs:
        study = fit_study(runs)
        if in_situ_comm if in_situ_comm is not None else not benches:
            study = study.merged(fit_comm_in_situ(runs))
        cal = cal.merged(study)
        cal.step_overhead_s.update(fit_overhead(runs, cal))
    return cal
