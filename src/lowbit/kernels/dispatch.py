"""Choose a kernel backend per call.

* CUDA tensors: the Triton kernels (:mod:`lowbit.kernels.triton`); if Triton cannot be imported,
  the torch reference, with one warning.
* CPU tensors: the numba kernels (:mod:`lowbit.kernels.numba`) when numba is installed and the tensor
  is large enough to repay the call overhead; otherwise the torch reference.

``LOWBIT_KERNELS=reference|numba|triton`` forces a backend (tests use it to compare backends); any
other value is a ValueError naming these, and ``triton`` for a CPU tensor needs ``TRITON_INTERPRET=1``
(Triton's interpreter; without it Triton has no device to run on). Every backend produces the same wire
format as :mod:`lowbit.kernels.reference`, the executable specification.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import functools
import importlib
import os
import sys
import threading
import warnings
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from lowbit.kernels import reference as ref

#: Below this many elements the reference is used on CPU (a numba call costs a few microseconds).
NUMBA_MIN_NUMEL = 4096
#: The compiled backends: packages of one module per codec family, imported on first use.
_TRITON = "lowbit.kernels.triton"
_NUMBA = "lowbit.kernels.numba"
#: The values of ``$LOWBIT_KERNELS`` ("" or unset: choose per tensor).
KERNEL_CHOICES = ("reference", "numba", "triton")


def _forced() -> str:
    forced = os.environ.get("LOWBIT_KERNELS", "").strip().lower()
    if forced and forced not in KERNEL_CHOICES:
        raise ValueError(f"LOWBIT_KERNELS={os.environ['LOWBIT_KERNELS']!r} is not a kernel backend; use one of "
                         f"{', '.join(KERNEL_CHOICES)} (or leave it unset to choose per tensor)")
    return forced


@functools.lru_cache(maxsize=None)
def _load(modname: str) -> ModuleType | None:
    try:
        return importlib.import_module(modname)
    except Exception as exc:  # ImportError, or a backend that fails to initialise
        if modname == _TRITON:
            warnings.warn(
                f"lowbit: Triton kernels unavailable ({type(exc).__name__}: {exc}); CUDA tensors use the "
                "slower torch reference kernels",
                RuntimeWarning,
                stacklevel=3,
            )
        return None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip() not in ("", "0")


def check_environment() -> None:
    """``$LOWBIT_KERNELS`` checked before any work (the CLI calls this first): ValueError for a value that
    is not a backend, or for ``triton`` where no CUDA device is and Triton's interpreter is off."""
    if _forced() == "triton" and not torch.cuda.is_available() and not _interpreted():
        raise ValueError("LOWBIT_KERNELS=triton needs a CUDA device, and this machine has none; set "
                         "TRITON_INTERPRET=1 to run Triton's kernels in its interpreter on CPU, or use "
                         "LOWBIT_KERNELS=numba or reference")


def backend_for(x: torch.Tensor, op: str) -> Any:
    """The module that implements ``op`` for tensor ``x`` (the reference module if no faster one does)."""
    forced = _forced()
    if forced == "reference":
        return ref
    if forced == "triton" and not x.is_cuda and not _interpreted():
        raise ValueError(f"LOWBIT_KERNELS=triton: Triton's kernels run on CUDA tensors, this one is on "
                         f"{x.device.type}; set TRITON_INTERPRET=1 to run them in Triton's interpreter, or use "
                         "LOWBIT_KERNELS=numba or reference")
    if x.is_cuda or forced == "triton":
        mod = _load(_TRITON) if (x.is_cuda or forced == "triton") else None
        if mod is not None and hasattr(mod, op):
            return mod
        return ref
    if x.device.type == "cpu" and (forced == "numba" or x.numel() >= NUMBA_MIN_NUMEL):
        mod = _load(_NUMBA)
        if mod is not None and hasattr(mod, op):
            return mod
    return ref


def qsgd_encode(x: torch.Tensor, bits: int, bucket: int, norm: str, stochastic: bool, seed: int | torch.Tensor,
                full: bool = False) -> torch.Tensor:
    mod = backend_for(x, "qsgd_encode")
    if isinstance(seed, torch.Tensor) and not hasattr(mod, "signed_key"):
        raise ValueError("qsgd encode: a device key (a seed tensor) needs the Triton kernels (CUDA); "
                         f"this call runs {mod.__name__}")
    return mod.qsgd_encode(x, bits, bucket, norm, stochastic, seed, full)


def signed_keys(seeds: Sequence[int]) -> list[int]:
    """The rounding keys of ``seeds`` as the int32 values a device key tensor holds."""
    return [(k - (1 << 32)) if k >= (1 << 31) else k for k in (ref.seed_key(s) for s in seeds)]


