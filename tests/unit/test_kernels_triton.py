"""Triton kernels against the reference kernels (the wire-format specification).

Without CUDA this runs the kernels in Triton's interpreter (TRITON_INTERPRET=1, set before the
kernels are defined), so CI checks the kernel arithmetic on CPU. The interpreter is slow: sizes are
small and the tile is shrunk (CONFIG) so that both the full-tile and the masked last-tile variants,
and both the fused and the general bucket paths, run at these sizes. The same tests run compiled on a
GPU; tests/gpu/test_triton_gpu.py repeats the comparisons at large sizes there.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import lowbit  # noqa: E402
from lowbit.kernels import reference as ref  # noqa: E402
from lowbit.kernels import triton as tk  # noqa: E402
from lowbit.kernels.triton import common as tkc  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter evaluates NaN/inf inputs with numpy, which warns; the results are what we check.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SIZES = (0, 1, 7, 513, 3000)
#: The default run's sizes (issue 31 item 7: the interpreter costs ~0.1 s per program and helper calls,
#: whatever the tile's size): 0 (no launch) and 333 (a full tile and a masked one of 256, partial
#: buckets of 64 and 100, NaN, +-inf, a negative NaN with a payload, all-zero buckets; see _x). The
#: tests marked slow repeat the checks at SIZES (3000: 12 tiles).
SMALL = (0, 333)
SLOW = pytest.mark.slow
#: n for tests parametrized by size: SMALL in the default run, the rest of SIZES marked slow.
N_PARAMS = [*SMALL, *(pytest.param(n, marks=SLOW) for n in SIZES if n not in SMALL)]


@pytest.fixture(autouse=True, scope="module")
def small_tiles():
    """Tiles of 256 elements (one-scale Dettmers: 4 tiles of 64) and fused buckets up to 256, so small
    tensors take every code path."""
    saved = dict(tk.CONFIG)
    tk.CONFIG.update(elems=256, max_fused_bucket=256, absmax_elems=256, one_scale_elems=64)
    yield
    tk.CONFIG.clear()
    tk.CONFIG.update(saved)


def _x(n: int, seed: int, special: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if special and n > 600:
        x[100:164] = 0.0  # an all-zero bucket (scale 0)
        x[5] = float("nan")
        x[300] = float("inf")
        x[520] = -float("inf")
        x.view(torch.int32)[900] = -0x3EDCBB  # 0xFFC12345: a negative NaN with a payload
    elif special and n >= 333:  # the same specials within the default run's 333 elements
        x[200:320] = 0.0  # all-zero buckets (scale 0): bucket 2 of 100, bucket 4 of 64 (and of 5)
        x[5] = float("nan")
        x[130] = float("inf")
        x[170] = -float("inf")
        x.view(torch.int32)[330] = -0x3EDCBB  # in the last (partial) bucket and the masked tile
    return x.to(DEV)


def _nb(n: int, bucket: int) -> int:
    return (n + bucket - 1) // bucket


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of float tensors (NaN == NaN)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


# ------------------------------------------------------------------------------------- qsgd
def _check_qsgd_max_norm(n: int, bits: int, bucket: int, stochastic_modes: tuple[bool, ...]) -> None:
    x = _x(n, seed=n + bits)
    for stochastic in stochastic_modes:
        want = ref.qsgd_encode(x, bits, bucket, "max", stochastic, seed=n + 11)
        got = tk.qsgd_encode(x, bits, bucket, "max", stochastic, seed=n + 11)
        assert got.dtype == torch.uint8 and got.shape == want.shape
        assert torch.equal(got, want), (n, bits, bucket, stochastic)
    out = torch.full((n,), 12345.0, device=DEV)  # poisoned: every element must be written
    dec = tk.qsgd_decode(want, n, bits, bucket, out)
    assert dec is out
    assert _same(dec, ref.qsgd_decode(want, n, bits, bucket, torch.empty(n, device=DEV)))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [1, 2, 4, 8, 16])
def test_qsgd_encode_decode_bit_identical_max_norm(bits: int) -> None:
    """Fast equivalent: test_qsgd_encode_decode_bit_identical_max_norm_small."""
    # bucket 64: fused tiles; 100 (odd) and 512 (> max_fused_bucket, a multiple of the tile): general path
    for n in SIZES:
        for bucket in (64, 100, 512):
            _check_qsgd_max_norm(n, bits, bucket, (False, True))


@pytest.mark.parametrize(("bits", "bucket", "stochastic"),
                         [(1, 64, True), (2, 100, False), (4, 512, True), (8, 64, False), (16, 100, True)])
def test_qsgd_encode_decode_bit_identical_max_norm_small(bits: int, bucket: int, stochastic: bool) -> None:
    """Stands for the slow test_qsgd_encode_decode_bit_identical_max_norm (every bit width x bucket x
    rounding at SIZES): every packed bit width once, each bucket path (fused 64; general 100 with chunk
    partials; general 512 with the atomic max) and both roundings among them, at the SMALL sizes."""
    for n in SMALL:
        _check_qsgd_max_norm(n, bits, bucket, (stochastic,))


@pytest.mark.parametrize("n", [333, pytest.param(513, marks=SLOW), pytest.param(3000, marks=SLOW)])
def test_qsgd_l2_norm_matches_up_to_summation_order(n: int) -> None:
    """L2 scales are a float32 sum in Triton's order (torch's differs): a few ulps apart, and a code
    moves by at most one level, only in buckets whose scale differs. The default run checks n=333
    (two tiles, partial buckets); 513 and 3000 are marked slow."""
    x = _x(n, seed=7, special=False)
    for bits, bucket, stochastic in ((2, 64, True), (4, 100, False), (8, 256, True), (16, 64, False)):
        nb = _nb(n, bucket)
        want = ref.qsgd_encode(x, bits, bucket, "l2", stochastic, seed=3)
        got = tk.qsgd_encode(x, bits, bucket, "l2", stochastic, seed=3)
        sw, sg = want[: 4 * nb].view(torch.float32), got[: 4 * nb].view(torch.float32)
        torch.testing.assert_close(sg, sw, rtol=2e-6, atol=0)
        cw = ref.unpack_bits(want[4 * nb :], bits, n)
        cg = ref.unpack_bits(got[4 * nb :], bits, n)
        same_scale = torch.repeat_interleave(sw == sg, bucket)[:n]
        assert torch.equal(cw[same_scale], cg[same_scale])
        assert (cw - cg).abs().max().item() <= 1


def _check_qsgd_decode_sum(n: int, bits: int, bucket: int, kd: tuple[tuple[int, int], ...]) -> None:
    ps = [ref.qsgd_encode(_x(n, seed=k, special=False), bits, bucket, "max", True, k) for k in range(11)]
    for k, d in kd:  # k = 11 > MAX_SUM: a second launch accumulates onto the first
        want = ref.qsgd_decode(ps[0], n, bits, bucket, torch.empty(n, device=DEV))
        for p in ps[1:k]:
            want = want + ref.qsgd_decode(p, n, bits, bucket, torch.empty(n, device=DEV))
        # d != 1: the mean in the same pass, as summing and then out.div_(d)
        got = tk.qsgd_decode_sum(ps[:k], n, bits, bucket, torch.full((n,), 7.0, device=DEV), divide_by=d)
        assert _same(got, want.clone().div_(d) if d != 1 else want), (n, bits, bucket, k, d)


@pytest.mark.slow
def test_qsgd_decode_sum_bit_identical_in_order() -> None:
    """Fast equivalent: test_qsgd_decode_sum_bit_identical_in_order_small."""
    for n in (7, 3000):
        for bits, bucket in ((4, 64), (2, 100), (8, 512), (16, 256)):
            _check_qsgd_decode_sum(n, bits, bucket, tuple((k, d) for k in (1, 3, 11) for d in (1, 2, 3, 7)))
    with pytest.raises(ValueError):
        tk.qsgd_decode_sum([], 4, 4, 64, torch.empty(4, device=DEV))


@pytest.mark.parametrize(("n", "bits", "bucket"), [(333, 4, 64), (333, 2, 100), (7, 8, 512), (333, 16, 256)])
def test_qsgd_decode_sum_bit_identical_in_order_small(n: int, bits: int, bucket: int) -> None:
    """Stands for the slow test_qsgd_decode_sum_bit_identical_in_order (n 7 and 3000, every k x d): the
    same bit widths and buckets (fused rows, general, one bucket per row) on two tiles (one for 8 bits),
    1 payload with a mean, 3 without, 11 (> MAX_SUM: a second launch adds onto the first) with one."""
    _check_qsgd_decode_sum(n, bits, bucket, ((1, 2), (3, 1), (11, 7)) if n > 7 else ((3, 3), (11, 1)))
    with pytest.raises(ValueError):
        tk.qsgd_decode_sum([], 4, bits, bucket, torch.empty(4, device=DEV))


def test_qsgd_unaligned_payload_and_fallback_bits() -> None:
    n, bits, bucket = 1000, 4, 64
    x = _x(n, seed=1)
    p = ref.qsgd_encode(x, bits, bucket, "max", True, 5)
    buf = torch.zeros(p.numel() + 1, dtype=torch.uint8, device=DEV)
    buf[1:].copy_(p)  # a payload that starts at an odd address, as a slice of a received buffer may
    want = ref.qsgd_decode(p, n, bits, bucket, torch.empty(n, device=DEV))
    assert _same(tk.qsgd_decode(buf[1:], n, bits, bucket, torch.empty(n, device=DEV)), want)
    assert _same(tk.qsgd_decode_sum([buf[1:], p], n, bits, bucket, torch.empty(n, device=DEV)), want + want)
    for b in (3, 5):  # no packed Triton path: the reference runs
        q = tk.qsgd_encode(x, b, 33, "max", True, 2)
        assert torch.equal(q, ref.qsgd_encode(x, b, 33, "max", True, 2))
        assert _same(tk.qsgd_decode(q, n, b, 33, torch.empty(n, device=DEV)),
                     ref.qsgd_decode(q, n, b, 33, torch.empty(n, device=DEV)))


def test_nan_scales_are_the_canonical_nan() -> None:
    """NaNs of several bit patterns in one bucket: Triton's L2 scales and onebit means are the
    reference's canonical NaN 0x7FC00000 (the fused path: buckets of 64; 16 buckets, 4 tiles)."""
    x = _x(64 * 16, seed=9, special=False)
    bits = x.view(torch.int32)
    for j, pattern in enumerate((0x7FC00000, -0x00400000, 0x7FC00001, 0x7FC00003)):  # -0x400000 = 0xFFC00000
        bits[j * 64 + 5 : j * 64 + 9] = pattern
        bits[(j + 8) * 64 + 1] = pattern
        bits[(j + 8) * 64 + 2] = -0x00400000
    x = x.to(DEV)
    for want, got, nscales in ((ref.qsgd_encode(x, 8, 64, "l2", False, 0), tk.qsgd_encode(x, 8, 64, "l2", False, 0), 16),
                               (ref.onebit_encode_buckets(x, 64), tk.onebit_encode_buckets(x, 64), 32)):
        for p in (want, got):
            sc = p[: 4 * nscales].view(torch.float32)
            nan = torch.isnan(sc)
            assert nan.sum().item() >= 8 and set(sc.view(torch.int32)[nan].tolist()) == {0x7FC00000}
        assert torch.equal(torch.isnan(want[: 4 * nscales].view(torch.float32)),
                           torch.isnan(got[: 4 * nscales].view(torch.float32)))


