"""Calibrate the speed model from measurements: links, codec costs and compute (docs/perfmodel.md, section 5).

* **Links** per transport and algorithm, from ``lowbit bench allreduce --json`` rows, each algorithm under its
  own cost formula (:func:`fit_link`): its *effective* link (on gloo an all_to_all is not an allreduce).
* **Codec costs** per codec and algorithm: ``t_encode = c0 + c1 * 4 * values encoded`` per call
  (:func:`lowbit.lab.perfmodel.model.codec_work`), likewise decoding: a fixed cost per call and a throughput.
* **Compute** from study runs: at one worker, at K workers, and the factor between them.

Without a bench file, links and codec costs are fitted *in situ* from the study's own communicate / encode /
decode times (:func:`fit_comm_in_situ`). Fits are least squares with non-negative coefficients. A
:class:`Calibration` holds the result and where it came from (so validation can tell whether it would be
predicting its own training data), and saves to / loads from JSON.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lowbit.timeline import DDP_FIRST_BUCKET_BYTES
from lowbit.lab.perfmodel.collectives import Topology, collective
from lowbit.lab.perfmodel.links import Link
from lowbit.lab.perfmodel.model import Layer, bits_per_value, codec_fact, codec_work, step_collectives
from lowbit.lab.perfmodel.networks import get_network

__all__ = ["fit_link", "design_row", "LinkFit", "CodecFit", "Run", "Calibration", "fit_bench", "fit_study",
           "fit_comm_in_situ", "run_groups", "run_layers", "network_profile", "pure_compute_s"]

_UNIT = Link(latency_s=1.0, bandwidth_Bps=1.0, name="unit")
SCHEMA = 1
HUGE_BW = 1e15  # bytes/s standing for "no measurable per-byte cost" (JSON has no infinity)
#: The tables of a :class:`Calibration` fitted on study runs, key -> entry (besides the links and codec costs).
STUDY_TABLES = ("compute", "compute_at_world", "world_factor", "step_overhead_s")
#: A finished study run as the study records it (:class:`lowbit.lab.study.records.RunRecord`: its times per step and
#: its keys into a calibration's tables): the speed model reads its fields; the study sits above this layer.
Run = Any


# ------------------------------------------------------------------------------------------ link fit
def design_row(size_bytes: float, world: int | None = None, algorithm: str = "allreduce") -> tuple[float, float]:
    """Coefficients ``(a, b)`` of ``t = a * alpha + b * beta`` for one measurement."""
    if world is None:
        return 1.0, float(size_bytes)
    topo = Topology(world, world, _UNIT)
    cost = collective(algorithm, float(size_bytes), topo)
    # With alpha = beta = 1 the cost is steps + bytes; steps is known, so bytes = time - steps.
    return float(cost.steps), cost.time_s - cost.steps


def fit_link(sizes_bytes: Sequence[float], times_s: Sequence[float], *, world: int | None = None,
             algorithm: str = "allreduce", name: str = "fitted") -> Link:
    """Least-squares ``Link`` from measured ``(size, time)`` pairs (see module doc)."""
    sizes = np.asarray(sizes_bytes, dtype=np.float64)
    times = np.asarray(times_s, dtype=np.float64)
    if sizes.shape != times.shape or sizes.ndim != 1:
        raise ValueError(f"sizes and times must be 1-D and of equal length, got {sizes.shape} and {times.shape}")
    if len(np.unique(sizes)) < 2:
        raise ValueError("need timings at two or more distinct message sizes to fit latency and bandwidth")
    if not (np.all(np.isfinite(sizes)) and np.all(np.isfinite(times)) and np.all(sizes >= 0)):
        raise ValueError("sizes must be finite and >= 0, times finite")
    if world is not None and world < 2:
        raise ValueError(f"a collective fit needs world >= 2, got {world}")
    rows = np.array([design_row(s, world, algorithm) for s in sizes])
    coef, *_ = np.linalg.lstsq(rows, times, rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0:  # constrained refit through zero latency
        b = rows[:, 1]
        alpha, beta = 0.0, float(b @ times / (b @ b))
    if not (beta > 0 and math.isfinite(beta)):
        raise ValueError("timings do not grow with message size; cannot fit a bandwidth")
    return Link(latency_s=alpha, bandwidth_Bps=1.0 / beta, name=name)


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best of all column subsets."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(y @ y)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            coef, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(coef < 0):
                continue
            r = y - sub @ coef
            res = float(r @ r)
            if res < best_res - 1e-30:
                best = np.zeros(n)
                best[list(cols)] = coef
                best_res = res
    return best


def _rms_rel(pred: Sequence[float], meas: Sequence[float]) -> float:
    errs = [(p - m) / m for p, m in zip(pred, meas) if m > 0]
    return math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else math.nan


# ------------------------------------------------------------------------------------------ results
@dataclasses.dataclass(frozen=True)
class LinkFit:
    """A fitted link: the alpha-beta parameters, what they were fitted on, and how well they fit."""

    latency_s: float
    bandwidth_Bps: float
    algorithm: str
    points: int
    rms_rel_error: float
    source: str

    def link(self, name: str = "") -> Link:
        return Link(self.latency_s, self.bandwidth_Bps, name or f"fitted {self.algorithm}")


@dataclasses.dataclass(frozen=True)
class CodecFit:
    """A codec's fitted costs, as :class:`LinkFit` is a link's (what a message of a codec costs on the
    job is :class:`lowbit.choose.CodecCost`): ``t_encode = encode_call_s + encode_s_per_byte * 4 * values
    encoded`` per call; likewise decode."""

    encode_call_s: float
    encode_s_per_byte: float
    decode_call_s: float
    decode_s_per_byte: float
    points: int
    source: str

    @property
    def encode_Bps(self) -> float | None:
        return 1.0 / self.encode_s_per_byte if self.encode_s_per_byte > 0 else None

    @property
    def decode_Bps(self) -> float | None:
        return 1.0 / self.decode_s_per_byte if self.decode_s_per_byte > 0 else None

    def terms(self) -> dict[str, Any]:
        """These costs as :class:`lowbit.lab.perfmodel.model.LayerCodec`'s keyword arguments."""
        return dict(encode_Bps=self.encode_Bps, decode_Bps=self.decode_Bps, encode_call_s=self.encode_call_s,
                    decode_call_s=self.decode_call_s)


