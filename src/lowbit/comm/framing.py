"""Messages on the wire: how a payload sits in its slot, and the buffers the collectives reuse.

A message is a run of slots, one per payload, each a multiple of 16 bytes with the payload's code stream on
a 16-byte boundary (:func:`_slot`); :func:`_framed` builds one from its parts in a single copy. Receive
buffers of CPU collectives come from a small pool (:class:`_Pool`). Shared by every collective that frames
payloads: the flat algorithms (:mod:`lowbit.comm.flat`), the gathers and FSDP.
"""

from __future__ import annotations

import threading

import torch

from lowbit.codecs.base import Codec
from lowbit.comm import collectives as C

__all__ = ["ALIGN", "chunk_sizes"]


def chunk_sizes(n: int, k: int) -> list[int]:
    """Split n values into k nearly equal chunks (the first n % k get one more)."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _keep(t: torch.Tensor) -> None:
    """Tell the caching allocator that ``t`` (allocated on another stream) is used on the current one.
    (Not while a CUDA graph is captured: the callbacks then run on the capturing stream itself.)"""
    if t.is_cuda and not C.capturing():
        t.record_stream(torch.cuda.current_stream(t.device))


#: Message slots start, and payload code streams sit, on 16-byte boundaries: the kernels then read and
#: write the codes in 16-byte vectors on every rank's slice of a receive buffer (a misaligned slice
#: makes Triton fall back to narrow loads).
ALIGN = 16


def _slot(codec: Codec, m: int, shape: tuple[int, ...] | None = None) -> tuple[int, int]:
    """(lead, size) of the message slot of an m-value payload (of ``shape``, default flat): ``lead`` zero
    bytes put its code stream on a 16-byte boundary, and ``size`` (a multiple of 16) holds lead +
    payload + tail padding."""
    shape = shape if shape is not None else codec.flat_shape(m)
    lead = -codec.head_bytes(m, shape) % ALIGN
    return lead, _up(lead + codec.nbytes(m, shape))


def _up(b: int) -> int:
    return -(-b // ALIGN) * ALIGN


class _Pool:
    """Receive buffers for CPU collectives, reused across calls: a large fresh CPU allocation comes back
    from the OS as untouched pages, and faulting them in costs more than decoding into them (22 ms vs
    5 ms for 16M values on a 2-core VM). A buffer is taken when a collective is issued and given back
    once its data has been decoded; several calls in flight each hold their own. (CUDA tensors use torch's
    caching allocator, which already reuses memory per stream.)"""

    def __init__(self) -> None:
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        with self.lock:
            stack = self.free.get((numel, dtype))
            if stack:
                return stack.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            return
        with self.lock:
            stack = self.free.setdefault((t.numel(), t.dtype), [])
            if len(stack) < 4:  # a few per size: calls in flight at once
                stack.append(t)


_POOL = _Pool()

_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zeros(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` zero bytes (a view of one read-only buffer per device, grown when a pad is longer)."""
    z = _ZEROS.get(device)
    if z is None or z.numel() < nbytes:
        z = _ZEROS[device] = torch.zeros(max(2 * ALIGN, nbytes), dtype=torch.uint8, device=device)
    return z[:nbytes]


def _framed(parts: list[tuple[int, torch.Tensor, int]], device: torch.device) -> torch.Tensor:
    """One contiguous message from (lead, bytes, slot size) parts, zero-padded: a single copy kernel."""
    pieces = []
    for lead, payload, size in parts:
        if lead:
            pieces.append(_zeros(lead, device))
        pieces.append(payload)
        tail = size - lead - payload.numel()
        if tail:
            pieces.append(_zeros(tail, device))
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=device)