# ------------------------------------------------------------------------------------- onebit
@pytest.mark.parametrize("n", N_PARAMS)
def test_onebit_buckets(n: int) -> None:
    """Sign bits identical; means within float32 summation-order rounding; decode identical. The
    default run checks the SMALL sizes; the other SIZES are marked slow."""
    x = _x(n, seed=n)
    for bucket in (64, 5, 100):  # fused, and general (means from torch)
        nb = _nb(n, bucket)
        want = ref.onebit_encode_buckets(x, bucket)
        got = tk.onebit_encode_buckets(x, bucket)
        assert got.shape == want.shape
        assert torch.equal(got[8 * nb :], want[8 * nb :]), (n, bucket)
        torch.testing.assert_close(got[: 8 * nb].view(torch.float32), want[: 8 * nb].view(torch.float32),
                                   rtol=1e-6, atol=0, equal_nan=True)
        out = torch.full((n,), 12345.0, device=DEV)
        dec = tk.onebit_decode_buckets(want, n, bucket, out)
        assert _same(dec, ref.onebit_decode_buckets(want, n, bucket, torch.empty(n, device=DEV)))


# ------------------------------------------------------------------------------------- dettmers
DETTMERS = [
    "dettmers",  # dynamic, one scale for the tensor
    "dettmers:bucket=64",
    "dettmers:bucket=100",
    "dettmers:type=linear",
    "dettmers:type=dynamic_bnb,bucket=256",
    "dettmers:type=dynamic_bnb",
    "dettmers:type=static",
    "dettmers:type=mantissa,offset=-2",
    "dettmers:type=dynamic,search=paper",
    "dettmers:type=linear,search=paper,bucket=128",
    "dettmers:type=static,search=paper,offset=1",
    "dettmers:type=mantissa,search=paper",
]