def _relative(a: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows scaled by 1/y: least squares on relative errors, so no single slow point dominates the fit."""
    w = 1.0 / np.maximum(y, 1e-12)
    return a * w[:, None], y * w


def _affine_nonneg(x: Sequence[float], y: Sequence[float], calls: Sequence[float] | None = None) -> tuple[float, float]:
    """``y = c0 * calls + c1 * x`` with ``c0, c1 >= 0`` (calls default to 1 per point), least squares
    on relative errors."""
    xs = np.asarray(x, dtype=np.float64)
    ys = np.asarray(y, dtype=np.float64)
    cs = np.ones_like(xs) if calls is None else np.asarray(calls, dtype=np.float64)
    if np.all(ys <= 0):
        return 0.0, 0.0
    if len(np.unique(xs / np.maximum(cs, 1e-30))) < 2:  # one size: no slope to see, all per call
        return float(ys.sum() / cs.sum()), 0.0
    keep = ys > 0
    c0, c1 = _nnls(*_relative(np.stack([cs, xs], axis=1)[keep], ys[keep]))
    return float(c0), float(c1)


def _codec_cost(work: Sequence[tuple[float, float]], encode_s: Sequence[float], decode_s: Sequence[float],
                source: str, calls: Sequence[float] | None = None) -> CodecFit:
    """:class:`CodecFit` fitted to measured encode / decode seconds, one point per ``(values encoded, values
    decoded)`` of ``work`` (``calls`` per point: default 1)."""
    e0, e1 = _affine_nonneg([4 * e for e, _ in work], encode_s, calls)
    d0, d1 = _affine_nonneg([4 * d for _, d in work], decode_s, calls)
    return CodecFit(e0, e1, d0, d1, len(work), source)


# ------------------------------------------------------------------------------------------ bench
def fit_bench(bench: dict[str, Any]) -> tuple[str, dict[str, LinkFit], dict[str, dict[str, CodecFit]]]:
    """``(transport, {algorithm: LinkFit}, {algorithm: {codec spec: CodecFit}})`` from one bench file (as
    :func:`lowbit.lab.cli.bench.load_bench` reads it, with its transport)."""
    meta, rows = bench["meta"], bench["rows"]
    world = int(meta.get("world_size") or 0)
    transport = str(meta.get("transport") or meta.get("backend", "?"))
    where = (f"bench {Path(meta.get('path', '?')).name}: {meta.get('backend')} K={world} on "
             f"{meta.get('device_name', '?')}")
    links: dict[str, LinkFit] = {}
    if world >= 2:
        by_algo: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if r.get("torch"):
                continue  # torch's own allreduce: not one of lowbit's algorithms
            t = float(r["t_comm_s"]) or float(r["time_s"])
            codec = codec_fact(r["codec"], "spec", r["codec"])
            if r["algorithm"] == "allreduce":
                if codec != "fp32":  # the link comes from the native fp32 allreduce rows
                    continue
                payload = 4.0 * r["numel"]
            else:
                payload = bits_per_value(codec, int(r["numel"])) * r["numel"] / 8
            by_algo.setdefault(r["algorithm"], []).append((payload, t))
        for algo, pts in by_algo.items():
            sizes, times = [p for p, _ in pts], [t for _, t in pts]
            try:
                link = fit_link(sizes, times, world=world, algorithm=algo)
            except ValueError:  # one size only, or no bandwidth to see
                continue
            pred = [collective(algo, s, Topology(world, world, link)).time_s for s in sizes]
            what = "native fp32 allreduce rows" if algo == "allreduce" else f"{algo} rows, comm time"
            links[algo] = LinkFit(link.latency_s, link.bandwidth_Bps, algo, len(pts), _rms_rel(pred, times),
                                  f"{where}, {what}")
    codecs: dict[str, dict[str, CodecFit]] = {}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        codec = codec_fact(r["codec"], "spec", r["codec"])
        if codec == "fp32" or r.get("torch"):
            continue  # fp32 is never encoded
        groups.setdefault((r["algorithm"], codec), []).append(r)
    for (algo, codec), rs in groups.items():
        k = max(world, 2)
        codecs.setdefault(algo, {})[codec] = _codec_cost(
            [codec_work(algo, int(r["numel"]), k, k, 16.0) for r in rs], [float(r["t_encode_s"]) for r in rs],
            [float(r["t_decode_s"]) for r in rs], f"{where}, {algo} rows")
    return transport, links, codecs


# ------------------------------------------------------------------------------------------ study runs
@functools.lru_cache(maxsize=64)
def network_profile(network: str, params: int) -> tuple[tuple[float, float], ...]:
    """Per-layer ``(params share, compute share)`` in forward order: the :mod:`networks` profile of the
    same network when its parameter count matches within 5%, else one layer."""
    try:
        net = get_network(network)  # the study's names are the speed model's (lowbit.lab.models')
    except ValueError:
        return ((1.0, 1.0),)
    layers = net.layers()
    p_total = sum(p for _, p, _ in layers)
    f_total = sum(f for _, _, f in layers)
    if not p_total or not f_total or abs(p_total / max(params, 1) - 1) > 0.05:
        return ((1.0, 1.0),)
    return tuple((p / p_total, f / f_total) for _, p, f in layers)


def run_layers(run: Run, compute_s: float = 1.0) -> tuple[list[Layer], list[str]]:
    """The run's network as model layers (:func:`network_profile`, ``compute_s`` spread by FLOPs), and the
    codec spec each travels with: each layer's parameters split into the part the run's codec compresses
    (``compressed_params``) and an fp32 part (biases, small tensors), as ``lowbit.ddp``'s hook sends them."""
    comp_frac = (run.compressed_params if run.codec_name != "fp32" and run.world > 1 else 0) / max(run.params, 1)
    layers: list[Layer] = []
    specs: list[str] = []
    for i, (p_share, f_share) in enumerate(network_profile(run.network, run.params)):
        n = round(max(run.params, 1) * p_share)
        n_comp = round(n * comp_frac)
        if n_comp:
            layers.append(Layer(f"l{i}", n_comp, compute_s * f_share))
            specs.append(run.codec)
        if n - n_comp > 0 or not n_comp:
            layers.append(Layer(f"l{i}.fp32", max(0, n - n_comp), 0.0 if n_comp else compute_s * f_share))
            specs.append("fp32")
    return layers, specs


def run_groups(run: Run) -> list[tuple[str, str, int, int]]:
    """The collectives of one step, as the hook issues them on the run's layers (DDP's buckets: 1 MiB
    first, then 25 MiB; :func:`lowbit.lab.perfmodel.model.step_collectives`): ``[(codec spec, algorithm,
    values, fp32 values riding), ...]``."""
    if run.world <= 1 or run.params <= 0:
        return []
    layers, specs = run_layers(run)
    native = {"fp32"} | ({run.codec} if run.algorithm == "allreduce" else set())
    events, _ = step_collectives(layers, specs, native=native, rider="fp32" if run.algorithm == "allgather" else None,
                                 first_bucket_bytes=DDP_FIRST_BUCKET_BYTES)
    return [(spec, "allreduce" if spec in native else run.algorithm, n, riders) for _, spec, n, riders in events]


def pure_compute_s(run: Run) -> float:
    """The run's compute per step without the encoding done inside the backward pass: the hook encodes a
    message on the training thread once its last gradient is handed over, so with M messages the encoding of
    all but the last lands in the measured compute (the speed model adds encoding separately)."""
    if run.codec_name == "fp32":
        return max(run.compute_s, 0.0)
    m = max(1, sum(1 for spec, _, _, _ in run_groups(run) if spec == run.codec))
    return max(run.compute_s - run.encode_s * (m - 1) / m, 0.0)


# ------------------------------------------------------------------------------------------ calibration
@dataclasses.dataclass
class Calibration:
    """Fitted parameters of the speed model, with their provenance: ``links[transport][algorithm]``,
    ``codecs[transport][algorithm][codec spec]``, and the study tables (:data:`STUDY_TABLES`) keyed by the
    runs' keys: compute at one worker and at K, the factor between them, the per-step overhead.
    ``run_keys`` / ``config_keys``: the study runs the study-derived parts were fitted on."""

    links: dict[str, dict[str, LinkFit]] = dataclasses.field(default_factory=dict)
    codecs: dict[str, dict[str, dict[str, CodecFit]]] = dataclasses.field(default_factory=dict)
    compute: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    compute_at_world: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    world_factor: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    step_overhead_s: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    run_keys: list[str] = dataclasses.field(default_factory=list)
    config_keys: list[str] = dataclasses.field(default_factory=list)
    sources: dict[str, Any] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------------ lookups
    def link_for(self, transport: str, algorithm: str) -> tuple[LinkFit | None, str]:
        """The link for ``algorithm`` on ``transport`` (else its allreduce link; else a transport of the
        same backend), with a note on any substitution."""
        for k in _same_backend(self.links, transport):
            by_algo = self.links.get(k, {})
            for algo in (algorithm, "allreduce"):
                if algo in by_algo:
                    note = "" if (k, algo) == (transport, algorithm) else f"{k} {algo} link"
                    return by_algo[algo], note
        return None, ""

    def codec_for(self, transport: str, algorithm: str, codec: str) -> tuple[CodecFit | None, str]:
        """Costs of ``codec`` under ``algorithm``: exact; else the same codec family; else the same codec
        under another algorithm; else the mean of the transport's codecs under that algorithm (noted)."""
        keys = _same_backend(self.codecs, transport)
        name = codec.split(":", 1)[0]
        for k in keys:
            table = self.codecs.get(k, {}).get(algorithm, {})
            if codec in table:
                return table[codec], ("" if k == transport else f"{k} costs")
            family = [v for s, v in table.items() if s.split(":", 1)[0] == name]
            if family:
                return _mean_cost(family, f"mean of other {name} codecs"), f"{name} family mean"
        for k in keys:  # the same codec measured under another algorithm: its per-byte costs carry over
            for algo, table in sorted(self.codecs.get(k, {}).items()):
                if codec in table:
                    return table[codec], f"costs measured under {algo}"
        for k in keys:
            table = self.codecs.get(k, {}).get(algorithm, {})
            if table:
                return _mean_cost(list(table.values()), "mean of all codecs"), "mean of all codecs"
        return None, ""

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        def fits(d: Any) -> Any:
            return dataclasses.asdict(d) if dataclasses.is_dataclass(d) else {k: fits(v) for k, v in d.items()}

        return {"schema": SCHEMA, "kind": "lowbit.lab.perfmodel calibration", "links": fits(self.links),
                "codecs": fits(self.codecs), **{name: getattr(self, name) for name in STUDY_TABLES},
                "run_keys": sorted(self.run_keys), "config_keys": sorted(self.config_keys), "sources": self.sources}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        if not isinstance(d, dict) or d.get("kind") != "lowbit.lab.perfmodel calibration":
            raise ValueError("not a lowbit calibration (expected the JSON written by "
                             "`lowbit predict --calibrate ... --save-calibration PATH`)")
        try:
            links = {t: {a: LinkFit(**v) for a, v in by.items()} for t, by in d.get("links", {}).items()}
            codecs = {t: {a: {c: CodecFit(**v) for c, v in by_c.items()} for a, by_c in by.items()}
                      for t, by in d.get("codecs", {}).items()}
        except TypeError as exc:
            raise ValueError(f"calibration JSON has a malformed link or codec entry: {exc}") from None
        return cls(links=links, codecs=codecs, **{name: dict(d.get(name, {})) for name in STUDY_TABLES},
                   run_keys=list(d.get("run_keys", [])), config_keys=list(d.get("config_keys", [])),
                   sources=dict(d.get("sources", {})))

    def save(self, path: str | os.PathLike[str]) -> Path:
        p = Path(path)
        if p.is_dir():
            raise ValueError(f"--save-calibration {str(p)!r} is a directory")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"calibration file {str(p)!r} not found")
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except json.JSONDecodeError as exc:
            raise ValueError(f"calibration file {str(p)!r} is not JSON: {exc}") from None

    def merged(self, other: Calibration) -> Calibration:
        """This calibration with ``other``'s entries added where this one has none."""
        out = copy.deepcopy(self)
        _fill(out.links, other.links, 2)
        _fill(out.codecs, other.codecs, 3)
        for name in STUDY_TABLES:
            _fill(getattr(out, name), getattr(other, name), 1)
        out.run_keys = sorted(set(self.run_keys) | set(other.run_keys))
        out.config_keys = sorted(set(self.config_keys) | set(other.config_keys))
        return out


