"""The speed model across cards and networks (issue 18): fit on one card, predict the other card's runs.

The test set is the training-speed benchmark's sockets table (``benchmarks/bench_ddp.py``: 2 GPUs, NCCL
over TCP sockets, batch 64 per GPU, GPT 16 x 256 tokens) of one card; the model is fitted on the other
card, and leave-one-network-out: when predicting network N, nothing fitted has seen N on either card.

What each prediction uses:

* **from the predicted card, only the cheap measurement a user would make**: the network's plain-DDP step
  over NVLink (``ddp`` row of the NVLink file), taken as the step's compute (the NVLink all-reduce it
  contains is not subtracted: a few ms of link time, nearly all hidden behind the backward pass);
* **the network's structure**, computed, not fitted: its parameter tensors (``lowbit.lab.models`` built on
  the meta device, no memory), the order their gradients become ready in the backward pass and the
  backward FLOPs done before each is ready (``torch.utils.flop_counter`` over one forward + backward on
  the meta device, the bench's batch), DDP's buckets (1 MiB first, then 25 MiB). Only the *shape* of the
  step comes from FLOPs (when in the measured step each gradient is ready, and the forward's share of
  it); no FLOP rate is fitted or extrapolated;
* **from the fitting card, the link and the codecs**, fitted on the *other* networks' sockets cells
  through the simulator: the sockets link's per-collective latency ``alpha`` and seconds per byte sent
  ``beta`` (on plain DDP and the fp16 hook: native all-reduces of 4 and 2 bytes a value), and per lowbit
  codec its seconds per value on the link timeline beyond its bytes (decoding, copies) and on the
  compute timeline (encoding). Least squares on log(predicted / measured), a log-spaced grid refined
  three times (deterministic; zero allowed for the codec terms).

The simulator is :func:`lowbit.choose.simulate`, the replay behind ``codec="auto"`` (and ``lowbit
advise``'s decision rule): it replays a step as the DDP hook sends it (message groups of consecutive
tensors, native all-reduces per DDP bucket, one link serving messages in issue order, encoding on the
compute timeline), which is what ``bench_ddp`` timed. ``lowbit.lab.perfmodel.model.simulate_step`` models one
collective per DDP bucket instead, which is not how lowbit's hook has sent messages since bucket
coalescing. The hook's message structure is the *code* each file ran (``benchmarks/results/ddp_runs.md``):
the 2x H100 files say ``git_commit 6ffbde3`` but ran 0109990 (NVLink) and 727860e (sockets), where
consecutive DDP buckets of one codec coalesce into messages of at least 64 MiB of fp32; from b534a38
on, message groups of consecutive tensors up to ``message_mb="auto"``, which until c0fc04b was the
larger of 64 MiB and a third of the quantised gradients (replayed here as that many MiB: ``LEGACY_AUTO``)
and from c0fc04b on closes where DDP's buckets end (what ``choose.simulate`` replays for "auto"). A
predicted step is ``NVLink step + simulate(...)``.

    python benchmarks/validate_cross_card.py [--h100 SOCKETS NVLINK] [--h200 SOCKETS NVLINK] \\
        [--out benchmarks/results/speed_model_cross_card.json] [--md benchmarks/results/speed_model_cross_card.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Union

import torch
from torch.utils.flop_counter import FlopCounterMode

import lowbit
from lowbit.choose import CodecCost, TensorTiming, Timeline, ddp_buckets, message_limit, simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ddp  # noqa: E402  (the bench's models and batches: build, make_batch)

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_FILES = {
    "H100": (RESULTS / "ddp_2xh100_sockets.json", RESULTS / "ddp_2xh100_nvlink.json"),
    "H200": (RESULTS / "ddp_2xh200_sockets.json", RESULTS / "ddp_2xh200_nvlink.json"),
}
#: the table's codecs: our name -> bench_ddp's hook config
HOOKS = {"fp32": "ddp", "fp16": "fp16", "qsgd8": "lowbit:qsgd:bits=8,bucket=512",
         "qsgd4": "lowbit:qsgd:bits=4,bucket=512", "onebit": "lowbit:onebit:bucket=64"}
NATIVE = {"fp32": 4.0, "fp16": 2.0}     # bytes per value of the natively summed hooks
FIRST_BUCKET, BUCKET = 2**20, 25 * 2**20  # DDP's bucket caps
#: bench_ddp files whose git_commit is stale (ddp_runs.md): the hook of 0109990 / 727860e coalesced DDP
#: buckets of one codec into messages of >= 64 MiB fp32
STALE_COMMITS = {"6ffbde3", "6ffbde304b26d87e03e45e8c6d38060460cdf53d"}
#: the first commit whose message_mb="auto" cuts messages where DDP's buckets end; files of earlier code ran
#: the size rule, max(64 MiB, a third of the quantised gradients), replayed as LEGACY_AUTO
ALIGNED_AUTO_SINCE = "c0fc04b"
LEGACY_AUTO = "auto (before c0fc04b)"


def runs_aligned_auto(commit: Any) -> bool:
    """Whether ``commit`` (a bench file's git_commit) has the DDP-aligned message_mb="auto" (git ancestry;
    False where git cannot tell)."""
    if not commit or str(commit) in STALE_COMMITS:
        return False
    try:
        r = subprocess.run(["git", "merge-base", "--is-ancestor", ALIGNED_AUTO_SINCE, str(commit)],
                           cwd=Path(__file__).resolve().parent, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


# ------------------------------------------------------------------------------------------ data
@dataclasses.dataclass
class Card:
    """One card's two bench_ddp files, reduced to what the model reads: per network the plain-DDP NVLink
    step (ms), per network and codec the measured sockets step (ms, the median of rounds' samples/s)."""

    name: str
    device: str
    commit: str
    nvlink_ms: dict[str, float]
    sockets_ms: dict[str, dict[str, float]]
    batch: dict[str, int]
    seq: int
    messages: tuple[str, Union[float, str]]  # ("buckets" | "tensors", message_mb)
    files: tuple[str, str]
    sockets_raw_ms: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)