def write_keys(keys: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
    """Write the rounding keys of ``seeds`` into ``keys`` (int32, on any device), for encodes whose seed is
    read from device memory (:meth:`lowbit.codecs.qsgd.QSGD.encode` with a tensor seed). One ``fill_`` a
    key: a kernel launch with the value as its argument, no copy from host memory (a copy from pageable
    memory would wait for the stream)."""
    for i, k in enumerate(signed_keys(seeds)):
        keys[i].fill_(k)
    return keys


def qsgd_decode(payload: torch.Tensor, n: int, bits: int, bucket: int, out: torch.Tensor,
                full: bool = False) -> torch.Tensor:
    return backend_for(out, "qsgd_decode").qsgd_decode(payload, n, bits, bucket, out, full)


def onebit_encode_buckets(x: torch.Tensor, bucket: int) -> torch.Tensor:
    return backend_for(x, "onebit_encode_buckets").onebit_encode_buckets(x, bucket)


def onebit_decode_buckets(payload: torch.Tensor, n: int, bucket: int, out: torch.Tensor) -> torch.Tensor:
    return backend_for(out, "onebit_decode_buckets").onebit_decode_buckets(payload, n, bucket, out)


def onebit_encode_columns(x: torch.Tensor, rows: int) -> torch.Tensor:
    return backend_for(x, "onebit_encode_columns").onebit_encode_columns(x, rows)


def onebit_decode_columns(payload: torch.Tensor, n: int, rows: int, out: torch.Tensor) -> torch.Tensor:
    return backend_for(out, "onebit_decode_columns").onebit_decode_columns(payload, n, rows, out)


def qsgd_decode_sum(payloads: list[torch.Tensor], n: int, bits: int, bucket: int, out: torch.Tensor,
                    divide_by: int = 1, full: bool = False) -> torch.Tensor | None:
    """Fused decode-and-accumulate, then ``out.div_(divide_by)`` in the same pass, when a compiled
    backend has one; None means "decode one by one"."""
    mod = compiled_backend(out, "qsgd_decode_sum")
    if mod is None:
        return None
    return mod.qsgd_decode_sum(payloads, n, bits, bucket, out, divide_by=divide_by, full=full)


#: Values of a warm-up tensor: enough that the compiled kernels, not the reference, are chosen.
_WARM_NUMEL = 2 * NUMBA_MIN_NUMEL
_WARMED: set[str] = set()


def warm_up(codec: Any, device: str | torch.device = "cpu") -> None:
    """Compile, or load from numba's on-disk cache, every kernel ``codec`` (a :class:`lowbit.Codec`) runs
    on ``device``: one encode, decode and decode-and-sum of a small tensor; once per codec and device in a
    process.

    A kernel compiles on its first call in a process that finds no cache: tens of seconds for 1bitSGD or
    QSGD on a loaded machine. Inside a collective that happens between two exchanges, so a rank that
    compiles faster waits for the other, and a short process-group timeout can expire. Call this before
    the first collective (``lowbit study`` does, for its codecs, before it starts any worker; numba's
    cache then serves the workers): docs/kernels.md, "First use"."""
    key = f"{codec.spec}@{torch.device(device)}"
    if key in _WARMED:
        return
    n = _WARM_NUMEL
    # Under the CPU as the default device, as a training step runs: a model built under ``with
    # torch.device("meta")`` (or "cuda") calls register, and so this, with another default set (a CPU
    # generator then meets a CUDA default; a codec's table built from numpy lands on the GPU).
    with torch.device("cpu"):
        x = torch.randn(n, generator=torch.Generator().manual_seed(0), device="cpu").to(device)  # (n,) float32
        shape = codec.flat_shape(n)
        payload = codec.encode(x, seed=0)
        codec.decode(payload, n, shape=shape)
        codec.decode_sum([payload, payload], n, shape=shape, divide_by=2)
    _WARMED.add(key)


#: Seconds a warm-up runs before it says that it is compiling (numba's cache loads in less).
SAY_COMPILING_AFTER_S = 2.0


def warm_up_for(codecs: Iterable[Any], tensors: Iterable[torch.Tensor]) -> None:
    """:func:`warm_up` every codec of ``codecs`` (:class:`lowbit.Codec` objects; None is skipped) on every
    device of ``tensors`` (a model's parameters) whose exchanges reach the compiled kernels: CUDA, and CPU
    when the tensors there hold at least ``NUMBA_MIN_NUMEL`` values. ``lowbit.ddp.register`` and
    ``lowbit.fsdp.register`` call it, so that no training step compiles (a first run once took 412 ms a
    step for its first 90 s, then 26 ms, the compile inside ``t_encode`` and samples/s). Numba caches the
    machine code on disk: a later process loads it in about a second. When the warm-up outlasts
    ``SAY_COMPILING_AFTER_S`` (a first use: a compile, about a minute on 2 cores), one line on stderr, on
    rank 0, says so."""
    numel: dict[torch.device, int] = {}
    for t in tensors:
        numel[t.device] = numel.get(t.device, 0) + t.numel()
    devices = [d for d, n in numel.items() if d.type == "cuda" or (d.type == "cpu" and n >= NUMBA_MIN_NUMEL)]
    unique = {c.spec: c for c in codecs if c is not None}
    todo = [(c, d) for c in unique.values() for d in devices if f"{c.spec}@{d}" not in _WARMED]
    if not todo:
        return
    names = ", ".join(dict.fromkeys(c.spec for c, _ in todo))
    where = "/".join(dict.fromkeys(d.type for _, d in todo))

    def say() -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"lowbit: compiling lowbit's {where} kernels once ({names}): about a minute; they are cached "
                  "on disk for later runs", file=sys.stderr, flush=True)

    timer = threading.Timer(SAY_COMPILING_AFTER_S, say)
    timer.daemon = True
    timer.start()
    try:
        for codec, device in todo:
            warm_up(codec, device)
    finally:
        timer.cancel()


def compiled_backend(x: torch.Tensor, op: str) -> Any | None:
    """The compiled module (Triton on CUDA, numba on CPU) with ``op`` for ``x``; None: use the codec's
    own torch path."""
    mod = backend_for(x, op)
    return None if mod is ref else mod