def _same_backend(table: dict[str, Any], transport: str) -> list[str]:
    """``transport``, then the table's other transports of the same backend (``nccl/socket`` for ``nccl``)."""
    backend = transport.split("/")[0]
    return [transport] + sorted(k for k in table if k != transport and k.split("/")[0] == backend)


def _fill(into: dict[str, Any], other: dict[str, Any], depth: int) -> None:
    """Add ``other``'s entries (dicts nested ``depth`` deep) where ``into`` has none."""
    for k, v in other.items():
        if depth > 1:
            _fill(into.setdefault(k, {}), v, depth - 1)
        else:
            into.setdefault(k, v)


def _mean_cost(costs: list[CodecFit], source: str) -> CodecFit:
    means = (sum(getattr(c, f) for c in costs) / len(costs)
             for f in ("encode_call_s", "encode_s_per_byte", "decode_call_s", "decode_s_per_byte"))
    return CodecFit(*means, sum(c.points for c in costs), source)


def fit_study(runs: Iterable[Run]) -> Calibration:
    """Compute at one worker, compute at K workers (without in-backward encoding: :func:`pure_compute_s`)
    and the factor between them. The per-step overhead needs the whole model:
    :func:`lowbit.lab.perfmodel.fit.fit_overhead`."""
    runs = [r for r in runs if r.step_s > 0]
    cal = Calibration(run_keys=[r.key for r in runs], config_keys=sorted({r.config_id for r in runs}))
    one: dict[str, list[Run]] = {}
    at_k: dict[str, list[Run]] = {}
    for r in runs:
        if r.world == 1 and codec_fact(r.codec_name, "sums_on_wire", False):
            one.setdefault(r.compute_key, []).append(r)
        elif r.world > 1:
            at_k.setdefault(r.setting_key, []).append(r)
    for key, rs in one.items():
        step = statistics.fmean(r.compute_s or r.step_s for r in rs)
        gflop = rs[0].gflop_per_sample
        cal.compute[key] = {"step_s": step, "per_sample_s": step / rs[0].batch, "runs": len(rs),
                            "batch": rs[0].batch, "device_name": rs[0].device_name,
                            "flops_per_s": gflop * 1e9 * rs[0].batch / step if gflop == gflop and step > 0 else None}
    factors: dict[str, list[float]] = {}
    for key, rs in at_k.items():
        step = statistics.median(pure_compute_s(r) for r in rs)  # median: robust to a run whose
        # compute absorbed blocking on a slow link
        cal.compute_at_world[key] = {"step_s": step, "runs": len(rs)}
        base = cal.compute.get(rs[0].compute_key)
        if base and base["step_s"] > 0:
            factors.setdefault(rs[0].scale_key, []).append(step / base["step_s"])
    for key, fs in factors.items():
        cal.world_factor[key] = {"factor": statistics.median(fs), "settings": len(fs)}
    return cal