def _step_ms(r: Mapping[str, Any], hook: str) -> float | None:
    """The hook's step as bench_ddp recorded it (global batch / samples/s; None where it did not run)."""
    row = r["hooks"].get(hook, {})
    return row.get("step_ms") if row.get("samples_per_s") else None


def hook_messages(meta: Mapping[str, Any]) -> tuple[str, Union[float, str]]:
    """How the lowbit hook of the run's code grouped gradients into messages (module doc)."""
    mb = (meta.get("args") or {}).get("lowbit_message_mb")
    if str(meta.get("git_commit")) in STALE_COMMITS:
        return ("buckets", float(mb) if mb is not None else 64.0)
    if mb is not None:
        return ("tensors", float(mb))
    return ("tensors", "auto" if runs_aligned_auto(meta.get("git_commit")) else LEGACY_AUTO)


def load_card(name: str, sockets: Path, nvlink: Path) -> Card:
    s, n = json.loads(Path(sockets).read_text()), json.loads(Path(nvlink).read_text())
    nv = {net: _step_ms(r, "ddp") for net, r in n["results"].items()}
    sk: dict[str, dict[str, float]] = {}
    raw: dict[str, dict[str, list[float]]] = {}
    for net, r in s["results"].items():
        row = {c: _step_ms(r, h) for c, h in HOOKS.items()}
        sk[net] = {c: v for c, v in row.items() if v is not None}
        raw[net] = {c: list(r["hooks"][HOOKS[c]].get("raw_step_ms") or []) for c in sk[net]}
    batch = {net: r["batch_per_rank"] for net, r in {**s["results"], **n["results"]}.items()}
    return Card(name, s["meta"].get("device_name", "?"), str(s["meta"].get("git_commit")),
                {k: v for k, v in nv.items() if v is not None}, sk, batch, int(s["meta"]["args"].get("seq", 256)),
                hook_messages(s["meta"]), (Path(sockets).name, Path(nvlink).name), raw)


