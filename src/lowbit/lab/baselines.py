"""PyTorch's own DDP communication hooks, as baselines beside lowbit's codecs.

A baseline is named by a spec, as a codec is, under the ``torch:`` prefix::

    torch:ddp                        plain DDP: no hook, its own C++ fp32 allreduce per bucket
    torch:fp16  torch:bf16           default_hooks.fp16_compress_hook / bf16_compress_hook
    torch:powersgd:rank=4            powerSGD_hook.PowerSGDState + powerSGD_hook (error feedback and
    torch:powersgd:rank=4,start_iter=10      warm start on; vanilla fp32 allreduce before start_iter)

    b = get_baseline("torch:powersgd:rank=4")      # b.spec: "torch:powersgd:rank=4,start_iter=2"
    state = register(ddp_model, b)                 # installs torch's hook (none for torch:ddp)
    ... each step: loss.backward(); opt.step(); state.count_step()
    state.stats.bytes_sent                         # what this rank put on the wire (lowbit's CommStats)

The hooks are torch's, registered as a user registers them, so a baseline costs what it costs in anyone's
script. Three things are added only where they are needed:

* **Bytes on the wire** are counted per step by :meth:`BaselineState.count_step` in lowbit's convention
  for a native allreduce (``2 (K-1) / K`` times the tensor a rank contributes, what a ring allreduce sends):
  ``torch:ddp`` 4 bytes a value, fp16 / bf16 2 bytes a value, PowerSGD 4 bytes times the values its own
  counter (``PowerSGDState.total_numel_after_compression``) says it sent that step: ``(n + m) * rank``
  per compressed matrix (each gradient viewed as ``shape[0] x rest``, compressed when that is at least
  ``min_compression_rate`` = 2 times smaller) plus every uncompressed tensor (biases, LayerNorm weights);
  before ``start_iter``, the whole gradient in fp32.
* **gloo and PowerSGD**: PowerSGD issues its second and third allreduce from future callbacks, which on
  gloo run on gloo's threads, so with several buckets the ranks issue collectives in different orders
  and gloo aborts (pytorch/pytorch#58467). On every backend but NCCL the buckets' hooks are therefore
  chained: a bucket's hook runs when the bucket before it has finished, so every rank issues the same
  collectives in the same order. The backward pass is not held up (the chained hook returns at once);
  what is lost is overlap between two buckets' collectives, which one link serialises anyway.
* **An emulated link** (:func:`lowbit.comm.collectives.emulate_link`, CPU / gloo): the hook's future is
  passed through :func:`~lowbit.comm.collectives.through_link`, which holds the emulated link for the
  bytes the bucket's collectives carry, in FIFO order with lowbit's own collectives, so that torch's hooks
  cross the same slow link lowbit's do. ``torch:ddp`` then registers ``default_hooks.allreduce_hook``
  (DDP's fp32 allreduce as a hook), since DDP's C++ allreduce cannot be made to cross it.

No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at registration.
"""

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lowbit.comm import collectives as C
from lowbit.comm.stats import CommStats

__all__ = ["PREFIX", "Baseline", "BaselineState", "is_baseline", "get_baseline", "available_baselines",
           "register", "hook"]

#: The prefix of a baseline's spec, beside the codecs' names.
PREFIX = "torch:"

_KINDS = ("ddp", "fp16", "bf16", "powersgd")
_PARAMS = {"ddp": (), "fp16": (), "bf16": (), "powersgd": ("rank", "start_iter")}
_VALUE_BYTES = {"ddp": 4, "fp16": 2, "bf16": 2}
_NCCL_ONLY = {"bf16": "PyTorch's bf16_compress_hook runs on NCCL only (CUDA 11+, NCCL 2.10+)"}
_MIN_COMPRESSION_RATE = 2  # PowerSGDState's default, which register keeps


def is_baseline(spec: Any) -> bool:
    """Whether ``spec`` names one of PyTorch's hooks (``torch:...``), not a lowbit codec."""
    return isinstance(spec, str) and spec.strip().lower().startswith(PREFIX)


