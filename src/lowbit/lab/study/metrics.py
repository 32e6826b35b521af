"""What a run measures, and how.

Per training step, on every rank (CUDA is synchronised at the step's start and end)::

    step      = forward + backward + optimizer step (wall time)                       -> train_s
    exposed   = backward's end - the moment the last parameter gradient was accumulated  -> exposed_comm_s
    compute   = step - exposed                                                          -> compute_s

``exposed`` is the time the training thread spends after autograd has computed every gradient: in
DDP with lowbit's hook that is the last bucket's encode, the wait for the collectives and decodes still
running on lowbit's communication thread, and DDP's copy of the averaged gradients back into ``.grad``.
It is what the communication costs the step. The moment of the last gradient comes from
``register_post_accumulate_grad_hook`` on every parameter (it fires before DDP's own hook for that
parameter), timed with ``time.perf_counter`` on CPU and CUDA events on GPU. Communication that overlaps
the backward pass is *not* in ``exposed``: like the seed's bars, ``compute`` holds forward, backward,
optimizer and whatever encoding/decoding happened while gradients were still being computed.

From lowbit's :class:`~lowbit.comm.allreduce.CommStats` (per-epoch deltas of ``state.stats``), the
thread time of each phase, wherever it ran and whether or not it overlapped the backward pass:

* ``encode_s`` — compensation + encoding (the worker's, on the training thread; the server's
  re-encode in ``scatter_gather``, on the communication thread), and the fp32->fp16 cast of native runs;
* ``comm_s`` — the collectives (all_to_all, all_gather, allreduce);
* ``decode_s`` — decoding and summing;
* ``bytes_sent_per_rank`` — payload bytes this rank put on the wire.

The first ``start_iter`` (2) steps of a run use DDP's plain fp32 allreduce before lowbit takes over
(DDP rebuilds its buckets after the first iteration) and are not in CommStats. All per-rank numbers are
averaged over the ranks; samples are summed over them (samples/s = global samples / mean step time).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from lowbit.env import host

__all__ = ["TailClock", "fwd_bwd_gflop_per_sample", "environment"]


class TailClock:
    """Times the tail of a backward pass: from the last gradient accumulated to ``backward()``'s return.

    Usage per step: ``clock.start()`` before ``backward()``, ``clock.stop()`` right after it, and
    ``clock.tail_s()`` (after a CUDA synchronisation on GPU) for the exposed seconds of that step.
    """

    def __init__(self, params: Iterable[nn.Parameter], cuda: bool) -> None:
        self.cuda = cuda
        self._last: Any = None
        self._end: Any = None
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params if p.requires_grad]

    def _mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _hook(self, _p: torch.Tensor) -> None:
        self._last = self._mark()

    def start(self) -> None:
        self._last = None
        self._end = None

    def stop(self) -> None:
        self._end = self._mark()

    def tail_s(self) -> float:
        if self._last is None or self._end is None:
            return 0.0
        if self.cuda:
            return max(0.0, self._last.elapsed_time(self._end) / 1e3)
        return max(0.0, self._end - self._last)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def fwd_bwd_gflop_per_sample(model_fn: Any, sample: torch.Tensor) -> float | None:
    """Forward + backward GFLOPs per sample, counted by ``torch.utils.flop_counter`` on the meta device.

    ``model_fn()`` builds the model (it is called under ``torch.device("meta")``: no memory, no
    compute); ``sample`` is a real batch whose shape and dtype are used. Matmuls and convolutions are
    counted (the ops that dominate); None if counting fails.
    """
    try:
        from torch.utils.flop_counter import FlopCounterMode

        with torch.device("meta"):
            model = model_fn()
        x = sample[:2].to("meta")
        with FlopCounterMode(display=False) as counter:
            out = model(x)
            out.float().sum().backward()
        return counter.get_total_flops() / x.shape[0] / 1e9
    except Exception:  # noqa: BLE001 - a missing count only leaves a plot point out
        return None


def environment(device: torch.device, launcher: str) -> dict[str, Any]:
    """Where a run ran: versions, processor, threads, load (timings on a busy machine are noisy),
    NCCL variables (:func:`lowbit.env.host`)."""
    return host(device, launcher)
