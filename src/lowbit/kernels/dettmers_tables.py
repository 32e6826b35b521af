"""Host-side tables of Dettmers' 8-bit types for the compiled kernels (Triton and numba).

``host_tables(type_, offset)`` gives, for the codec's nearest search, a cell table indexed by the top
bits of a value's order-preserving integer key (one gather and one compare per value; see
:mod:`lowbit.kernels.triton_kernels`, "Dettmers' nearest search"), the 130-entry table of the 2015
binary search (``search="paper"``), the 256-entry decode table, and the constants the kernels take.
Bit-identical to the codec's ``torch.bucketize`` over its float32 midpoints.
"""

from __future__ import annotations

import functools

import torch

#: Types whose payload carries one absmax scale per bucket (the others are absolute values).
NORMALISED = ("dynamic", "linear", "dynamic_bnb")


def layout(n: int, type_: str, bucket: int) -> tuple[bool, int, int]:
    """(normalised, values per scale, number of scales) of a payload of ``n`` values; ``bucket=0`` means
    one scale for the whole tensor, and types that are not normalised carry none."""
    norm = type_ in NORMALISED
    per = (bucket or n) if norm else n
    return norm, per, ((n + per - 1) // per if norm and n else 0)

@functools.lru_cache(maxsize=None)
def host_tables(type_: str, offset: int) -> dict:
    """Host-side tables of a Dettmers type (torch tensors on the CPU, and the kernels' constants)."""
    import numpy as np

    from lowbit.codecs import dettmers as dm  # late: the codec may import the dispatcher

    signed = type_ == "dynamic_bnb"
    values = list(dm.bnb_dynamic_map()) if signed else list(dm.magnitudes(type_, offset))
    # Exactly the codec's _nearest_codes: sorted unique values, float64 midpoints rounded to float32.
    uniq = sorted(set(values))
    first_code = [values.index(v) for v in uniq]
    sv = torch.tensor(uniq, dtype=torch.float64)
    mids = ((sv[1:] + sv[:-1]) / 2).to(torch.float32).numpy()
    bits = mids.view(np.int32).astype(np.int64)
    mkeys = np.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving integer keys
    assert np.all(np.diff(mkeys) > 0)
    # The coarsest cells (a power of two of keys each) holding at most one midpoint; magnitude entries
    # keep the midpoint's offset in SHIFT <= 18 bits, beside two 7-bit codes.
    shift = 18 if not signed else 23
    while shift > 8 and np.unique(mkeys >> shift, return_counts=True)[1].max() > 1:
        shift -= 1
    kmax = 0x7F800000  # +inf
    kmin = (0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF if signed else 0  # -inf, or +0 for magnitudes
    kbase = kmin >> shift
    ncell = (kmax >> shift) - kbase + 1
    starts = (np.arange(ncell, dtype=np.int64) + kbase) << shift
    p_lo = np.searchsorted(mkeys, starts, side="left")  # midpoints below each cell
    nxt = mkeys[np.minimum(p_lo, len(mkeys) - 1)]
    has_mid = (p_lo < len(mkeys)) & (nxt < starts + (1 << shift))
    mid_off = np.where(has_mid, nxt - starts, (1 << shift) - 1)  # none: no offset is above it
    if signed:
        if first_code != list(range(len(uniq))):
            raise ValueError(f"dettmers {type_}: codes are not sorted positions")
        entry = (p_lo.astype(np.uint64) << 24) | mid_off.astype(np.uint64)
    else:
        codes = np.array(first_code, dtype=np.uint64)
        lo_code = codes[p_lo]
        hi_code = codes[np.minimum(p_lo + 1, len(codes) - 1)]
        entry = (lo_code << 25) | (hi_code << shift) | mid_off.astype(np.uint64)
    cells = entry.astype(np.uint32).view(np.int32)
    # The paper search reads a 130-entry table (index `size` = the 2015 kernel's overread).
    size, pivot0 = (126, 63) if type_ == "dynamic" else (128, 64)
    tbl = list(values[:size]) + [1.0] * (130 - size) if not signed else [0.0] * 130
    scale10 = 10.0**offset
    lo, hi = {"linear": (1.5e-6, 0.990703), "static": (5e-7 * scale10, 93 * scale10),
              "mantissa": (5e-7 * scale10, 150 * scale10)}.get(type_, (0.0, 0.0))
    return {
        "cells": torch.from_numpy(cells.copy()),
        "paper": torch.tensor(tbl, dtype=torch.float32),
        "lut": torch.tensor(dm.decode_table(type_, offset), dtype=torch.float32),
        "consts": dict(SHIFT=shift, KBASE=kbase, NCELL=ncell, PIVOT0=pivot0,
                       SIGNED=signed, DYN=type_ == "dynamic"),
        "lo": lo,
        "hi": hi,
    }


