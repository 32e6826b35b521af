"""Replaying a fixed-shape exchange as a CUDA graph: the host cost of a call, down to a few launches.

An encoded exchange issues a dozen or more small kernels and a collective from Python (encode, frame,
all-to-all or all-gather, decode, sum, the exact-values patch, the reduction's scale): 0.5-1 ms of host
time a call, against 0.05-0.1 ms for FSDP's own collective, which on a fast link makes the host, not
the wire, decide the step time. FSDP2 calls each module's reduce-scatter and all-gather with the same
shapes every step, so the whole sequence can be captured once and replayed.

:class:`Graphs` keeps, per call signature (the ``key`` its caller gives: shapes, dtypes, group, codec,
the addresses of persistent state such as error-feedback residuals), one CUDA graph:

1. The first ``WARM`` calls run eagerly (``fn(ins, outs, seeds)`` on the caller's tensors): Triton
   compiles its kernels, NCCL makes its communicator, Python-side caches fill.
2. The next call captures ``fn`` on a side stream into the cache's memory pool, over static copies of
   the inputs and outputs (shared by every signature of the same shapes), with its per-call seeds read
   from a static int32 tensor of rounding keys; then it replays.
3. Every later call: copy the inputs in, write this call's keys, replay, copy the outputs out. Four or
   five launches and no Python in the codec path.

Ordering: every replay of one cache runs on the stream of its caller; when that stream differs from the
previous replay's, it first waits for that one, so the static buffers and the pool (shared by the
cache's graphs) are never used by two replays at once.

Where a graph is not possible the call stays eager, for good: a CPU tensor, an emulated link (its thread
holds the wire), a backend that cannot be captured (gloo, MPI: they synchronise the host), a codec whose
seed cannot be read from device memory, or any error while capturing (logged once at INFO). The
eager path and the graph compute the same bits: the graph replays the very kernels of ``fn``.
``LOWBIT_CUDA_GRAPHS=0`` turns graphs off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from lowbit.comm import collectives as C
from lowbit.kernels.dispatch import write_keys

__all__ = ["Graphs", "enabled", "capturable"]

log = logging.getLogger("lowbit.comm.graphs")

#: Eager calls of a signature before it is captured.
WARM = 1
#: Backends whose collectives cannot be captured into a CUDA graph (they block the host).
_HOST_BACKENDS = ("gloo", "mpi", "ucc")

Fn = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[int | torch.Tensor]], None]


def enabled() -> bool:
    """``$LOWBIT_CUDA_GRAPHS`` is not "0"."""
    return os.environ.get("LOWBIT_CUDA_GRAPHS", "1").strip() != "0"


def capturable(device: torch.device, groups: Sequence[dist.ProcessGroup | None]) -> bool:
    """Whether calls on ``device`` over ``groups`` may be captured at all."""
    if not enabled() or device.type != "cuda" or C.link_emulated():
        return False
    for g in groups:
        try:
            backend = str(dist.get_backend(g)).lower()
        except (RuntimeError, ValueError):
            return False
        if backend in _HOST_BACKENDS:
            return False
    return True


@dataclass
class _Entry:
    calls: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    failed: bool = False
    ins: list[torch.Tensor] = field(default_factory=list)
    outs: list[torch.Tensor] = field(default_factory=list)
    keys: torch.Tensor | None = None  # (n_seeds,) int32: this call's rounding keys, written before replay


class Graphs:
    """The CUDA graphs of one kind of call (one comm object, or one direction of a state)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.entries: dict[Hashable, _Entry] = {}
        self._static: dict[tuple, torch.Tensor] = {}  # (role, shape, dtype, device) -> buffer
        self._pool: object | None = None
        self._stream: torch.cuda.Stream | None = None  # the stream of the last replay
        self._side: torch.cuda.Stream | None = None
        self.replays = 0

    def clear(self) -> None:
        """Forget every graph (persistent state they read has moved: a checkpoint load, a codec change)."""
        self.entries.clear()
        self._static.clear()

    def run(self, key: Hashable, fn: Fn, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
            seeds: Sequence[int] = (), keyed: bool = True, static: bool = False) -> None:
        """``fn(ins, outs, seeds)``, eagerly or as a replay of its graph. ``keyed``: ``fn`` accepts its
        seeds as one-element int32 device tensors of rounding keys (else a signature with seeds that
        change between calls stays eager). ``static``: ``ins`` and ``outs`` are persistent buffers, the
        same tensors at every call of ``key`` (their addresses belong in the key): the graph works on
        them directly, with no copy in or out."""
        e = self.entries.get(key)
        if e is None:
            e = self.entries[key] = _Entry()
        if e.graph is None:
            if e.failed or (seeds and not keyed):
                fn(ins, outs, seeds)
                return
            if e.calls < WARM:  # eager, with the keys in device memory as the graph will read them
                e.calls += 1
                dev = (outs[0] if outs else ins[0]).device
                keys = write_keys(torch.empty(len(seeds), dtype=torch.int32, device=dev), seeds)
                fn(ins, outs, [keys[i : i + 1] for i in range(len(seeds))])
                return
            if not self._capture(key, e, fn, ins, outs, len(seeds), static):
                fn(ins, outs, seeds)
                return
        self._replay(e, ins, outs, seeds, static)

    # ------------------------------------------------------------------------------------------
    def _buffer(self, role: str, i: int, t: torch.Tensor) -> torch.Tensor:
        k = (role, i, tuple(t.shape), t.dtype, t.device)
        b = self._static.get(k)
        if b is None:
            b = self._static[k] = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        return b

    def _capture(self, key: Hashable, e: _Entry, fn: Fn, ins: Sequence[torch.Tensor],
                 outs: Sequence[torch.Tensor], n_seeds: int, static: bool = False) -> bool:
        dev = (ins[0] if ins else outs[0]).device
        cur = torch.cuda.current_stream(dev)
        if self._side is None:
            self._side = torch.cuda.Stream(dev)
            self._pool = torch.cuda.graph_pool_handle()
        e.ins = list(ins) if static else [self._buffer("in", i, t) for i, t in enumerate(ins)]
        e.outs = list(outs) if static else [self._buffer("out", i, t) for i, t in enumerate(outs)]
        e.keys = torch.zeros(max(n_seeds, 1), dtype=torch.int32, device=dev)
        graph = torch.cuda.CUDAGraph()
        self._side.wait_stream(cur)
        try:
            with torch.cuda.stream(self._side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    fn(e.ins, e.outs, [e.keys[i : i + 1] for i in range(n_seeds)])
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - any failure leaves this signature eager
            e.failed, e.ins, e.outs, e.keys = True, [], [], None
            log.info("lowbit: %s runs eagerly (no CUDA graph: %s: %s)", self.name, type(exc).__name__, exc)
            cur.wait_stream(self._side)
            return False
        cur.wait_stream(self._side)
        e.graph = graph
        return True

    def _replay(self, e: _Entry, ins: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                seeds: Sequence[int], static: bool = False) -> None:
        dev = e.outs[0].device if e.outs else e.ins[0].device
        cur = torch.cuda.current_stream(dev)
        if self._stream is not None and self._stream != cur:
            cur.wait_stream(self._stream)  # the static buffers and pool are this cache's, one replay at a time
        if not static:
            for s, t in zip(e.ins, ins):
                s.copy_(t)
        if seeds:
            write_keys(e.keys, seeds)
        e.graph.replay()  # type: ignore[union-attr]
        if not static:
            for s, t in zip(e.outs, outs):
                t.copy_(s)
        self._stream = cur
        self.replays += 1
