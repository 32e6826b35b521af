"""Dettmers' 8-bit types as data: the 2015 value tables, the code -> magnitude maps, and the host-side
tables of the compiled kernels (Triton and numba). The one module of these numbers; the ``dettmers``
codec, the reference kernels and every compiled backend read them from here.

Dettmers' 2015 8-bit tables, copied from the published code (see shared/reference).

* ``DYNAMIC_TREE``: the 126 magnitudes of the dynamic tree (``8bit_floats.npy`` of multigpupy, identical
  to clusterNet's ``8bit_floats.hdf5``), float32. Code c in 0..125 decodes to DYNAMIC_TREE[c] * absmax,
  126 to 0, 127 to absmax; bit 7 is the sign.
* ``LINEAR``: k/127, k = 0..127 (``data_linear`` of the cuda-convnet2 fork).
* ``MANTISSA``: ``data_standard``, m * 10^(e-6) with a 4-bit integer mantissa (exponent offset 0).
* ``STATIC_TREE``: ``data_optimal``, the static bisection tree per decade (exponent offset 0).

The numbers are data, not code: they define the wire format of the ``dettmers`` codec.

Host-side tables of Dettmers' 8-bit types for the compiled kernels (Triton and numba).

``host_tables(type_, offset)`` gives, for the codec's nearest search, a cell table indexed by the top
bits of a value's order-preserving integer key (one gather and one compare per value; see
:mod:`lowbit.kernels.triton.dettmers`, "Dettmers' nearest search"), the 130-entry table of the 2015
binary search (``search="paper"``), the 256-entry decode table, and the constants the kernels take.
Bit-identical to :func:`lowbit.kernels.reference.dettmers_nearest_codes` (``torch.bucketize`` over
float32 midpoints).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

#: Types whose payload carries one absmax scale per bucket (the others are absolute values).
NORMALISED = ("dynamic", "linear", "dynamic_bnb")
#: The code that decodes to NaN in the types that are not normalised (negative zero's place).
NAN_CODE = 0x80

DYNAMIC_TREE = (
    2.75000002e-06, 7.24999973e-06, 1.87500009e-05, 3.62499995e-05, 5.87499962e-05, 8.62499946e-05,
    0.000143750003, 0.00023125, 0.000318750012, 0.000406250008, 0.000518749992, 0.000656249991,
    0.000793749932, 0.000931249931, 0.00121875003, 0.00165624998, 0.00209375005, 0.00253125001,
    0.00296874996, 0.00340624992, 0.00384375011, 0.00428124983, 0.00484375004, 0.00553125003,
    0.00621874956, 0.00690624956, 0.00759374956, 0.00828124955, 0.00896874908, 0.00965624861,
    0.0110937497, 0.0132812504, 0.0154687501, 0.0176562499, 0.0198437497, 0.0220312495,
    0.0242187493, 0.0264062509, 0.0285937507, 0.0307812504, 0.0329687484, 0.03515625,
    0.0373437516, 0.0395312496, 0.0417187512, 0.0439062491, 0.0467187501, 0.0501562506,
    0.0535937473, 0.0570312478, 0.0604687482, 0.0639062449, 0.0673437491, 0.0707812458,
    0.0742187425, 0.0776562467, 0.0810937434, 0.0845312402, 0.0879687443, 0.0914062411,
    0.0948437378, 0.098281242, 0.10546875, 0.116406247, 0.127343744, 0.138281256,
    0.149218753, 0.16015625, 0.171093747, 0.182031244, 0.192968756, 0.203906253,
    0.21484375, 0.225781247, 0.236718744, 0.247656256, 0.258593738, 0.26953125,
    0.280468762, 0.291406244, 0.302343756, 0.313281238, 0.32421875, 0.335156262,
    0.346093744, 0.357031256, 0.367968738, 0.37890625, 0.389843762, 0.400781244,
    0.411718756, 0.422656238, 0.43359375, 0.444531262, 0.458593756, 0.475781232,
    0.492968738, 0.510156214, 0.52734375, 0.544531226, 0.561718702, 0.578906238,
    0.596093714, 0.61328125, 0.630468726, 0.647656202, 0.664843738, 0.682031214,
    0.69921869, 0.716406226, 0.733593702, 0.750781178, 0.767968714, 0.78515619,
    0.802343667, 0.819531202, 0.836718678, 0.853906155, 0.87109369, 0.888281167,
    0.905468643, 0.922656178, 0.939843655, 0.957031131, 0.974218667, 0.991406143,
)

LINEAR = (
    0.0, 0.007874015748031496, 0.015748031496062992, 0.023622047244094488, 0.031496062992125984, 0.03937007874015748,
    0.047244094488188976, 0.05511811023622047, 0.06299212598425197, 0.07086614173228346, 0.07874015748031496, 0.08661417322834646,
    0.09448818897637795, 0.10236220472440945, 0.11023622047244094, 0.11811023622047244, 0.12598425196850394, 0.13385826771653542,
    0.14173228346456693, 0.14960629921259844, 0.15748031496062992, 0.1653543307086614, 0.1732283464566929, 0.18110236220472442,
    0.1889763779527559, 0.19685039370078738, 0.2047244094488189, 0.2125984251968504, 0.2204724409448819, 0.22834645669291337,
    0.23622047244094488, 0.2440944881889764, 0.25196850393700787, 0.25984251968503935, 0.26771653543307083, 0.2755905511811024,
    0.28346456692913385, 0.29133858267716534, 0.2992125984251969, 0.30708661417322836, 0.31496062992125984, 0.3228346456692913,
    0.3307086614173228, 0.33858267716535434, 0.3464566929133858, 0.3543307086614173, 0.36220472440944884, 0.3700787401574803,
    0.3779527559055118, 0.3858267716535433, 0.39370078740157477, 0.4015748031496063, 0.4094488188976378, 0.41732283464566927,
    0.4251968503937008, 0.4330708661417323, 0.4409448818897638, 0.44881889763779526, 0.45669291338582674, 0.4645669291338583,
    0.47244094488188976, 0.48031496062992124, 0.4881889763779528, 0.49606299212598426, 0.5039370078740157, 0.5118110236220472,
    0.5196850393700787, 0.5275590551181102, 0.5354330708661417, 0.5433070866141733, 0.5511811023622047, 0.5590551181102362,
    0.5669291338582677, 0.5748031496062992, 0.5826771653543307, 0.5905511811023622, 0.5984251968503937, 0.6062992125984252,
    0.6141732283464567, 0.6220472440944882, 0.6299212598425197, 0.6377952755905512, 0.6456692913385826, 0.6535433070866141,
    0.6614173228346456, 0.6692913385826772, 0.6771653543307087, 0.6850393700787402, 0.6929133858267716, 0.7007874015748031,
    0.7086614173228346, 0.7165354330708661, 0.7244094488188977, 0.7322834645669292, 0.7401574803149606, 0.7480314960629921,
    0.7559055118110236, 0.7637795275590551, 0.7716535433070866, 0.7795275590551181, 0.7874015748031495, 0.7952755905511811,
    0.8031496062992126, 0.8110236220472441, 0.8188976377952756, 0.8267716535433071, 0.8346456692913385, 0.84251968503937,
    0.8503937007874016, 0.8582677165354331, 0.8661417322834646, 0.8740157480314961, 0.8818897637795275, 0.889763779527559,
    0.8976377952755905, 0.905511811023622, 0.9133858267716535, 0.9212598425196851, 0.9291338582677166, 0.937007874015748,
    0.9448818897637795, 0.952755905511811, 0.9606299212598425, 0.968503937007874, 0.9763779527559056, 0.984251968503937,
    0.9921259842519685, 1.0,
)

MANTISSA = (
    0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
    0.0, 0.0, 1e-06, 2e-06, 3e-06, 4e-06,
    5e-06, 6e-06, 7e-06, 8e-06, 9e-06, 10e-06,
    1e-05, 1.1e-05, 1.2e-05, 1.3e-05, 1.4e-05, 1.5e-05,
    2e-05, 3e-05, 4e-05, 5e-05, 6e-05, 7e-05,
    8e-05, 9e-05, 0.0001, 0.0001, 0.00011, 0.00012,
    0.00013, 0.00014, 0.00015, 0.0002, 0.0003, 0.0004,
    0.0005, 0.0006, 0.0007, 0.0008, 0.0009, 0.001,
    0.001, 0.0011, 0.0012, 0.0013, 0.0014, 0.0015,
    0.002, 0.003, 0.004, 0.005, 0.006, 0.007,
    0.008, 0.009, 0.01, 0.01, 0.011, 0.012,
    0.013, 0.014, 0.015, 0.02, 0.03, 0.04,
    0.05, 0.06, 0.07, 0.08, 0.09, 0.1,
    0.1, 0.11, 0.12, 0.13, 0.14, 0.15,
    0.2, 0.3, 0.4, 0.5, 0.6, 0.7,
    0.8, 0.9, 1.0, 1.0, 1.1, 1.20,
    1.3, 1.4, 1.5, 2.0, 3.0, 4.0,
    5.0, 6.0, 7.0, 8.0, 9.0, 10.0,
    10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    20.0, 30.0, 40.0, 50.0, 60.0, 70.0,
    80.0, 90.0, 100.0, 110.0, 120.0, 130.0,
    140.0, 150.0,
)

STATIC_TREE = (
    0.0, 1.4375e-06, 1.875e-06, 2.3125e-06, 2.75e-06, 3.1875e-06,
    3.625e-06, 4.0625e-06, 4.5e-06, 5.175e-06, 5.85e-06, 6.525e-06,
    7.2e-06, 7.875e-06, 8.55e-06, 9.225e-06, 1e-05, 1.4375e-05,
    1.875e-05, 2.3125e-05, 2.75e-05, 3.1875e-05, 3.625e-05, 4.0625e-05,
    4.5e-05, 5.175e-05, 5.85e-05, 6.525e-05, 7.2e-05, 7.875e-05,
    8.55e-05, 9.225e-05, 0.0001, 0.00014375, 0.0001875, 0.000231254,
    0.000275, 0.00031875, 0.0003625, 0.00040625, 0.00045, 0.0005175,
    0.000585, 0.0006525, 0.00072, 0.0007875, 0.000855, 0.0009225,
    0.001, 0.0014375, 0.001875, 0.0023125, 0.00275, 0.0031875,
    0.003625, 0.0040625, 0.0045, 0.005175, 0.00585, 0.006525,
    0.0072, 0.007875, 0.00855, 0.009225, 0.01, 0.0143759,
    0.01875, 0.023125, 0.0275, 0.031875, 0.03625, 0.040625,
    0.045, 0.05175, 0.0585, 0.06525, 0.072, 0.07875,
    0.0855, 0.09225, 0.1, 0.14375, 0.1875, 0.23125,
    0.275, 0.31875, 0.3625, 0.40625, 0.45, 0.5175,
    0.585, 0.6525, 0.72, 0.7875, 0.855, 0.9225,
    1.0, 1.4375, 1.875, 2.3125, 2.75, 3.1875,
    3.625, 4.0625, 4.5, 5.175, 5.85, 6.525,
    7.2, 7.875, 8.55, 9.225, 10.0, 14.375,
    18.75, 23.125, 27.5, 31.875, 36.25, 40.625,
    45.0, 51.75, 58.5, 65.25, 72.0, 78.75,
    85.5, 92.25,
)


@functools.lru_cache(maxsize=None)
def bnb_dynamic_map() -> tuple[float, ...]:
    """bitsandbytes' signed ``create_dynamic_map(max_exponent_bits=7, total_bits=8)``: 256 sorted values.

    For i = 0..6 it emits +-10^(i-6) times the midpoints of ``linspace(0.1, 1, 2^i + 1)``, plus 0 and 1.
    """
    data: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1.0, 2**i + 1, dtype=torch.float32)
        means = ((edges[:-1] + edges[1:]) / 2.0).tolist()
        data += [(10.0 ** (i - 6)) * m for m in means]
        data += [-(10.0 ** (i - 6)) * m for m in means]
    data += [0.0, 1.0]
    assert len(data) == 256
    return tuple(float(v) for v in torch.tensor(sorted(data), dtype=torch.float32).tolist())


@functools.lru_cache(maxsize=None)
def magnitudes(type_: str, offset: int) -> tuple[float, ...]:
    """The 128 magnitudes of a sign-magnitude type, indexed by code 0..127 (float32 values)."""
    if type_ == "dynamic":
        vals = list(DYNAMIC_TREE) + [0.0, 1.0]
    elif type_ == "linear":
        vals = list(LINEAR)
    elif type_ == "static":
        vals = [v * 10.0**offset for v in STATIC_TREE]
    elif type_ == "mantissa":
        vals = [v * 10.0**offset for v in MANTISSA]
    else:
        raise ValueError(type_)
    return tuple(torch.tensor(vals, dtype=torch.float32).tolist())


@functools.lru_cache(maxsize=None)
def decode_table(type_: str, offset: int) -> tuple[float, ...]:
    """256-entry lookup table: code -> value (before multiplying by the scale)."""
    if type_ == "dynamic_bnb":
        return bnb_dynamic_map()
    mags = magnitudes(type_, offset)
    lut = list(mags) + [-m for m in mags]
    if type_ not in NORMALISED:
        lut[NAN_CODE] = float("nan")
    return tuple(lut)


def layout(n: int, type_: str, bucket: int) -> tuple[bool, int, int]:
    """(normalised, values per scale, number of scales) of a payload of ``n`` values; ``bucket=0`` means
    one scale for the whole tensor, and types that are not normalised carry none."""
    norm = type_ in NORMALISED
    per = (bucket or n) if norm else n
    return norm, per, ((n + per - 1) // per if norm and n else 0)


@functools.lru_cache(maxsize=None)
def host_tables(type_: str, offset: int) -> dict:
    """Host-side tables of a Dettmers type (torch tensors on the CPU, and the kernels' constants)."""
    signed = type_ == "dynamic_bnb"
    values = list(bnb_dynamic_map()) if signed else list(magnitudes(type_, offset))
    # Exactly reference.dettmers_nearest_codes: sorted unique values, float64 midpoints rounded to float32.
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
        "lut": torch.tensor(decode_table(type_, offset), dtype=torch.float32),
        "consts": dict(SHIFT=shift, KBASE=kbase, NCELL=ncell, PIVOT0=pivot0,
                       SIGNED=signed, DYN=type_ == "dynamic"),
        "lo": lo,
        "hi": hi,
    }