# ------------------------------------------------------------------------------------------ structure
@functools.lru_cache(maxsize=None)
def profile(network: str, batch: int, seq: int = 256) -> tuple[float, tuple[tuple[str, int, float], ...]]:
    """(forward share of the step's FLOPs, ((tensor, numel, share of the backward's FLOPs done when its
    gradient is ready), ...) in the order the gradients become ready): one forward + backward of the
    bench's batch on the meta device under torch's FLOP counter. The model and its input are the ones
    bench_ddp timed (:func:`bench_ddp.build`, :func:`bench_ddp.make_batch`), ``batch`` per rank."""
    with torch.device("meta"):
        model, feed = bench_ddp.build(network, bench_ddp.parse_args(["--device", "cpu", "--seq", str(seq)]))
    x, _ = bench_ddp.make_batch({**feed, "batch": batch}, torch.device("meta"), 0)
    counter = FlopCounterMode(display=False)
    marks: list[tuple[str, int, float]] = []
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: marks.append((name, p.numel(), float(counter.get_total_flops()))))
    with counter:
        out = model(x)
        fwd = float(counter.get_total_flops())
        out.float().sum().backward()
    total = float(counter.get_total_flops())
    bwd = max(total - fwd, 1.0)
    return fwd / total, tuple((n, k, min(max((f - fwd) / bwd, 0.0), 1.0)) for n, k, f in marks)


def timeline(network: str, batch: int, seq: int, step_s: float, messages: tuple[str, Union[float, str]]) -> Timeline:
    """The network's step on a card whose compute takes ``step_s``: forward for the forward's FLOP share,
    each gradient ready after its share of the backward, DDP's buckets (a bucket's tensors are handed to
    the hook when its last one is ready). With ``messages[0] == "buckets"`` each DDP bucket is one unit
    (the hook of 0109990-727860e coalesced whole buckets)."""
    return _step(network, batch, seq, step_s, messages).tensors


@dataclasses.dataclass(frozen=True, eq=False)
class _Step:
    """A network's step for the replay: ``tensors`` as the hook sees them, ``units`` the same with the
    tensors that the hook's messages never split (consecutive, one DDP bucket, one message) merged, and
    ``buckets`` one unit per DDP bucket (natively summed codecs go out per bucket anyway). The replay is
    the same on all three for the codecs each serves (it depends only on units' sizes, ready times and
    where messages close); the merged ones are faster."""

    tensors: Timeline
    units: Timeline
    buckets: Timeline

    def replay(self, c: CodecCost) -> float:
        tl = self.buckets if c.native else self.units
        return simulate(tl, _everything(tl, c.spec), {c.spec: c})


_ASSIGN: dict[tuple[int, str], dict[str, str]] = {}


def _everything(tl: Timeline, spec: str) -> dict[str, str]:
    """Every tensor of ``tl`` -> ``spec`` (kept: the replay runs thousands of times per fit)."""
    key = (id(tl), spec)
    if key not in _ASSIGN:
        _ASSIGN[key] = {t.name: spec for t in tl.tensors}
    return _ASSIGN[key]


