"""Bits on the wire per gradient value, from a number or a lowbit codec spec.

``bits_per_value(spec)`` asks ``lowbit.get_codec(spec).bits_per_value()`` when the codec registry is
importable (the exact answer: scales and packing included). Without it, a fallback table uses the
codecs' wire formats as DESIGN.md defines them (one float32 scale per bucket or per tensor):

==============================  ==========================================
spec                            bits per value
==============================  ==========================================
``fp32`` / ``fp16`` / ``bf16``  32 / 16 / 16
``qsgd:bits=b,bucket=B``        ``b + 32/B``  (defaults b=8, B=512)
``onebit:bucket=B``             ``1 + 64/B``  (two float32 scales; default B=64)
``dettmers[:bucket=B]``         ``8 + 32/B``; per tensor (B=0): ``8 + 32/numel``
``topk:ratio=r``                ``64 r``  (float32 value + int32 index)
==============================  ==========================================
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["bits_per_value", "fallback_bits_per_value", "DEFAULT_NUMEL"]

#: Tensor size at which per-tensor overheads are evaluated (1 Mi values, as Codec.bits_per_value).
DEFAULT_NUMEL = 1 << 20


def _parse(spec: str) -> tuple[str, dict[str, Any]]:
    name, _, rest = spec.strip().partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"codec spec {spec!r}: parameter {item!r} is not of the form key=value")
        try:
            params[k.strip()] = float(v) if any(c in v for c in ".eE") else int(v)
        except ValueError:
            params[k.strip()] = v.strip()
    return name.strip().lower(), params


def fallback_bits_per_value(spec: str, numel: int = DEFAULT_NUMEL) -> float:
    """Bits per value from the wire-format table above (used when lowbit.codecs is not importable)."""
    name, p = _parse(spec)
    if name in ("fp32", "float32", "none"):
        return 32.0
    if name in ("fp16", "bf16", "float16", "bfloat16"):
        return 16.0
    if name == "qsgd":
        bits, bucket = float(p.get("bits", 8)), float(p.get("bucket", 512))
        if bits <= 0 or bucket <= 0:
            raise ValueError(f"codec spec {spec!r}: bits and bucket must be > 0")
        return bits + 32.0 / bucket
    if name == "onebit":
        bucket = float(p.get("bucket", 64))
        if bucket <= 0:
            raise ValueError(f"codec spec {spec!r}: bucket must be > 0")
        return 1.0 + 64.0 / bucket
    if name == "dettmers":
        bucket = float(p.get("bucket", 0)) or float(numel)
        return 8.0 + 32.0 / bucket
    if name == "topk":
        ratio = float(p.get("ratio", 0.01))
        if not 0 < ratio <= 1:
            raise ValueError(f"codec spec {spec!r}: ratio must be in (0, 1]")
        return 64.0 * ratio
    raise ValueError(
        f"unknown codec {name!r} (lowbit.codecs not importable here, fallback knows: "
        "fp32, fp16, bf16, qsgd, onebit, dettmers, topk)"
    )


def _registry_bits(spec: str, numel: int) -> float | None:
    try:
        from lowbit import get_codec  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        codec = get_codec(spec)
    except ModuleNotFoundError:  # the registry exists but some codec modules are not built yet
        return None
    return float(codec.bits_per_value(numel))


def bits_per_value(codec: str | float | int, numel: int = DEFAULT_NUMEL) -> float:
    """Bits per value for a number (returned as is) or a codec spec string (see module doc)."""
    if isinstance(codec, bool):
        raise ValueError(f"bits per value must be a number or a codec spec, got {codec!r}")
    if isinstance(codec, (int, float)):
        bits = float(codec)
    elif isinstance(codec, str):
        bits_reg = _registry_bits(codec, numel)
        bits = bits_reg if bits_reg is not None else fallback_bits_per_value(codec, numel)
    elif hasattr(codec, "bits_per_value"):
        bits = float(codec.bits_per_value(numel))
    else:
        raise ValueError(f"bits per value must be a number or a codec spec, got {codec!r}")
    if not (math.isfinite(bits) and bits > 0):
        raise ValueError(f"bits per value must be a finite number > 0, got {bits!r}")
    return bits
