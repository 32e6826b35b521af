"""The one clock of ``codec="auto"``: every time it measures (a step, a gradient's readiness, a probe)
is read through a :class:`Clock`, so a test or a replay injects its own (``clock=`` of both tuners).

A point on the compute timeline is a CUDA event recorded on the current stream on a GPU (read without
synchronising until it is needed), the host clock on a CPU. A probe of a collective (:meth:`Clock.
best_of`) is timed on the host with the device synchronised around it: its kernels run on the
communication streams, which no event on the compute stream would bound.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import torch

__all__ = ["Clock", "DeviceClock"]


class Clock(Protocol):
    """What ``codec="auto"`` reads time from."""

    def mark(self) -> Any:
        """A point in time, now (opaque: pass it to :meth:`elapsed`)."""
        ...

    def elapsed(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b``."""
        ...

    def best_of(self, fn: Callable[[], Any], reps: int = 5) -> float:
        """Seconds of the fastest of ``reps`` runs of ``fn`` (after one run to warm up)."""
        ...


class DeviceClock:
    """The clock of a device: CUDA events on the current stream on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def mark(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float:
        if isinstance(a, float):
            return b - a
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def best_of(self, fn: Callable[[], Any], reps: int = 5) -> float:
        fn()  # warm-up: kernels compiled, buffers allocated
        out = []
        for _ in range(reps):
            self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            out.append(time.perf_counter() - t0)
        return min(out)  # the least disturbed run: other processes share these cores and links

    def __repr__(self) -> str:
        return f"DeviceClock({str(self.device)!r})"
