"""What lowbit's collectives cost, as they run: calls, bytes put on the wire, and (opt-in) phase times."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CommStats"]


@dataclasses.dataclass
class CommStats:
    """Accumulated cost of compressed collectives: calls, bytes this rank put on the wire, and (only when
    ``timing`` is on) seconds in encode / communicate / decode.

    Bytes are counted from the payload buffers actually handed to torch.distributed (not the 8-byte
    fingerprint of :func:`all_reduce`'s per-call check); ``bytes_inter`` is the part
    the hierarchical algorithm sent between nodes. Timing is opt-in: on CUDA
    it synchronises the device around each phase (a profiling mode that serialises the pipeline); on
    CPU it reads the clock only (``t_comm`` is then the time from issuing a collective to its data
    being there, queueing behind earlier collectives included).
    """

    calls: int = 0
    bytes_sent: int = 0
    #: of ``calls`` / ``bytes_sent``, the plain fp32 allreduces before compression starts (lowbit.ddp: the
    #: first ``start_iter`` steps, DDP's bucket rebuild): the compressed cost per call is
    #: ``(bytes_sent - warmup_bytes) / (calls - warmup_calls)``
    warmup_calls: int = 0
    warmup_bytes: int = 0
    bytes_inter: int = 0  # of bytes_sent, what went to other nodes (algorithm="hierarchical" only)
    t_encode: float = 0.0
    t_comm: float = 0.0
    t_decode: float = 0.0
    timing: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Timer:
    """Adds wall time to a CommStats field when its ``timing`` is on (after a device sync on CUDA)."""

    __slots__ = ("stats", "field", "cuda", "t0")

    def __init__(self, stats: CommStats | None, field: str, device: torch.device) -> None:
        self.stats = stats if stats is not None and stats.timing else None
        self.field, self.cuda = field, device.type == "cuda"

    def __enter__(self) -> None:
        if self.stats is not None:
            if self.cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.stats is not None:
            if self.cuda:
                torch.cuda.synchronize()
            setattr(self.stats, self.field, getattr(self.stats, self.field) + time.perf_counter() - self.t0)


def _comm_clock(stats: CommStats | None, work: object, device: torch.device) -> Callable[[], None]:
    """Timing of a collective: on CUDA wait for it now (timing mode only); on CPU return a stamp that the
    completion callback calls, so t_comm spans issue to arrival without blocking anyone."""
    if stats is None or not stats.timing:
        return lambda: None
    t0 = time.perf_counter()
    if device.type == "cuda":
        if hasattr(work, "wait"):
            work.wait()  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        stats.t_comm += time.perf_counter() - t0
        return lambda: None

    def stamp() -> None:
        stats.t_comm += time.perf_counter() - t0

    return stamp
