"""``codec="auto"``'s estimates of error and noise, and the one rule by which the ranks agree on them.

* :func:`codec_errors`: each codec's squared error on a gradient sample, scaled to the whole gradient;
  :func:`squared_norm` the gradient's squared norm from the same sample (the guard's reference is their
  ratio).
* :func:`sampling_noise`: how much the ranks' gradients of a tensor differ from their mean, E|g_r -
  mean|^2 K/(K-1): the noise a rank's batch already carries, bold's allowance for unbiased codecs.
* Samples: :func:`prefix_sample` (DDP: the first :data:`ERROR_SAMPLE` values of a gradient) and
  :func:`spread_sample` (FSDP: :data:`RUNS` runs of neighbouring values spread over a reduce-scatter
  input; runs, since a codec's buckets see neighbours, as on the wire).
* :func:`agree`: every rank's measurements gathered and averaged element-wise in rank order, so every
  rank decides the same from the same numbers, however differently it measured.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from lowbit.codecs.base import get_codec
from lowbit.comm import collectives as C

__all__ = ["ERROR_SAMPLE", "RUNS", "codec_errors", "squared_norm", "sampling_noise", "prefix_sample",
           "spread_sample", "average", "agree"]

#: values of each gradient whose compression error is measured (scaled to the whole gradient)
ERROR_SAMPLE = 1 << 16
#: a spread sample is this many runs of neighbouring values, spread evenly over the buffer
RUNS = 16
_FP32 = get_codec("fp32").spec


def codec_errors(x: torch.Tensor, n: int, specs: Sequence[str]) -> dict[str, float]:
    """Each codec's squared error on ``x`` (a sample of a gradient of ``n`` values), scaled to ``n``."""
    x = x.float().contiguous()
    scale = n / max(x.numel(), 1)
    out = {}
    for spec in specs:
        codec = get_codec(spec)
        if spec == _FP32 or x.numel() == 0:
            out[spec] = 0.0
            continue
        y = codec.decode(codec.encode(x, seed=7), x.numel())
        out[spec] = float(((y - x) ** 2).sum()) * scale
    return out


def squared_norm(x: torch.Tensor, n: int) -> float:
    """The squared norm of a gradient of ``n`` values, from ``x``, a sample of it."""
    return float((x.double() ** 2).sum()) * n / max(x.numel(), 1)


def prefix_sample(g: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A float32 copy of the first :data:`ERROR_SAMPLE` values of gradient ``g``, and its size."""
    g = g.reshape(-1)
    return g[: min(g.numel(), ERROR_SAMPLE)].detach().float().clone(), g.numel()


def spread_sample(x: torch.Tensor) -> torch.Tensor:
    """Up to :data:`ERROR_SAMPLE` values of flat ``x``, a float32 copy: all of them, or :data:`RUNS` runs
    of neighbouring values spread evenly over it."""
    n = x.numel()
    if n <= ERROR_SAMPLE:
        return x.float().clone()
    run = ERROR_SAMPLE // RUNS
    return torch.cat([x[a : a + run] for a in torch.linspace(0, n - run, RUNS).long().tolist()]).float()


def sampling_noise(samples: Mapping[str, tuple[torch.Tensor, int]], numels: Mapping[str, int],
                   group: Optional[dist.ProcessGroup], k: int, device: torch.device) -> dict[str, float]:
    """Per tensor, the sampling noise of one rank's gradient: E|g_r - mean|^2 * K/(K-1) over the ranks, on
    the gradient samples (``samples[name]``: a sample of ``min(numel, ERROR_SAMPLE)`` values and the
    gradient's size, which scales it), from one sum of the samples over the group (a collective: every
    rank passes the same ``numels``, names in the same order; zeros stand in where it has no sample).

    Returns:
        name -> noise, for the tensors sampled; empty on one rank."""
    parts = []
    for name, numel in numels.items():
        x = samples.get(name)
        parts.append(x[0] if x is not None else torch.zeros(min(numel, ERROR_SAMPLE), device=device))
    if not parts or k < 2:
        return {}
    mine = torch.cat(parts)
    total = mine.clone()
    C.wait(C.all_reduce_async(total, group), "all_reduce", group)
    dev = mine - total / k
    out, pos = {}, 0
    for (name, numel), x in zip(numels.items(), parts):
        m = x.numel()
        if name in samples and m:
            out[name] = float((dev[pos:pos + m].double() ** 2).sum()) * numel / m * k / (k - 1)
        pos += m
    return out


def average(per_rank: list[Any]) -> Any:
    """Element-wise mean of the ranks' measurements (the same structure on every rank), in rank order:
    dicts key by key, lists item by item, numbers averaged (ints equal on every rank stay ints),
    strings, bools and None taken from the first rank.

    Raises:
        RuntimeError: the ranks' dicts have different keys."""
    first = per_rank[0]
    if isinstance(first, dict):
        keys = list(first)
        for r in per_rank[1:]:
            if not isinstance(r, dict) or list(r) != keys:
                raise RuntimeError("lowbit codec='auto': the ranks measured different structures "
                                   f"({sorted(first)[:5]} vs {sorted(r)[:5] if isinstance(r, dict) else r!r})")
        return {k: average([r[k] for r in per_rank]) for k in keys}
    if isinstance(first, list):
        return [average(list(col)) for col in zip(*per_rank)]
    if isinstance(first, bool) or isinstance(first, str) or first is None:
        return first
    if isinstance(first, (int, float)):
        if isinstance(first, int) and all(r == first for r in per_rank):
            return first
        return sum(float(r) for r in per_rank) / len(per_rank)
    return first


def agree(mine: Any, group: Optional[dist.ProcessGroup]) -> Any:
    """Every rank's ``mine`` gathered over ``group`` and averaged (:func:`average`): a collective, the same
    result on every rank."""
    return average(C.all_gather_object(mine, group))
