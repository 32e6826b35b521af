"""Bits on the wire per gradient value, from a number or a lowbit codec spec.

``bits_per_value(spec)`` is ``lowbit.get_codec(spec).bits_per_value(numel)``: the codec's own count,
scales and packing included (a tensor of ``numel`` values; per-tensor overheads at 1 Mi values by
default, as :meth:`lowbit.codecs.base.Codec.bits_per_value`). A number is taken as bits per value.
"""

from __future__ import annotations

import math

from lowbit.codecs.base import get_codec

__all__ = ["bits_per_value", "DEFAULT_NUMEL"]

#: Tensor size at which per-tensor overheads are evaluated (1 Mi values, as Codec.bits_per_value).
DEFAULT_NUMEL = 1 << 20


def bits_per_value(codec: object, numel: int = DEFAULT_NUMEL) -> float:
    """Bits per value for a number (returned as is), a codec spec string or a codec (see module doc)."""
    if isinstance(codec, bool):
        raise ValueError(f"bits per value must be a number or a codec spec, got {codec!r}")
    if isinstance(codec, (int, float)):
        bits = float(codec)
    elif isinstance(codec, str):
        bits = float(get_codec(codec).bits_per_value(numel))  # a ValueError names an unknown codec
    elif hasattr(codec, "bits_per_value"):
        bits = float(codec.bits_per_value(numel))
    else:
        raise ValueError(f"bits per value must be a number or a codec spec, got {codec!r}")
    if not (math.isfinite(bits) and bits > 0):
        raise ValueError(f"bits per value must be a finite number > 0, got {bits!r}")
    return bits