@functools.lru_cache(maxsize=None)
def _step(network: str, batch: int, seq: int, step_s: float, messages: tuple[str, Union[float, str]]) -> _Step:
    fwd_share, marks = profile(network, batch, seq)
    fwd_s = fwd_share * step_s
    ready = [(n, k, fwd_s + f * (step_s - fwd_s)) for n, k, f in marks]
    cut = ddp_buckets([k for _, k, _ in ready], BUCKET, first_bytes=FIRST_BUCKET)
    nb = max(cut) + 1
    t_ready = [max(t for (_, _, t), b in zip(ready, cut) if b == i) for i in range(nb)]
    buckets = [TensorTiming(f"bucket{i}", sum(k for (_, k, _), b in zip(ready, cut) if b == i), t_ready[i], i)
               for i in range(nb)]
    tensors = [TensorTiming(n, k, t_ready[b], b) for (n, k, _), b in zip(ready, cut)]
    if messages[1] == LEGACY_AUTO:  # the size rule that code ran, as a fixed size
        messages = (messages[0], max(64.0, 4 * sum(p[1] for p in ready) / 3 / 2**20))
    by_bucket = Timeline(tuple(buckets), step_s, step_s, messages[1])
    if messages[0] == "buckets":
        return _Step(by_bucket, by_bucket, by_bucket)
    hooked = Timeline(tuple(tensors), step_s, step_s, messages[1])
    # where choose.simulate closes a message when every tensor has one quantised codec
    limit = message_limit(messages[1], 4 * sum(t.numel for t in tensors))
    units: list[TensorTiming] = []
    group, closed = 0, True
    for t in tensors:
        if units and not closed and units[-1].bucket == t.bucket:
            u = units[-1]
            units[-1] = TensorTiming(u.name, u.numel + t.numel, t.ready_s, t.bucket)
        else:
            units.append(TensorTiming(f"unit{len(units)}", t.numel, t.ready_s, t.bucket))
        group += t.numel
        closed = messages[1] != "auto" and 4 * group >= limit  # ("auto" closes at bucket ends only)
        if closed:
            group = 0
    return _Step(hooked, Timeline(tuple(units), step_s, step_s, messages[1]), by_bucket)


# ------------------------------------------------------------------------------------------ model
@dataclasses.dataclass(frozen=True)
class Params:
    """The fitted link and codecs: ``alpha`` s per collective, ``beta`` s per byte sent per rank, and per
    lowbit codec ``(link s per value beyond its bytes, encode s per value)``."""

    alpha: float
    beta: float
    codecs: dict[str, tuple[float, float]]
    fitted_on: tuple[str, ...]   # "card:network" of every sockets cell fitted
    rms_log_error: dict[str, float]


@functools.lru_cache(maxsize=None)
def bits(codec: str) -> float:
    if codec in NATIVE:
        return 8 * NATIVE[codec]
    return float(lowbit.get_codec(HOOKS[codec].split(":", 1)[1]).bits_per_value(1 << 20))


def cost(codec: str, alpha: float, beta: float, link: float = 0.0, enc: float = 0.0) -> CodecCost:
    if codec in NATIVE:
        return CodecCost(codec, bits(codec), True, alpha, NATIVE[codec] * beta)
    return CodecCost(codec, bits(codec), False, alpha, bits(codec) / 8 * beta + link, enc)


def step_s(st: _Step, c: CodecCost) -> float:
    """Predicted step: the compute (the timeline's step) plus what the replay adds for codec ``c`` on every
    tensor (lowbit's hook sends 1-D and small tensors raw in the same messages: counted at the codec's
    bits, under 0.2 % of any of these networks' values)."""
    return st.tensors.step_s + st.replay(c)


#: the fits' grid: points per coordinate and rounds (tests of the script's structure use a coarser one)
GRID_POINTS, GRID_ROUNDS = 13, 4


def _grid_fit(loss: Callable[[Sequence[float]], float], ranges: Sequence[tuple[float, float]],
              zero: Sequence[bool]) -> tuple[list[float], float]:
    """Minimise ``loss`` over a log-spaced grid per coordinate (plus 0 where ``zero``): ``GRID_ROUNDS``
    grids of ``GRID_POINTS`` points, each after the first spanning two steps of the previous one either side
    of its best point."""
    points, rounds = GRID_POINTS, GRID_ROUNDS
    lo = [math.log(a) for a, _ in ranges]
    hi = [math.log(b) for _, b in ranges]
    best, best_loss = None, math.inf
    for _ in range(rounds):
        axes = []
        for i in range(len(ranges)):
            vals = [math.exp(lo[i] + (hi[i] - lo[i]) * j / (points - 1)) for j in range(points)]
            axes.append(([0.0] if zero[i] else []) + vals)
        grid: list[list[float]] = [[]]
        for ax in axes:
            grid = [g + [v] for g in grid for v in ax]
        for g in grid:
            v = loss(g)
            if v < best_loss - 1e-15:
                best, best_loss = g, v
        assert best is not None
        for i in range(len(ranges)):
            step = (hi[i] - lo[i]) / (points - 1)
            centre = math.log(best[i]) if best[i] > 0 else lo[i]
            lo[i], hi[i] = centre - 2 * step, centre + 2 * step
    assert best is not None
    return best, best_loss