@pytest.mark.parametrize("n", N_PARAMS)
def test_dettmers_bit_identical_to_codec(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every type, search and bucket path. The default run checks the SMALL sizes; the other SIZES are
    marked slow."""
    monkeypatch.setenv("LOWBIT_KERNELS", "reference")
    for spec in DETTMERS:
        codec = lowbit.get_codec(spec)
        x = _x(n, seed=n + 1)
        if not codec.normalised:
            x = x * 10.0 ** (codec.offset - 2)
        want = codec.encode(x)
        got = tk.dettmers_encode(x, codec.type, codec.search, codec.bucket, codec.offset)
        assert torch.equal(got, want), (spec, n, int((got != want).sum()))
        out = torch.full((n,), 12345.0, device=DEV)
        dec = tk.dettmers_decode(want, n, codec.type, codec.bucket, codec.offset, out)
        assert _same(dec, codec.decode(want, n)), (spec, n)


def test_dettmers_nearest_on_every_midpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Values at, just below and just above every midpoint of each table: ties and cell edges."""
    from lowbit.kernels import dettmers_tables as dm

    monkeypatch.setenv("LOWBIT_KERNELS", "reference")
    for spec in ("dettmers", "dettmers:type=linear", "dettmers:type=dynamic_bnb", "dettmers:type=mantissa"):
        codec = lowbit.get_codec(spec)
        vals = dm.bnb_dynamic_map() if codec.type == "dynamic_bnb" else dm.magnitudes(codec.type, codec.offset)
        sv = torch.tensor(sorted(set(vals)), dtype=torch.float64)
        mids = ((sv[1:] + sv[:-1]) / 2).to(torch.float32)
        up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
        down = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
        x = torch.cat([torch.tensor([1.0, -1.0, 0.0, -0.0]), mids, up, down, -mids, -up, -down]).to(DEV)
        want = codec.encode(x)
        got = tk.dettmers_encode(x, codec.type, codec.search, codec.bucket, codec.offset)
        assert torch.equal(got, want), spec


# ------------------------------------------------------------------------------------- plumbing
@pytest.mark.parametrize("n", [333, pytest.param(3000, marks=SLOW)])
def test_dispatch_forced_triton_matches_reference(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the codecs with the Triton backend forced. The default run checks n=333 (two tiles with
    the specials of _x); 3000 is marked slow."""
    x = _x(n, seed=9)
    for spec in ("qsgd:bits=4,bucket=64", "qsgd:bits=8,rounding=nearest,bucket=128", "onebit"):
        codec = lowbit.get_codec(spec)
        monkeypatch.setenv("LOWBIT_KERNELS", "reference")
        want, want_dec = codec.encode(x, seed=4), codec.decode(codec.encode(x, seed=4), n)
        monkeypatch.setenv("LOWBIT_KERNELS", "triton")
        got = codec.encode(x, seed=4)
        if spec == "onebit":  # means: summation order; sign bits exact
            assert torch.equal(got[-(n // 8) :], want[-(n // 8) :])
        else:
            assert torch.equal(got, want), spec
        assert _same(codec.decode(want, n), want_dec), spec


def test_import_raises_importerror_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    for name in [m for m in sys.modules if m == tk.__name__ or m.startswith(tk.__name__ + ".")]:
        monkeypatch.delitem(sys.modules, name)  # import the package afresh (restored afterwards)
    with pytest.raises(ImportError):
        importlib.import_module(tk.__name__)


# ------------------------------------------------------------------ the division shortcut
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _div_probe(x_ptr, s_ptr, out_rows_ptr, out_scalar_ptr, C: tl.constexpr):
    """Rows 2*pid and 2*pid+1 of x (C values each) divided by their s with _div_tile as a 1D tile of two
    buckets, and each row again with a scalar scale (ROWS=1)."""
    pid = tl.program_id(0)
    offs = 2 * pid * C + tl.arange(0, 2 * C)
    s2 = tl.load(s_ptr + 2 * pid + tl.arange(0, 2))
    tl.store(out_rows_ptr + offs, tkc._div_tile(tl.load(x_ptr + offs), s2, 2, C, False, 0.0))
    for k in tl.static_range(2):
        o = (2 * pid + k) * C + tl.arange(0, C)
        tl.store(out_scalar_ptr + o, tkc._div_tile(tl.load(x_ptr + o), tl.load(s_ptr + 2 * pid + k), 1, 1, False,
                                                  0.0))


def test_division_shortcut_rounds_like_true_division() -> None:
    """_div_tile (Markstein's correction of x * (1/s)) gives the correctly rounded x / s
    for every |x| <= s the codecs can meet, at scales spread over the whole float range and at the
    edges of the fast path's range, and follow div_rn outside it (0, inf, NaN, subnormal scales)."""
    import numpy as np

    rng = np.random.default_rng(7)
    C = 256
    scales = [1.0, 2.0**-60, 2.0**-60 * 0.99, 2.0**126 * 0.999, 2.0**126, 2.0**127, 1e-40, 0.0,
              float("inf"), float("nan"), np.float32(1.9999999), np.float32(1.0000001),
              np.float32(3.4e38)]
    scales += list(np.float32(10.0) ** rng.uniform(-18, 37, 40))
    scales += list(np.float32(2.0) ** rng.integers(-60, 126, 8) * np.float32(1.99999988))  # all-ones significand
    if len(scales) % 2:
        scales.append(0.75)
    s = np.array(scales, dtype=np.float32)
    x = np.empty((len(s), C), dtype=np.float32)
    for i, sv in enumerate(s):
        base = sv if np.isfinite(sv) and sv > 0 else np.float32(1.0)
        u = rng.uniform(-1, 1, C).astype(np.float32)
        row = (u * base).astype(np.float32)
        row[:8] = [base, -base, 0.0, -0.0, base * np.float32(2.0**-30), base * np.float32(2.0**-45),
                   np.float32(2.0**-102), np.float32(-(2.0**-110))]
        row[8:40] = (base * rng.uniform(0.5, 1, 32)).astype(np.float32)  # quotients near 1
        x[i] = np.minimum(np.abs(row), base) * np.sign(row)
    xt, st = torch.from_numpy(x).to(DEV), torch.from_numpy(s).to(DEV)
    out_rows, out_scalar = torch.empty_like(xt), torch.empty_like(xt)
    _div_probe[(len(s) // 2,)](xt, st, out_rows, out_scalar, C=C)
    safe = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    with np.errstate(all="ignore"):
        want = (x / safe[:, None]).astype(np.float32)  # numpy float32 division rounds correctly
    for got in (out_rows.cpu().numpy(), out_scalar.cpu().numpy()):
        same = (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))
        # Quotients below 2**-42 may come out as a neighbouring tiny float or the other signed zero.
        tiny = (np.abs(want) < 2.0**-42) & (np.abs(got) < 2.0**-42)
        bad = ~(same | tiny)
        assert not bad.any(), [(float(s[i]), float(x[i, j]), float(got[i, j]), float(want[i, j]))
                               for i, j in zip(*np.nonzero(bad))][:5]
    # The shortcut must really be exact, not merely close: check quotients near 1 bit for bit.
    assert (out_rows.cpu().numpy()[:, 8:40].view(np.int32) == want[:, 8:40].view(np.int32)).all()


def test_qsgd_top_level_rounding_up_is_clamped() -> None:
    """q = 2S (a bucket's maximum) plus a uniform just below 1 rounds up to 2S + 1 in float32; the
    reference's floor-then-clamp keeps code 2S, and so must the kernels (whose fast path drops the other
    checks)."""
    bits, bucket, n = 8, 16, 4096
    s = ref.qsgd_levels(bits)
    hit = None
    for seed in range(400):
        u = ref.uniform(seed, 0, n)
        idx = torch.nonzero(((2 * s + u) == 2 * s + 1)).flatten()
        if idx.numel():
            hit = (seed, int(idx[0]))
            break
    assert hit is not None, "no uniform close enough to 1 in the searched seeds"
    seed, i = hit
    x = _x(n, seed=3, special=False)
    b0 = (i // bucket) * bucket
    x[i] = x[b0 : b0 + bucket].abs().max() * 2 + 1.0  # the bucket's maximum, positive: q = 2S exactly
    x = x.to(DEV)
    want = ref.qsgd_encode(x.cpu(), bits, bucket, "max", True, seed)
    got = tk.qsgd_encode(x, bits, bucket, "max", True, seed).cpu()
    assert int(want[4 * (n // bucket) + i]) == 2 * s
    assert torch.equal(got, want)



@pytest.mark.parametrize("n", [333, pytest.param(3000, marks=SLOW)])
def test_codec_decode_sum_divide_by_on_triton(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the codec and the dispatcher with the Triton backend forced: the fused mean equals
    summing and then out.div_(k), for qsgd (fused in the kernel) and other codecs (divided after).
    The default run checks n=333 (two tiles, partial buckets); 3000 is marked slow."""
    monkeypatch.setenv("LOWBIT_KERNELS", "triton")
    for spec in ("qsgd:bits=4,bucket=64", "qsgd:bits=8,bucket=100", "dettmers:type=dynamic"):
        codec = lowbit.get_codec(spec)
        ps = [codec.encode(_x(n, seed=i, special=False), seed=i) for i in range(3)]
        want = codec.decode_sum(ps, n).clone().div_(3)
        assert _same(codec.decode_sum(ps, n, divide_by=3), want), spec


DM_SUM_SPECS = ("dettmers", "dettmers:bucket=64", "dettmers:bucket=100", "dettmers:type=static",
                "dettmers:type=dynamic_bnb,bucket=256")


def _check_dettmers_decode_sum(spec: str, n: int, kd: tuple[tuple[int, int], ...],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    codec = lowbit.get_codec(spec)
    xs = [_x(n, seed=k) for k in range(11)]
    if not codec.normalised:
        xs = [x * 10.0 ** (codec.offset - 2) for x in xs]
    ps = [codec.encode(x) for x in xs]
    for k, d in kd:
        monkeypatch.setenv("LOWBIT_KERNELS", "reference")  # the codec's own torch decode
        want = codec.decode(ps[0], n)
        for p in ps[1:k]:
            want = want + codec.decode(p, n)
        monkeypatch.delenv("LOWBIT_KERNELS")
        got = tk.dettmers_decode_sum(ps[:k], n, codec.type, codec.bucket, codec.offset,
                                     torch.full((n,), 7.0, device=DEV), divide_by=d)
        assert _same(got, want.clone().div_(d) if d != 1 else want), (spec, n, k, d)


@pytest.mark.slow
def test_dettmers_decode_sum_bit_identical_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused Dettmers decode-and-sum (fused buckets, general buckets, one scale, non-normalised
    types with NaN codes), 1, 3 and 11 payloads (11 > MAX_SUM: chained launches), with and without the
    mean: as decoding one by one, adding in order and then out.div_(d).
    Fast equivalent: test_dettmers_decode_sum_bit_identical_in_order_small."""
    for spec in DM_SUM_SPECS:
        for n in (7, 3000):
            _check_dettmers_decode_sum(spec, n, tuple((k, d) for k in (1, 3, 11) for d in (1, 3)), monkeypatch)
    with pytest.raises(ValueError):
        tk.dettmers_decode_sum([], 4, "dynamic", 0, 0, torch.empty(4, device=DEV))


@pytest.mark.parametrize("spec", DM_SUM_SPECS)
def test_dettmers_decode_sum_bit_identical_in_order_small(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands for the slow test_dettmers_decode_sum_bit_identical_in_order (n 7 and 3000, every k x d):
    the same specs at n=333 (two tiles, the specials of _x), 1 payload with the mean, 3 without, 11
    (> MAX_SUM: chained launches) with it."""
    _check_dettmers_decode_sum(spec, 333, ((1, 3), (3, 1), (11, 3)), monkeypatch)
    with pytest.raises(ValueError):
        tk.dettmers_decode_sum([], 4, "dynamic", 0, 0, torch.empty(4, device=DEV))


def _check_onebit_decode_sum(bucket: int, n: int, kd: tuple[tuple[int, int], ...]) -> None:
    ps = [ref.onebit_encode_buckets(_x(n, seed=k), bucket) for k in range(11)]
    for k, d in kd:
        want = ref.onebit_decode_buckets(ps[0], n, bucket, torch.empty(n, device=DEV))
        for p in ps[1:k]:
            want = want + ref.onebit_decode_buckets(p, n, bucket, torch.empty(n, device=DEV))
        got = tk.onebit_decode_sum_buckets(ps[:k], n, bucket, torch.full((n,), 7.0, device=DEV), divide_by=d)
        assert _same(got, want.clone().div_(d) if d != 1 else want), (bucket, n, k, d)


def _check_onebit_codec_decode_sum(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    codec = lowbit.get_codec("onebit:bucket=64")
    ps = [codec.encode(_x(n, seed=k)) for k in range(3)]
    monkeypatch.setenv("LOWBIT_KERNELS", "reference")
    want = codec.decode_sum(ps, n, divide_by=3)
    monkeypatch.setenv("LOWBIT_KERNELS", "triton")
    assert _same(codec.decode_sum(ps, n, divide_by=3), want)


@pytest.mark.slow
def test_onebit_decode_sum_bit_identical_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused onebit (per bucket) decode-and-sum, with and without the mean, directly and through the
    codec: as the reference decodes added in order and then out.div_(d).
    Fast equivalent: test_onebit_decode_sum_bit_identical_in_order_small."""
    for bucket in (64, 100):
        for n in (7, 3000):
            _check_onebit_decode_sum(bucket, n, tuple((k, d) for k in (1, 3, 11) for d in (1, 3)))
    _check_onebit_codec_decode_sum(3000, monkeypatch)


@pytest.mark.parametrize("bucket", [64, 100])
def test_onebit_decode_sum_bit_identical_in_order_small(bucket: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands for the slow test_onebit_decode_sum_bit_identical_in_order (n 7 and 3000, every k x d):
    both buckets (fused, general) at n=333 (two tiles, the specials of _x), 1 payload with the mean,
    3 without, 11 (> MAX_SUM: chained launches) with it; and through the codec."""
    _check_onebit_decode_sum(bucket, 333, ((1, 3), (3, 1), (11, 3)))
    if bucket == 64:
        _check_onebit_codec_decode_sum(333, monkeypatch)


@pytest.mark.slow
def test_qsgd_infinities_keep_their_sign() -> None:
    """±Inf decode as ±Inf, as in the reference (+Inf decoded as -Inf before), fused and general paths.
    Fast equivalent: test_qsgd_infinities_keep_their_sign_small."""
    for bits in (1, 2, 4, 8, 16):
        for bucket in (64, 100):
            x = _x(3000, bits)
            x[1600:1700] = float("inf")  # whole buckets of +Inf (bucket 25 of 64, 16 of 100)
            p = tk.qsgd_encode(x, bits, bucket, "max", True, 5)
            assert torch.equal(p, ref.qsgd_encode(x.cpu(), bits, bucket, "max", True, 5).to(DEV)), (bits, bucket)
            y = tk.qsgd_decode(p, 3000, bits, bucket, torch.empty(3000, device=DEV))
            assert y[300].item() == float("inf") and y[520].item() == -float("inf"), (bits, bucket)
            assert (y[1600:1664] == float("inf")).all()


@pytest.mark.parametrize(("bits", "bucket"), [(1, 64), (2, 100), (4, 64), (8, 100), (16, 64)])
def test_qsgd_infinities_keep_their_sign_small(bits: int, bucket: int) -> None:
    """Stands for the slow test_qsgd_infinities_keep_their_sign (every bit width x both buckets at
    n=3000): every bit width once, fused (64) and general (100) paths among them, at n=333."""
    x = _x(333, bits)
    x[192:320] = float("inf")  # whole buckets of +Inf (buckets 3 and 4 of 64, 2 of 100)
    p = tk.qsgd_encode(x, bits, bucket, "max", True, 5)
    assert torch.equal(p, ref.qsgd_encode(x.cpu(), bits, bucket, "max", True, 5).to(DEV)), (bits, bucket)
    y = tk.qsgd_decode(p, 333, bits, bucket, torch.empty(333, device=DEV))
    assert y[130].item() == float("inf") and y[170].item() == -float("inf"), (bits, bucket)
    lo, hi = (192, 320) if bucket == 64 else (200, 300)  # the whole buckets of +Inf
    assert (y[lo:hi] == float("inf")).all(), (bits, bucket)


@pytest.mark.parametrize(("bits", "bucket"), [(8, 64), (4, 100)])
def test_qsgd_encode_with_its_key_in_device_memory_gives_the_int_seeds_bits(bits: int, bucket: int) -> None:
    """A CUDA graph replays the encode with the key read from memory (lowbit.comm.graphs): the bytes must
    be those of the int seed, and a new key written there must change them as a new seed does."""
    from lowbit.kernels.dispatch import write_keys

    x = _x(333, 3)
    keys = torch.zeros(2, dtype=torch.int32, device=DEV)
    write_keys(keys, [12345, 777])
    a = tk.qsgd_encode(x, bits, bucket, "max", True, keys[0:1])
    b = tk.qsgd_encode(x, bits, bucket, "max", True, keys[1:2])
    assert torch.equal(a, tk.qsgd_encode(x, bits, bucket, "max", True, 12345))
    assert torch.equal(b, tk.qsgd_encode(x, bits, bucket, "max", True, 777))
    assert not torch.equal(a, b)
    assert torch.equal(a, ref.qsgd_encode(x, bits, bucket, "max", True, 12345))