def available_baselines() -> List[str]:
    """The baselines' specs with their parameters' defaults."""
    return ["torch:ddp", "torch:fp16", "torch:bf16", "torch:powersgd:rank=4,start_iter=2"]


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One of PyTorch's DDP hooks. ``rank`` and ``start_iter`` are PowerSGD's (0 for the others)."""

    kind: str
    rank: int = 0
    start_iter: int = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown torch baseline {self.kind!r}; available: {', '.join(available_baselines())}")
        if self.kind == "powersgd":
            for key, low in (("rank", 1), ("start_iter", 2)):
                v = getattr(self, key)
                if isinstance(v, bool) or not isinstance(v, int) or v < low:
                    why = (" (error feedback and warm start need DDP's rebuilt buckets, after step 1)"
                           if key == "start_iter" else "")
                    raise ValueError(f"torch:powersgd: {key} must be an integer >= {low}{why}, got {v!r}")

    @property
    def spec(self) -> str:
        """The canonical spec, every parameter explicit."""
        if self.kind == "powersgd":
            return f"torch:powersgd:rank={self.rank},start_iter={self.start_iter}"
        return f"torch:{self.kind}"

    @property
    def label(self) -> str:
        """Short label for tables and plots."""
        if self.kind == "powersgd":
            start = "" if self.start_iter == 2 else f", from step {self.start_iter}"
            return f"PowerSGD r{self.rank}{start} (torch)"
        return {"ddp": "DDP fp32 (torch)", "fp16": "fp16 hook (torch)", "bf16": "bf16 hook (torch)"}[self.kind]

    @property
    def bits(self) -> float:
        """Bits per gradient value on the wire (NaN for PowerSGD: it depends on the tensors' shapes)."""
        return 8.0 * _VALUE_BYTES[self.kind] if self.kind in _VALUE_BYTES else math.nan

    def compressed_numel(self, shapes: List[Tuple[int, ...]]) -> int:
        """How many of the values of gradients of these shapes cross in fewer than 32 bits: every one for
        the casts, none for plain DDP, the matrices PowerSGD compresses (each viewed as ``shape[0] x rest``,
        when rank-r factors are at least ``min_compression_rate`` = 2 times smaller, as its hook decides)."""
        numels = [math.prod(s) for s in shapes]
        if self.kind in ("fp16", "bf16"):
            return sum(numels)
        if self.kind == "ddp":
            return 0
        out = 0
        for shape, n_all in zip(shapes, numels):
            n = shape[0] if shape else 1
            m = n_all // n if n else 0
            r = min(n, m, self.rank)
            if (n + m) * r * _MIN_COMPRESSION_RATE < n * m:
                out += n_all
        return out

    @property
    def error_feedback(self) -> bool:
        """PowerSGD keeps its own error feedback (``use_error_feedback=True``); the casts have none."""
        return self.kind == "powersgd"


def get_baseline(spec: str) -> Baseline:
    """``"torch:powersgd:rank=4"`` -> ``Baseline("powersgd", 4, 2)``. ValueError naming the problem (and the
    valid baselines) for anything else."""
    if not is_baseline(spec):
        raise ValueError(f"{spec!r} is not a torch baseline (those start with {PREFIX!r}: "
                         f"{', '.join(available_baselines())})")
    rest = spec.strip()[len(PREFIX):]
    kind, _, params = rest.partition(":")
    kind = kind.strip().lower()
    if kind not in _KINDS:
        raise ValueError(f"unknown torch baseline {spec!r}; available: {', '.join(available_baselines())}")
    values: Dict[str, int] = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _PARAMS[kind]:
            known = ", ".join(k + "=" for k in _PARAMS[kind]) or "none"
            raise ValueError(f"torch baseline {spec!r}: unknown parameter {item!r} (its parameters: {known})")
        if key in values:
            raise ValueError(f"torch baseline {spec!r}: parameter {key!r} is given twice")
        try:
            values[key] = int(value.strip())
        except ValueError:
            raise ValueError(f"torch baseline {spec!r}: {key} must be an integer, got {value.strip()!r}") from None
    if kind == "powersgd":
        if "rank" not in values:
            raise ValueError(f"torch baseline {spec!r}: PowerSGD needs its rank (torch:powersgd:rank=4)")
        values.setdefault("start_iter", 2)
    return Baseline(kind, **values)


@dataclasses.dataclass
class BaselineState:
    """What :func:`register` installed: the baseline, torch's hook state (the process group, or the
    ``PowerSGDState``), and lowbit's :class:`~lowbit.comm.stats.CommStats`, of which :meth:`count_step`
    fills ``bytes_sent`` only: torch's hooks neither count their calls nor time their phases (``calls``,
    ``t_encode``, ``t_comm`` and ``t_decode`` stay 0, and ``stats.timing`` False)."""

    baseline: Baseline
    hook_state: Any
    process_group: Optional[dist.ProcessGroup]
    numel: int                  # trainable values: what one step's gradients hold
    world: int
    serial: bool = False        # chain the buckets' hooks (PowerSGD off NCCL: module doc)
    link: bool = False          # pass the hooks' futures through the emulated link
    stats: CommStats = dataclasses.field(default_factory=CommStats)
    steps: int = 0
    _counted: int = 0           # PowerSGD's counter when the last step was counted
    _tail: Any = None           # the last chained bucket's future (serial)

    def count_step(self) -> None:
        """Add one finished training step's collectives and bytes to ``stats`` (call it after each step)."""
        k = self.world
        if self.baseline.kind == "powersgd":
            now = int(self.hook_state.total_numel_after_compression)
            sent, self._counted = now - self._counted, now
            # compressed: P, Q and the uncompressed tensors; before start_iter (nothing counted by torch):
            # its vanilla fp32 allreduce of the whole gradient
            nbytes = 4 * (sent or self.numel)
        else:
            nbytes = _VALUE_BYTES[self.baseline.kind] * self.numel
        self.steps += 1
        if k > 1:
            self.stats.bytes_sent += 2 * (k - 1) * nbytes // k


_TORCH_HOOKS: Dict[str, Callable[..., torch.futures.Future]] = {
    "ddp": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "powersgd": powerSGD_hook.powerSGD_hook,
}


def register(ddp_model: nn.Module, baseline: Any, *, process_group: Optional[dist.ProcessGroup] = None,
             ) -> BaselineState:
    """Install ``baseline`` (a :class:`Baseline` or its spec) on the DDP model and return its state.

    torch's hook is registered as it is, except where the module doc says otherwise (PowerSGD off NCCL,
    an emulated link). ``torch:ddp`` installs nothing (unless the link is emulated)."""
    b = baseline if isinstance(baseline, Baseline) else get_baseline(baseline)
    module = getattr(ddp_model, "module", None)
    if module is None or not hasattr(ddp_model, "register_comm_hook"):
        raise ValueError("lowbit.lab.baselines.register expects a torch.nn.parallel.DistributedDataParallel model")
    group = process_group if process_group is not None else getattr(ddp_model, "process_group", None)
    world = C.world(group)[1]
    numel = sum(p.numel() for p in module.parameters() if p.requires_grad)
    link = C.link_emulated()
    if b.kind == "powersgd":
        hook_state: Any = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=b.rank, start_powerSGD_iter=b.start_iter,
            min_compression_rate=_MIN_COMPRESSION_RATE, use_error_feedback=True, warm_start=True)
    else:
        hook_state = group
    backend = dist.get_backend(group) if dist.is_initialized() else ""
    if b.kind in _NCCL_ONLY and backend != "nccl":
        raise ValueError(f"torch:{b.kind}: {_NCCL_ONLY[b.kind]}; this group's backend is "
                         f"{backend or 'not initialised'} (torch:fp16 runs on gloo)")
    state = BaselineState(b, hook_state, group, numel, world, link=link,
                          serial=b.kind == "powersgd" and world > 1 and backend != "nccl")
    if b.kind == "ddp" and not link:
        return state  # plain DDP: its own C++ allreduce
    if state.serial or state.link:
        ddp_model.register_comm_hook(state, hook)
    else:
        ddp_model.register_comm_hook(hook_state, _TORCH_HOOKS[b.kind])
    return state