def _log_err(pred: float, meas: float) -> float:
    return math.log(pred / meas) ** 2


def fit(card: Card, networks: Sequence[str]) -> Params:
    """Fit the link and the codec costs on ``card``'s sockets cells of ``networks`` (and their NVLink
    steps as compute). Reads nothing else."""
    cells: dict[str, list[tuple[_Step, float]]] = {}
    for net in networks:
        if net not in card.nvlink_ms:
            continue
        tl = _step(net, card.batch[net], card.seq, card.nvlink_ms[net] / 1e3, card.messages)
        for codec, ms in card.sockets_ms.get(net, {}).items():
            cells.setdefault(codec, []).append((tl, ms / 1e3))
    native = [(c, tl, m) for c in NATIVE for tl, m in cells.get(c, [])]
    if not native:
        raise ValueError(f"{card.name}: no plain-DDP / fp16 sockets cells to fit the link on ({list(networks)})")

    def link_loss(p: Sequence[float]) -> float:
        costs = {c: cost(c, p[0], p[1]) for c in NATIVE}
        return sum(_log_err(step_s(tl, costs[c]), m) for c, tl, m in native)

    (alpha, beta), lo = _grid_fit(link_loss, [(1e-6, 1e-1), (1e-12, 1e-8)], [True, False])
    rms = {"link": math.sqrt(lo / len(native))}
    codecs: dict[str, tuple[float, float]] = {}
    for codec, cs in cells.items():
        if codec in NATIVE:
            continue

        def codec_loss(p: Sequence[float], codec: str = codec, cs: list[tuple[_Step, float]] = cs) -> float:
            c = cost(codec, alpha, beta, p[0], p[1])
            return sum(_log_err(step_s(tl, c), m) for tl, m in cs)

        (link, enc), lo = _grid_fit(codec_loss, [(1e-13, 1e-8), (1e-14, 1e-8)], [True, True])
        codecs[codec] = (link, enc)
        rms[codec] = math.sqrt(lo / len(cs))
    fitted = tuple(sorted(f"{card.name}:{n}" for n in networks if n in card.sockets_ms and n in card.nvlink_ms))
    return Params(alpha, beta, codecs, fitted, rms)


def predict(params: Params, network: str, batch: int, seq: int, nvlink_ms: float,
            messages: tuple[str, Union[float, str]], codec: str) -> tuple[float, float, float]:
    """(predicted sockets step s, of it the compute, of it the replay's addition) for one cell."""
    tl = _step(network, batch, seq, nvlink_ms / 1e3, messages)
    if codec in NATIVE:
        c = cost(codec, params.alpha, params.beta)
    elif codec in params.codecs:
        c = cost(codec, params.alpha, params.beta, *params.codecs[codec])
    else:
        raise KeyError(f"codec {codec!r} was not fitted")
    s = step_s(tl, c)
    return s, tl.tensors.step_s, s - tl.tensors.step_s


@dataclasses.dataclass
class Target:
    """What a prediction may read from the predicted card: its NVLink plain-DDP steps (and the bench's
    batch sizes and hook code), never its sockets rows."""

    name: str
    nvlink_ms: dict[str, float]
    batch: dict[str, int]
    seq: int
    messages: tuple[str, Union[float, str]]


def target_of(card: Card) -> Target:
    return Target(card.name, dict(card.nvlink_ms), dict(card.batch), card.seq, card.messages)


