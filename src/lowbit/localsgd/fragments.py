"""The parameters cut into fragments and the tensor work on one fragment, with no communication.

A fragment is a run of consecutive whole parameter tensors synchronised together (all of them when
``fragments=1``), with its anchor: one flat float32 copy of the weights every rank agreed on at the
fragment's last synchronisation. :func:`_split` cuts the parameters, in model order, into fragments of
about equal size; :func:`_pseudo_gradient` forms ``anchor - current``; :func:`_reset` and :func:`_merge`
put the anchor (or, overlapped, its mix with the local weights) back into the parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn


@dataclasses.dataclass
class _Fragment:
    """Consecutive parameters synchronised together: their anchor, flat; ``offset``: the inner step of
    the period (mod H) after which they are synchronised."""

    params: list[nn.Parameter]
    anchor: torch.Tensor        # (n,) float32, the outer optimizer's parameter
    offset: int
    padded: int                 # n rounded up to a multiple of the ranks per group (chunks)

    @property
    def numel(self) -> int:
        return self.anchor.numel()


def _split(params: Sequence[nn.Parameter], fragments: int) -> list[list[nn.Parameter]]:
    """``params`` cut, in order, into ``fragments`` non-empty runs of whole tensors of about equal numel:
    tensor ``i`` goes to the fragment its middle falls in (``floor((numel before it + its numel / 2) * F /
    total)``), kept between the previous
    tensor's fragment and the next one, and late enough that every fragment gets a tensor."""
    if fragments > len(params):
        raise ValueError(f"fragments={fragments}: the model has only {len(params)} trainable parameter tensors "
                         "(a fragment holds whole tensors)")
    total = max(sum(p.numel() for p in params), 1)
    out: list[list[nn.Parameter]] = [[] for _ in range(fragments)]
    seen, prev = 0, 0
    for i, p in enumerate(params):
        f = 0 if i == 0 else min(max((2 * seen + p.numel()) * fragments // (2 * total), prev, fragments - (len(params) - i)), prev + 1)
        out[f].append(p)
        seen += p.numel()
        prev = f
    return out


def _pseudo_gradient(fr: _Fragment, delta: torch.Tensor) -> None:
    """``delta[:n] = anchor - current`` (the padding zero)."""
    n = fr.numel
    torch.cat([p.detach().reshape(-1).to(torch.float32) for p in fr.params], out=delta[:n])
    torch.sub(fr.anchor, delta[:n], out=delta[:n])
    delta[n:].zero_()


def _reset(fr: _Fragment) -> None:
    """The fragment's parameters become its anchor."""
    with torch.no_grad():
        pos = 0
        for p in fr.params:
            p.copy_(fr.anchor[pos : pos + p.numel()].view_as(p))
            pos += p.numel()


def _merge(fr: _Fragment, mix: float) -> None:
    """The fragment's parameters become ``mix * local + (1 - mix) * anchor`` (``mix=0``: the anchor)."""
    if not mix:
        _reset(fr)
        return
    with torch.no_grad():
        pos = 0
        for p in fr.params:
            a = fr.anchor[pos : pos + p.numel()].view_as(p)
            p.copy_(torch.lerp(a, p.detach().to(torch.float32), mix))
            pos += p.numel()
