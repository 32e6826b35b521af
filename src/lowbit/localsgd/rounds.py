"""The outer round of one fragment, synchronous or overlapped: the steps of :class:`~lowbit.localsgd.LocalSGD`
that talk to the other ranks.

* synchronous (``overlap=0``), :meth:`_Rounds._sync`, at the fragment's inner step: pseudo-gradient,
  exchange (this rank's chunk across groups, then the chunks put together inside the group), outer step,
  reset, all at once;
* overlapped (``overlap=τ``): :meth:`_Rounds._issue` forms the pseudo-gradient and issues the exchange at
  the fragment's inner step; ``τ`` inner steps later :meth:`_Rounds._land` waits for it, gathers the
  chunks, steps the anchor and mixes the parameters with it (:func:`~lowbit.localsgd.fragments._merge`).

Both share :meth:`_Rounds._exchange`, :meth:`_Rounds._gather_chunks` and :meth:`_Rounds._outer_step`; the
state they read (the fragments, the groups, the codec, the statistics) is built by
:meth:`LocalSGD._configure <lowbit.localsgd.core.LocalSGD._configure>`.
"""

from __future__ import annotations

from typing import Any

import torch

from lowbit.comm import collectives as C
from lowbit.comm.allreduce import all_reduce
from lowbit.localsgd.fragments import _Fragment, _merge, _pseudo_gradient, _reset


class _Rounds:
    """The outer rounds of :class:`~lowbit.localsgd.LocalSGD` (a mixin: the attributes it reads are set by
    :meth:`LocalSGD._configure <lowbit.localsgd.core.LocalSGD._configure>`)."""

    def _sync(self, f: int) -> None:
        """The synchronous round of fragment ``f``, at once."""
        fr = self._frags[f]
        delta = self._scratch[: fr.padded]  # (padded,) float32
        with torch.no_grad():
            _pseudo_gradient(fr, delta)  # 1. anchor - current
            self._exchange(f, delta)  # 2. the mean across groups, this rank's chunk
            self._gather_chunks(fr, delta)  # ... and the chunks put together inside the group
            self._outer_step(fr, delta)  # 3. the outer step (skipped for a non-finite mean)
            _reset(fr)  # 4. the parameters become the new anchor

    def _issue(self, f: int) -> None:
        """Overlap: form fragment ``f``'s pseudo-gradient now and issue its exchange; it lands
        ``overlap`` inner steps later (:meth:`_land`)."""
        fr = self._frags[f]
        delta = torch.empty(fr.padded, dtype=torch.float32, device=fr.anchor.device)
        with torch.no_grad():
            _pseudo_gradient(fr, delta)
            handle = self._exchange(f, delta, async_op=True)
        self._pending[f] = [handle, delta, self._step + self.config.overlap]

    def _land(self, f: int) -> None:
        """Overlap: fragment ``f``'s exchange has had its ``overlap`` steps: wait for it, gather the chunks
        inside the group, step the anchor and mix the parameters with it."""
        handle, delta, _ = self._pending.pop(f)
        if handle is not None:
            handle.wait()
        fr = self._frags[f]
        with torch.no_grad():
            self._gather_chunks(fr, delta)
            self._outer_step(fr, delta)
            _merge(fr, self.config.mix)

    def _exchange(self, f: int, delta: torch.Tensor, async_op: bool = False) -> Any:
        """This rank's chunk of ``delta`` averaged across groups, in place (its bytes in the stats, those
        between groups in ``bytes_inter``); the handle with ``async_op``, else None (also with one group)."""
        if self._solo:
            return None
        c = self._frags[f].padded // self._chunks
        before = self.stats.bytes_sent
        handle = all_reduce(delta[self._local * c : (self._local + 1) * c], self.codec, group=self._cross,
                            algorithm=self.config.algorithm, op="mean", feedback=self.feedback, key=f,
                            seed=self._step, stats=self.stats, async_op=async_op)
        self.stats.bytes_inter += self.stats.bytes_sent - before
        return handle

    def _gather_chunks(self, fr: _Fragment, delta: torch.Tensor) -> None:
        """The chunks of the mean that the ranks of a group reduced across groups, put together."""
        if not self._solo and self._chunks > 1:
            c = fr.padded // self._chunks
            send = delta[self._local * c : (self._local + 1) * c].clone()
            C.all_gather(delta[: fr.padded], send, self._intra, link=False)
            self.stats.bytes_sent += (self._chunks - 1) * send.numel() * send.element_size()

    def _outer_step(self, fr: _Fragment, delta: torch.Tensor) -> None:
        """The outer optimizer's step on the fragment's anchor; a mean with an Inf or NaN (the same on every
        rank) is skipped."""
        n = fr.numel
        if not bool(torch.isfinite(delta[:n]).all()):
            self.skipped += 1
            return
        fr.anchor.grad = delta[:n]
        for other in self._frags:
            if other is not fr:
                other.anchor.grad = None
        self.outer.step()
        fr.anchor.grad = None
