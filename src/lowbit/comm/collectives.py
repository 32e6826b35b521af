"""The one thin wrapper over torch.distributed: every backend difference lives here.

* gloo wants flat outputs for ``all_gather_into_tensor`` (``(world*n,)``, not ``(world, n)``).
* gloo and NCCL both move ``uint8``; MPI builds of torch may not, so payloads are viewed as they are.
* Results are always read from buffers we allocated, never from a Work's/future's value (whose layout
  differs between gloo and NCCL — the weak spot of PyTorch's built-in quantization hook).
* A failed or timed-out collective surfaces as :class:`CollectiveError` naming the operation, the rank
  and the cause, instead of a bare backend message or a hang.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "world", "all_to_all", "all_gather", "all_reduce_sum", "all_gather_object"]


class CollectiveError(RuntimeError):
    """A collective failed: a peer died, the network broke, or the group's timeout expired."""


def world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) within ``group``; (0, 1) when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _fail(op: str, group: dist.ProcessGroup | None, exc: BaseException) -> CollectiveError:
    rank, size = world(group)
    return CollectiveError(
        f"lowbit: {op} failed on rank {rank} of {size} ({type(exc).__name__}: {exc}). A peer process may "
        "have died or the group's timeout expired; check the other ranks' logs."
    )


_LOCAL = threading.local()


def workspace(tag: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of at least ``numel`` elements, private to the calling thread.

    Large fresh CPU allocations come back from the OS as untouched pages, and faulting them in costs
    more than decoding into them; receive buffers are therefore kept per thread and per tag. The
    contents are garbage. Valid until the same thread asks for the same tag again.
    """
    cache = getattr(_LOCAL, "buffers", None)
    if cache is None:
        cache = _LOCAL.buffers = {}
    key = (tag, dtype, str(device))
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf[:numel]


def all_to_all(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Exchange byte chunks: rank r's chunk i goes to rank i. Returns the received bytes, in rank order
    (in a per-thread workspace: use them before this thread's next all_to_all)."""
    out = workspace("all_to_all", sum(recv_splits), send.dtype, send.device)
    if len(send_splits) == 1:  # world size 1
        out.copy_(send[: out.numel()])
        return out
    try:
        dist.all_to_all_single(out, send, recv_splits, send_splits, group=group)
    except Exception as exc:  # noqa: BLE001 — re-raised with context
        raise _fail("all_to_all_single", group, exc) from exc
    return out


def all_gather(payload: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Concatenation of every rank's equally sized 1-D ``payload``, in rank order (flat).

    The result lives in a per-thread workspace: use it before this thread's next all_gather."""
    _, size = world(group)
    if size == 1:
        return payload.clone()
    out = workspace("all_gather", size * payload.numel(), payload.dtype, payload.device)
    try:
        _gather_fn(out, payload.contiguous(), group=group)
    except Exception as exc:  # noqa: BLE001
        raise _fail("all_gather_into_tensor", group, exc) from exc
    return out


# torch >= 2.12 renames all_gather_into_tensor to all_gather_single (the old name warns).
_gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place native sum allreduce (fp32/fp16/bf16 only: never on quantised bytes)."""
    _, size = world(group)
    if size == 1:
        return t
    try:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    except Exception as exc:  # noqa: BLE001
        raise _fail("all_reduce", group, exc) from exc
    return t


def all_gather_object(obj: object, group: dist.ProcessGroup | None) -> list[object]:
    _, size = world(group)
    if size == 1:
        return [obj]
    out: list[object] = [None] * size
    try:
        dist.all_gather_object(out, obj, group=group)
    except Exception as exc:  # noqa: BLE001
        raise _fail("all_gather_object", group, exc) from exc
    return out


def barrier_device(t: torch.Tensor) -> None:
    """Wait for queued device work on ``t``'s device (CUDA); timing needs it, CPU does not."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)