def fit_comm_in_situ(runs: Iterable[Run]) -> Calibration:
    """Links and codec costs from the study's own communicate / encode / decode times per step.

    Per backend, one least squares (on relative errors) over runs: ``comm_s = sum over the step's collectives of
    (steps alpha_algo + bytes beta_algo)`` (one ``(alpha, beta)`` per algorithm, non-negative); per codec
    and algorithm: ``encode_s = calls c0 + 4 * values c1`` (and decode), as for bench rows.
    """
    runs = [r for r in runs if r.world > 1 and r.step_s > 0]
    cal = Calibration(run_keys=[r.key for r in runs], config_keys=sorted({r.config_id for r in runs}))
    by_backend: dict[str, list[Run]] = {}
    for r in runs:
        by_backend.setdefault(r.backend, []).append(r)
    for transport, all_rs in by_backend.items():
        # the links: from one-node runs (runs as emulated nodes are modelled with the links they measured)
        rs = [r for r in all_rs if r.nodes == 1]
        algos = sorted({a for r in rs for _, a, _, _ in run_groups(r)})
        if algos:
            col = {a: i for i, a in enumerate(algos)}
            rows, ys = [], []
            for r in rs:
                row = np.zeros(2 * len(algos))
                for spec, algo, n, riders in run_groups(r):
                    a, b = design_row(bits_per_value(spec, n) * n / 8 + 4 * riders, r.world, algo)
                    row[2 * col[algo]] += a
                    row[2 * col[algo] + 1] += b
                rows.append(row)
                ys.append(r.comm_s)
            a_mat, y_vec = np.array(rows), np.array(ys)
            keep = y_vec > 0
            coef = _nnls(*_relative(a_mat[keep], y_vec[keep])) if keep.any() else np.zeros(a_mat.shape[1])
            rel = _rms_rel(a_mat @ coef, ys)
            for a in algos:
                alpha, beta = float(coef[2 * col[a]]), float(coef[2 * col[a] + 1])
                if alpha == 0 and beta == 0:
                    continue
                n_pts = sum(1 for r in rs if any(g[1] == a for g in run_groups(r)))
                cal.links.setdefault(transport, {})[a] = LinkFit(
                    alpha, 1.0 / beta if beta > 0 else HUGE_BW, a, n_pts, rel,
                    f"in situ: {transport} study runs' communicate time per step ({len(rs)} runs, joint fit)")
        by_codec: dict[tuple[str, str], list[Run]] = {}
        for r in all_rs:
            if r.codec_name != "fp32":
                by_codec.setdefault((r.algorithm, r.codec), []).append(r)
        for (algo, codec), crs in by_codec.items():
            calls, work = [], []
            for r in crs:  # a run's values encoded and decoded per step, over its collectives of this codec
                ws = [codec_work(algo, n, r.world, r.world // max(1, r.nodes), 16.0)
                      for spec, _, n, _ in run_groups(r) if spec == codec]
                calls.append(len(ws))
                work.append((sum((e for e, _ in ws), 0.0), sum((d for _, d in ws), 0.0)))
            cal.codecs.setdefault(transport, {}).setdefault(algo, {})[codec] = _codec_cost(
                work, [r.encode_s for r in crs], [r.decode_s for r in crs],
                f"in situ: {len(crs)} {transport} study runs' encode/decode time", calls)
    return cal