def hook(state: BaselineState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's hook for ``state``'s baseline, chained after the previous bucket (``state.serial``) and
    across the emulated link (``state.link``)."""
    if not state.serial:
        return _run(state, bucket)
    result: torch.futures.Future = torch.futures.Future()
    prev, state._tail = state._tail, result

    def start(_: Any = None) -> None:
        try:
            inner = _run(state, bucket)
        except BaseException as exc:  # noqa: BLE001 — handed to DDP through the future
            result.set_exception(exc)
            return

        def finish(_: torch.futures.Future) -> None:
            try:
                result.set_result(inner.value())
            except BaseException as exc:  # noqa: BLE001
                result.set_exception(exc)

        # on lowbit's completion thread, not gloo's: a Python callback on gloo's C++ thread can abort the
        # process at exit (lowbit.comm.collectives.on_lowbit_thread, issue 44)
        C.on_lowbit_thread(inner).then(finish)

    if prev is None:
        start()
    else:
        prev.then(start)  # (at once when it is done: the last bucket of the step before)
    return result


def _run(state: BaselineState, bucket: dist.GradBucket) -> torch.futures.Future:
    """torch's hook on one bucket; with an emulated link, the link held for the bytes it sends."""
    b = state.baseline
    before = int(getattr(state.hook_state, "total_numel_after_compression", 0))
    fut = _TORCH_HOOKS[b.kind](state.hook_state, bucket)
    if not state.link:
        return fut
    if b.kind == "powersgd":
        sent = int(state.hook_state.total_numel_after_compression) - before
        nbytes = 4 * (sent or bucket.buffer().numel())
    else:
        nbytes = _VALUE_BYTES[b.kind] * bucket.buffer().numel()
    return C.through_link(fut, nbytes, "all_reduce", state.process_group)
