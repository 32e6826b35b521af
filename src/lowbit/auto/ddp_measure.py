"""What DDP's ``codec="auto"`` measures of the job before it predicts (:mod:`lowbit.auto.ddp_tuner`,
module doc, steps 1-2): the fp32 step's backward timeline, rebuilt into DDP's buckets
(:func:`measure_timeline`), and each allowed codec's exchange probed on this group's link
(:func:`probe_costs`), flat and, on several nodes (:func:`nodes_of`), hierarchical. The replay that
prices a plan on them is :func:`lowbit.choose.decide`'s.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

from lowbit.auto.clock import Clock
from lowbit.choose import TensorTiming, Timeline, choice, ddp_buckets, split_choice
from lowbit.codecs.base import Codec, get_codec
from lowbit.comm.allreduce import AUTO, resolve_algorithm, start
from lowbit.comm.hierarchical import node_size_for

__all__ = ["TunedState", "measure_timeline", "rides", "probe_costs", "nodes_of", "timeline_of", "hierarchical_ok",
           "by_choice"]

_HIERARCHICAL = "hierarchical"


class TunedState(Protocol):
    """What ``codec="auto"`` reads from the DDP hook's state and the methods it changes it through:
    :class:`lowbit.ddp.LowbitState` (a layer above, so named here by its shape, not imported)."""

    plan: Mapping[str, Codec]             # parameter name -> codec (read; changed through set_plan)
    residuals: Mapping[str, torch.Tensor]  # parameter name -> error-feedback residual (read by the guard)
    order: Mapping[str, int]              # parameter name -> position in model order
    process_group: Optional[dist.ProcessGroup]
    iter: int                             # read; changed through count_step / hook_starts
    bucket_bytes: float                   # DDP's bucket caps
    first_bucket_bytes: float

    @property
    def start_iter(self) -> int: ...
    @property
    def algorithm(self) -> str: ...
    @property
    def message_mb(self) -> Any: ...
    @property
    def node_size(self) -> Optional[int]: ...
    @property
    def numels(self) -> Mapping[str, int]: ...
    def world(self) -> tuple[int, int]: ...
    def set_plan(self, assignment: dict[str, str]) -> None: ...
    def count_step(self, step: int) -> None: ...
    def hook_starts(self, step: int) -> None: ...


def measure_timeline(steps: Sequence[dict[str, Any]], state: TunedState, clock: Clock, ride: bool) -> Timeline:
    """The fp32 step measured on ``steps`` (each ``{"forward": mark, "grads": [(name, mark), ...]}`` and,
    where the autograd engine marked it, ``"end"``: the backward pass's end; marks of ``clock``): median
    gradient-ready offsets over the measured steps (the first measured step is a warm-up when there are
    more than one), the backward pass ending at the median end mark or the last gradient, whichever is
    later; DDP's buckets rebuilt from the ready order and the bucket cap.
    ``ride``: :func:`rides`.

    Raises:
        RuntimeError: no step was measured."""
    done = [(s, nxt) for s, nxt in zip(steps, steps[1:]) if s["grads"]]
    if len(done) > 1:
        done = done[1:]
    if not done:
        raise RuntimeError("lowbit codec='auto': no step was measured (no gradient became ready after a "
                           "training forward pass of the registered module)")
    offsets: dict[str, list[float]] = {}
    periods, ends = [], []
    for s, nxt in done:
        f = s["forward"]
        for name, m in s["grads"]:
            offsets.setdefault(name, []).append(clock.elapsed(f, m))
        periods.append(clock.elapsed(f, nxt["forward"]))
        if s.get("end") is not None:
            ends.append(clock.elapsed(f, s["end"]))
    ready = {name: statistics.median(v) for name, v in offsets.items()}
    names = sorted(ready, key=lambda n: (ready[n], -state.order.get(n, 0)))
    cut = ddp_buckets([state.numels[n] for n in names], state.bucket_bytes, first_bytes=state.first_bucket_bytes)
    bucket_ready: dict[int, float] = {}  # a bucket is handed to the hook when its last gradient is ready
    for n, b in zip(names, cut):
        bucket_ready[b] = max(bucket_ready.get(b, ready[n]), ready[n])
    tensors = [TensorTiming(n, state.numels[n], bucket_ready[b], b) for n, b in zip(names, cut)]
    # the autograd engine's end of the backward pass where it was marked, never before the last gradient
    backward_end = max(max(ready.values()), statistics.median(ends) if len(ends) == len(done) else 0.0)
    step = statistics.median(periods)
    return Timeline(tuple(tensors), backward_end, max(step, backward_end), state.message_mb, ride)


def rides(allow: Sequence[str], state: TunedState) -> bool:
    """Whether the fp32 tensors would ride in the quantised codecs' messages (allgather)."""
    quantised = [get_codec(s) for s in allow if not get_codec(s).sums_on_wire]
    k = state.world()[1]
    return bool(quantised) and resolve_algorithm(state.algorithm, quantised[0], k) == "allgather"


def probe_costs(allow: Sequence[str], state: TunedState, group: Optional[dist.ProcessGroup], device: torch.device,
                timeline: Timeline, k: int, clock: Clock, nodes: Optional[int] = None) -> dict[str, dict[str, Any]]:
    """Each allowed codec's exchange at two sizes, and its encoding alone: fitted as seconds per message
    plus seconds per value. With ``nodes`` ranks per node (several nodes), each quantised codec that can
    send a shard of a tensor is also probed through the hierarchical algorithm, as a choice of its own
    (``spec@hierarchical``; it encodes a 1/``nodes`` shard). Timed with ``clock.best_of`` (the device
    synchronised around each run), on every rank together (the exchanges are collectives).

    Returns:
        choice -> :class:`lowbit.choose.CodecCost`'s fields."""
    total = sum(t.numel for t in timeline.tensors)
    big = int(min(max(total // 3, 1 << 16), 1 << 24))
    small = max(big // 16, 1 << 12)
    choices = [(spec, None) for spec in allow]
    if nodes:
        choices += [(spec, _HIERARCHICAL) for spec in allow if hierarchical_ok(get_codec(spec))]

    def probe(data: torch.Tensor) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        enc_of: dict[str, float] = {}
        for spec, via in choices:
            codec = get_codec(spec)
            algo = "allreduce" if codec.sums_on_wire else resolve_algorithm(via or state.algorithm, codec, k)
            size = nodes if via == _HIERARCHICAL else state.node_size
            times = [clock.best_of(lambda n=n: start(data[:n].clone(), codec, group, algo, "mean",
                                                     node_size=size).wait())
                     for n in (small, big)]
            if spec not in enc_of:
                enc_of[spec] = 0.0 if codec.sums_on_wire else \
                    clock.best_of(lambda: codec.encode(data, seed=1)) / big
            enc = enc_of[spec] / (nodes if via == _HIERARCHICAL else 1)
            slope = max((times[1] - times[0]) / (big - small), 0.0)
            alpha = max(times[0] - slope * small, 0.0)
            link = max(slope - enc, slope * 0.05)  # what is left for the link and decoding
            out[choice(spec, via)] = {"spec": choice(spec, via), "bits": float(codec.bits_per_value(1 << 20)),
                                      "native": bool(codec.sums_on_wire), "alpha_s": alpha, "s_per_value": link,
                                      "encode_s_per_value": enc, "per_tensor": bool(codec.per_tensor),
                                      "algorithm": algo}
        return out

    out = probe(torch.randn(big, generator=torch.Generator(device="cpu").manual_seed(12345)).to(device))
    if device.type == "cuda":  # hand the probes' buffers back: training's allocations stay as they were
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return out


def nodes_of(state: TunedState, world: int) -> Optional[int]:
    """Ranks per node when the group spans several nodes of several ranks each and the algorithm is
    left to auto (``node_size=``, ``$LOWBIT_NODE_SIZE``, torchrun's ``LOCAL_WORLD_SIZE``): then the
    hierarchical algorithm is weighed too. None on one node, one rank a node, or when unknown."""
    if state.algorithm != AUTO or world < 4:
        return None
    try:
        g = node_size_for(state.process_group, state.node_size)
    except ValueError:
        return None  # not known, or not whole nodes: the flat algorithms only
    return g if 1 < g < world else None


def timeline_of(d: dict[str, Any], message_mb: Any, ride: bool = False) -> Timeline:
    """The timeline saved in measurements ``d`` (``tensors``, ``backward_end_s``, ``step_s``)."""
    return Timeline(tuple(TensorTiming(**t) for t in d["tensors"]), d["backward_end_s"], d["step_s"], message_mb,
                    ride)


def hierarchical_ok(codec: Codec) -> bool:
    """Whether the hierarchical algorithm compresses this codec between nodes (it shards each tensor:
    codecs summed on the wire and per-tensor codecs go their own ways)."""
    return not codec.sums_on_wire and not codec.per_tensor


def by_choice(errors: Mapping[str, Mapping[str, float]], costs: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Per tensor, each choice's error: its codec's (the same measured error, flat or hierarchical)."""
    return {name: {key: e.get(split_choice(key)[0], 0.0) for key in costs} for name, e in errors.items()}