def lono_fits(card: Card, networks: Sequence[str]) -> dict[str, Params]:
    """Per network N of ``networks``: :func:`fit` on ``card``'s other networks (N never seen)."""
    return {net: fit(card, [n for n in networks if n != net]) for net in networks}


def cross_card(fit_card: Card, target: Target, networks: Sequence[str], codecs: Sequence[str] = tuple(HOOKS),
               fits: Mapping[str, Params] | None = None) -> list[dict[str, Any]]:
    """Leave-one-network-out predictions of ``target``'s sockets cells from ``fit_card``: per network N,
    :func:`fit` on ``fit_card``'s other networks (or ``fits[N]``, made so), then the codecs of N from
    ``target``'s NVLink step."""
    rows = []
    for net in networks:
        if net not in target.nvlink_ms:
            continue
        params = fits[net] if fits is not None else fit(fit_card, [n for n in networks if n != net])
        if any(f.endswith(":" + net) for f in params.fitted_on):
            raise AssertionError(f"the fit for {net} saw {net}")
        for codec in codecs:
            if codec not in NATIVE and codec not in params.codecs:
                continue
            s, comp, extra = predict(params, net, target.batch[net], target.seq, target.nvlink_ms[net],
                                     target.messages, codec)
            link, enc = params.codecs.get(codec, (0.0, 0.0))
            rows.append({"fit_card": fit_card.name, "predicted_card": target.name, "network": net,
                         "codec": codec, "predicted_ms": s * 1e3, "compute_ms": comp * 1e3,
                         "added_ms": extra * 1e3, "fitted_on": list(params.fitted_on),
                         "alpha_ms": params.alpha * 1e3, "link_GBps": 1e-9 / params.beta,
                         "codec_link_ns_per_value": link * 1e9, "codec_encode_ns_per_value": enc * 1e9,
                         "fit_rms_log_error": params.rms_log_error})
    return rows


def score(rows: list[dict[str, Any]], test: Card) -> list[dict[str, Any]]:
    """Set each prediction beside ``test``'s measured sockets step (the only place those are read), with
    the measured rounds' range."""
    out = []
    for r in rows:
        meas = test.sockets_ms.get(r["network"], {}).get(r["codec"])
        if meas is None:
            continue
        raw = test.sockets_raw_ms.get(r["network"], {}).get(r["codec"], [])
        out.append({**r, "measured_ms": meas, "error": (r["predicted_ms"] - meas) / meas,
                    "measured_rounds_ms": raw})
    return out


def median_abs(rows: Sequence[Mapping[str, Any]], key: str = "error") -> float:
    vals = [abs(r[key]) for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else math.nan


def run(cards: Mapping[str, Card], reference: bool = True) -> dict[str, Any]:
    """Both directions (each card fitted, the other predicted), leave-one-network-out.

    With ``reference``, beside each cross-card cell (never used by it): the same cell predicted within
    the predicted card (leave-one-network-out on its own sockets cells: what the model does without a
    change of card), with the predicted card's own link fit and the fitting card's codec terms (what the
    link's transfer costs), and the NVLink step alone (no link model at all)."""
    names = list(cards)
    if len(names) != 2:
        raise ValueError("two cards, please")
    nets = [n for n in cards[names[0]].nvlink_ms
            if all(n in c.nvlink_ms and n in c.sockets_ms for c in cards.values())]
    fits = {k: lono_fits(c, nets) for k, c in cards.items()}
    cells: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    in_card: dict[str, list[dict[str, Any]]] = {}
    if reference:
        for k, c in cards.items():
            in_card[k] = score(cross_card(c, target_of(c), nets, fits=fits[k]), c)
    for fit_name, test_name in ((names[0], names[1]), (names[1], names[0])):
        f, t = cards[fit_name], cards[test_name]
        rows = score(cross_card(f, target_of(t), nets, fits=fits[fit_name]), t)
        if reference:
            own = {(r["network"], r["codec"]): r for r in in_card[test_name]}
            for r in rows:
                r["in_card_error"] = own[(r["network"], r["codec"])]["error"]
                mixed = dataclasses.replace(fits[fit_name][r["network"]], alpha=fits[test_name][r["network"]].alpha,
                                            beta=fits[test_name][r["network"]].beta)
                s, _, _ = predict(mixed, r["network"], t.batch[r["network"]], t.seq, t.nvlink_ms[r["network"]],
                                  t.messages, r["codec"])
                r["own_link_error"] = (s * 1e3 - r["measured_ms"]) / r["measured_ms"]
                r["nvlink_alone_error"] = (r["compute_ms"] - r["measured_ms"]) / r["measured_ms"]
        cells += rows
        summary[f"{fit_name}->{test_name}"] = {"median_abs_error": median_abs(rows), "cells": len(rows),
                                               "max_abs_error": max(abs(r["error"]) for r in rows)}
    summary["overall"] = {"median_abs_error": median_abs(cells), "cells": len(cells),
                          "max_abs_error": max(abs(r["error"]) for r in cells)}
    for codec in HOOKS:
        sel = [r for r in cells if r["codec"] == codec]
        summary[f"codec {codec}"] = {"median_abs_error": median_abs(sel), "cells": len(sel)}
    for net in nets:
        sel = [r for r in cells if r["network"] == net]
        summary[f"network {net}"] = {"median_abs_error": median_abs(sel), "cells": len(sel)}
    if reference:
        for k, rows in in_card.items():
            summary[f"reference: within {k} (leave-one-network-out)"] = {
                "median_abs_error": median_abs(rows), "cells": len(rows)}
        summary["reference: predicted card's link fit, fitting card's codecs"] = {
            "median_abs_error": median_abs(cells, "own_link_error"), "cells": len(cells)}
        summary["reference: the NVLink step alone"] = {
            "median_abs_error": median_abs(cells, "nvlink_alone_error"), "cells": len(cells)}
    worst = sorted(cells, key=lambda r: -abs(r["error"]))[:8]
    return {"summary": summary, "cells": cells, "worst": worst, "fits": fits,
            "in_card": {k: v for k, v in in_card.items()},
            "cards": {k: {"device": c.device, "git_commit": c.commit, "files": list(c.files),
                          "hook_messages": list(c.messages)} for k, c in cards.items()}}


# ------------------------------------------------------------------------------------------ output
METHOD = ("Predicted step = the predicted card's plain-DDP step over NVLink (its compute: the only number read "
          "from that card) + lowbit.choose.simulate's replay of the sockets exchange, with the link (latency, "
          "s/byte) and each codec's per-value costs fitted on the other card's sockets cells of the other three "
          "networks (leave-one-network-out); gradient-ready times from the network's FLOPs on the meta device "
          "(shape only, scaled to the measured step).")


def table(cells: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| fitted on -> predicted | network | codec | predicted ms | measured ms | error | "
             "compute (NVLink step) ms |", "|---|---|---|---:|---:|---:|---:|"]
    for r in cells:
        lines.append(f"| {r['fit_card']} -> {r['predicted_card']} | {r['network']} | {r['codec']} | "
                     f"{r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {r['error']:+.1%} | {r['compute_ms']:.1f} |")
    return "\n".join(lines)


def worst_table(cells: Sequence[Mapping[str, Any]]) -> str:
    lines = ["| fitted on -> predicted | network | codec | error | within the predicted card | its own link, "
             "fitted card's codecs | measured rounds (ms) | fitted link: alpha ms, GB/s | codec: link, encode "
             "ns/value |", "|---|---|---|---:|---:|---:|---|---|---|"]
    for r in cells:
        rounds = ", ".join(f"{x:.1f}" for x in r.get("measured_rounds_ms", []))
        lines.append(f"| {r['fit_card']} -> {r['predicted_card']} | {r['network']} | {r['codec']} | "
                     f"{r['error']:+.1%} | {r.get('in_card_error', math.nan):+.1%} | "
                     f"{r.get('own_link_error', math.nan):+.1%} | {rounds} | {r['alpha_ms']:.2f}, "
                     f"{r['link_GBps']:.2f} | {r['codec_link_ns_per_value']:.3f}, "
                     f"{r['codec_encode_ns_per_value']:.3f} |")
    return "\n".join(lines)


def fits_table(fits: Mapping[str, Mapping[str, Params]]) -> str:
    codecs = [c for c in HOOKS if c not in NATIVE]
    lines = ["| card | fitted without | alpha ms | link GB/s | " + " | ".join(f"{c}: link, encode ns/value"
                                                                   for c in codecs) + " | rms log error of the fit |",
             "|---|---|---:|---:|" + "---|" * len(codecs) + "---|"]
    for card, by_net in fits.items():
        for net, p in by_net.items():
            cols = " | ".join(f"{p.codecs[c][0] * 1e9:.3f}, {p.codecs[c][1] * 1e9:.3f}" if c in p.codecs else "-"
                              for c in codecs)
            rms = ", ".join(f"{k} {v:.3f}" for k, v in p.rms_log_error.items())
            lines.append(f"| {card} | {net} | {p.alpha * 1e3:.2f} | {1e-9 / p.beta:.2f} | {cols} | {rms} |")
    return "\n".join(lines)


def summary_lines(summary: Mapping[str, Mapping[str, Any]]) -> str:
    return "\n".join(f"median |error| {k}: {v['median_abs_error']:.1%} over {v['cells']} cells"
                     + (f" (max {v['max_abs_error']:.1%})" if "max_abs_error" in v else "")
                     for k, v in summary.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--h100", nargs=2, type=Path, metavar=("SOCKETS", "NVLINK"), default=DEFAULT_FILES["H100"],
                   help="bench_ddp JSON of one card: sockets, NVLink (default: the committed 2x H100 runs)")
    p.add_argument("--h200", nargs=2, type=Path, metavar=("SOCKETS", "NVLINK"), default=DEFAULT_FILES["H200"],
                   help="the other card's (default: the committed 2x H200 runs)")
    p.add_argument("--out", type=Path, default=None, help="write the cells and summary as JSON")
    p.add_argument("--md", type=Path, default=None, help="write the table and summary as Markdown")
    args = p.parse_args(argv)
    cards = {"H100": load_card("H100", *args.h100), "H200": load_card("H200", *args.h200)}
    res = run(cards)
    given = sys.argv[1:] if argv is None else argv
    cmd = " ".join(["python benchmarks/validate_cross_card.py", *given])
    for k, c in res["cards"].items():
        print(f"{k}: {c['device']}, files {', '.join(c['files'])} (git_commit {c['git_commit']}; lowbit hook "
              f"messages: {c['hook_messages'][0]}, message_mb {c['hook_messages'][1]})")
    print(METHOD + "\n")
    print(table(res["cells"]))
    print("\nworst cells, with references that use the predicted card's other sockets cells (diagnosis only):")
    print(worst_table(res["worst"]))
    print("\nthe fits (each used only for the network it was fitted without):")
    print(fits_table(res["fits"]))
    print()
    print(summary_lines(res["summary"]))
    if args.out:
        fits = {k: {net: dataclasses.asdict(p) for net, p in v.items()} for k, v in res["fits"].items()}
        args.out.write_text(json.dumps({"command": cmd, **res, "fits": fits}, indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.md:
        args.md.write_text(f"# Speed model across cards (issue 18)\n\n`{cmd}`\n\n" + METHOD + "\n\n"
                           + table(res["cells"]) + "\n\n```\n" + summary_lines(res["summary"]) + "\n```\n\n"
                           "Worst cells, with references that use the predicted card's other networks' sockets "
                           "cells (diagnosis only, never in a prediction):\n\n" + worst_table(res["worst"])
                           + "\n\nThe fits (each predicts only the network it was fitted without):\n\n"
                           + fits_table(res["fits"]) + "\n")
        print(f"wrote {args.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
