"""Triton kernels compiled on a real GPU against the torch reference, at large sizes (up to 64M values).

Marked ``gpu`` (the default suite deselects it) and skipped without CUDA. Also runnable as a script
where pytest is not installed: ``PYTHONPATH=src python3 tests/gpu/test_triton_gpu.py``.
Every output buffer is poisoned first, inputs are fresh random data with NaN/inf planted, and sizes
are odd so the masked last tile runs too.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

try:
    import pytest

    gpu = pytest.mark.gpu
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
except ImportError:  # script mode on a machine without pytest
    pytest = None

    def gpu(f):
        return f

    needs_cuda = gpu

import lowbit  # noqa: E402
from lowbit.kernels import reference as ref  # noqa: E402

M = 1 << 20
POISON = 12345.0


def _tk():
    from lowbit.kernels import triton

    return triton


def _x(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, device="cuda", generator=g) * torch.exp(torch.randn(n, device="cuda", generator=g))
    if n > 5000:
        x[1000:1600] = 0.0
        x[17] = float("nan")
        x[3000] = float("inf")
        x[4000] = -float("inf")
        x.view(torch.int32)[4500] = -0x3EDCBB  # 0xFFC12345: a negative NaN with a payload
    return x


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _poisoned(n: int) -> torch.Tensor:
    return torch.full((n,), POISON, device="cuda")


@gpu
@needs_cuda
def test_qsgd_bit_identical_large() -> None:
    tk = _tk()
    for n in (1, 1_000_003, 16 * M + 5):
        x = _x(n, seed=n % 1000)
        for bits in (1, 2, 4, 8, 16):
            for bucket in (512, 128, 100, 16384):  # fused, fused, general (odd), general (> 8192)
                for stochastic in (True, False):
                    want = ref.qsgd_encode(x, bits, bucket, "max", stochastic, 42)
                    got = tk.qsgd_encode(x, bits, bucket, "max", stochastic, 42)
                    assert torch.equal(got, want), (n, bits, bucket, stochastic)
                dec = tk.qsgd_decode(want, n, bits, bucket, _poisoned(n))
                assert _same(dec, ref.qsgd_decode(want, n, bits, bucket, torch.empty(n, device="cuda")))
    # the largest size, the three bit widths of the performance targets
    n = 64 * M + 7
    x = _x(n, seed=3)
    for bits, bucket in ((8, 512), (4, 512), (2, 128)):
        want = ref.qsgd_encode(x, bits, bucket, "max", True, 7)
        got = tk.qsgd_encode(x, bits, bucket, "max", True, 7)
        assert torch.equal(got, want), (n, bits)
        dec = tk.qsgd_decode(want, n, bits, bucket, _poisoned(n))
        assert _same(dec, ref.qsgd_decode(want, n, bits, bucket, torch.empty(n, device="cuda")))
        del want, got, dec
        torch.cuda.empty_cache()


@gpu
@needs_cuda
def test_qsgd_l2_close() -> None:
    tk = _tk()
    n = 4 * M + 3
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(n, device="cuda", generator=g)
    for bits, bucket in ((4, 512), (8, 100), (2, 128)):
        nb = (n + bucket - 1) // bucket
        want = ref.qsgd_encode(x, bits, bucket, "l2", True, 1)
        got = tk.qsgd_encode(x, bits, bucket, "l2", True, 1)
        sw, sg = want[: 4 * nb].view(torch.float32), got[: 4 * nb].view(torch.float32)
        torch.testing.assert_close(sg, sw, rtol=4e-6, atol=0)
        cw, cg = ref.unpack_bits(want[4 * nb :], bits, n), ref.unpack_bits(got[4 * nb :], bits, n)
        same = torch.repeat_interleave(sw == sg, bucket)[:n]
        assert torch.equal(cw[same], cg[same])
        assert (cw - cg).abs().max().item() <= 1
        assert (cw != cg).float().mean().item() < 1e-3


@gpu
@needs_cuda
def test_qsgd_decode_sum_large() -> None:
    tk = _tk()
    n = 8 * M + 9
    for bits, bucket in ((4, 512), (8, 100)):
        ps = [ref.qsgd_encode(_x(n, seed=k), bits, bucket, "max", True, k) for k in range(11)]
        for k in (1, 4, 11):
            want = ref.qsgd_decode(ps[0], n, bits, bucket, torch.empty(n, device="cuda"))
            for p in ps[1:k]:
                want = want + ref.qsgd_decode(p, n, bits, bucket, torch.empty(n, device="cuda"))
            got = tk.qsgd_decode_sum(ps[:k], n, bits, bucket, _poisoned(n))
            assert _same(got, want), (bits, bucket, k)
            for d in (2, 3):  # the fused mean: as torch's out.div_(d) on the same device
                got = tk.qsgd_decode_sum(ps[:k], n, bits, bucket, _poisoned(n), divide_by=d)
                assert _same(got, want.clone().div_(d)), (bits, bucket, k, d)
        # payloads as slices of one received buffer (code streams at arbitrary alignment)
        size = ps[0].numel()
        buf = torch.empty(3 * size + 1, dtype=torch.uint8, device="cuda")
        views = [buf[1 + i * size : 1 + (i + 1) * size] for i in range(3)]
        for v, p in zip(views, ps):
            v.copy_(p)
        want = ref.qsgd_decode(ps[0], n, bits, bucket, torch.empty(n, device="cuda"))
        for p in ps[1:3]:
            want = want + ref.qsgd_decode(p, n, bits, bucket, torch.empty(n, device="cuda"))
        assert _same(tk.qsgd_decode_sum(views, n, bits, bucket, _poisoned(n)), want)


@gpu
@needs_cuda
def test_onebit_large() -> None:
    tk = _tk()
    for n in (1_000_003, 16 * M + 5):
        x = _x(n, seed=2)
        for bucket in (64, 512, 100):
            nb = (n + bucket - 1) // bucket
            want = ref.onebit_encode_buckets(x, bucket)
            got = tk.onebit_encode_buckets(x, bucket)
            assert torch.equal(got[8 * nb :], want[8 * nb :]), (n, bucket)
            torch.testing.assert_close(got[: 8 * nb].view(torch.float32), want[: 8 * nb].view(torch.float32),
                                       rtol=2e-6, atol=0, equal_nan=True)
            dec = tk.onebit_decode_buckets(want, n, bucket, _poisoned(n))
            ref_dec = ref.onebit_decode_buckets(want, n, bucket, torch.empty(n, device="cuda"))
            assert _same(dec, ref_dec)
            other = ref.onebit_encode_buckets(_x(n, seed=3), bucket)
            total = ref_dec + ref.onebit_decode_buckets(other, n, bucket, torch.empty(n, device="cuda"))
            for d in (1, 3):  # fused decode-and-sum with the mean, as adding then out.div_(d)
                got_sum = tk.onebit_decode_sum_buckets([want, other], n, bucket, _poisoned(n), divide_by=d)
                assert _same(got_sum, total.clone().div_(d) if d != 1 else total), (n, bucket, d)


@gpu
@needs_cuda
def test_dettmers_large() -> None:
    tk = _tk()
    old = os.environ.get("LOWBIT_KERNELS")
    os.environ["LOWBIT_KERNELS"] = "reference"
    try:
        specs = ["dettmers", "dettmers:bucket=4096", "dettmers:bucket=1000", "dettmers:type=linear",
                 "dettmers:type=dynamic_bnb,bucket=256", "dettmers:type=static", "dettmers:type=mantissa,offset=-2",
                 "dettmers:type=dynamic,search=paper", "dettmers:type=linear,search=paper,bucket=512"]
        for spec in specs:
            c = lowbit.get_codec(spec)
            for n in (1_000_003, 16 * M + 5):
                x = _x(n, seed=4)
                if not c.normalised:
                    x = x * 10.0 ** (c.offset - 2)
                want = c.encode(x)
                got = tk.dettmers_encode(x, c.type, c.search, c.bucket, c.offset)
                assert torch.equal(got, want), (spec, n, int((got != want).sum()))
                dec = tk.dettmers_decode(want, n, c.type, c.bucket, c.offset, _poisoned(n))
                assert _same(dec, c.decode(want, n)), (spec, n)
        c = lowbit.get_codec("dettmers")
        n = 64 * M + 7
        x = _x(n, seed=8)
        want = c.encode(x)
        assert torch.equal(tk.dettmers_encode(x, "dynamic", "nearest", 0, 0), want)
        assert _same(tk.dettmers_decode(want, n, "dynamic", 0, 0, _poisoned(n)), c.decode(want, n))
    finally:
        if old is None:
            os.environ.pop("LOWBIT_KERNELS", None)
        else:
            os.environ["LOWBIT_KERNELS"] = old


@gpu
@needs_cuda
def test_dettmers_decode_sum_large() -> None:
    """Fused Dettmers decode-and-sum with the mean, at 16M values: as the codec's torch decodes added
    in order and then out.div_(k) on the GPU, bit for bit (one scale, fused and general buckets)."""
    tk = _tk()
    old = os.environ.get("LOWBIT_KERNELS")
    n = 16 * M + 5
    try:
        for spec in ("dettmers", "dettmers:bucket=4096", "dettmers:bucket=1000"):
            c = lowbit.get_codec(spec)
            ps = [c.encode(_x(n, seed=k)) for k in range(3)]
            os.environ["LOWBIT_KERNELS"] = "reference"
            want = c.decode(ps[0], n)
            for p in ps[1:]:
                want = want + c.decode(p, n)
            os.environ.pop("LOWBIT_KERNELS")
            for d in (1, 3):
                got = tk.dettmers_decode_sum(ps, n, c.type, c.bucket, c.offset, _poisoned(n), divide_by=d)
                assert _same(got, want.clone().div_(d) if d != 1 else want), (spec, d)
    finally:
        if old is None:
            os.environ.pop("LOWBIT_KERNELS", None)
        else:
            os.environ["LOWBIT_KERNELS"] = old


def _div_exhaustive_kernel():
    import triton
    import triton.language as tl

    from lowbit.kernels.triton import common as tk  # _div_tile

    @triton.jit
    def kernel(s, last, bad_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # every float bit pattern 0 .. bits(s)
        x = i.to(tl.float32, bitcast=True)
        want = tl.div_rn(x, s)
        got = tk._div_tile(x, s, 1, 1, False, 0.0)
        tiny = (tl.abs(want) < 2.0**-42) & (tl.abs(got) < 2.0**-42)
        bad = (i <= last) & (got.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)) & ~tiny
        tl.atomic_add(bad_ptr, tl.sum(bad.to(tl.int32), axis=0))

    return kernel


@gpu
@needs_cuda
def test_division_shortcut_exhaustive() -> None:
    """_div_tile (scalar scale) against div.rn for every non-negative float x <= s (up to 2**31 values per scale),
    at scales across the fast path's range, its edges and all-ones significands (the sign of x only
    mirrors the result)."""
    import numpy as np

    kernel = _div_exhaustive_kernel()
    rng = np.random.default_rng(5)
    scales = [1.0, 2.0**-60, 2.0**126 * 0.9999999, np.float32(1.9999999), np.float32(1.0000001), 3.0, 0.1,
              np.float32(3.4e38) / 4, 1e-18, 7.7e-13]
    scales += list(np.float32(2.0) ** rng.integers(-60, 126, 6) * np.float32(1.99999988))
    scales += list(np.float32(10.0) ** rng.uniform(-18, 37, 8))
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    block = 4096
    for s in np.array(scales, dtype=np.float32):
        last = int(np.array([s], dtype=np.float32).view(np.int32)[0])
        kernel[((last + block) // block,)](float(s), last, bad, BLOCK=block, enable_fp_fusion=False)
        assert int(bad.item()) == 0, (float(s), int(bad.item()))


def _main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU: skipped")
        return 0
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            t0 = time.time()
            try:
                fn()
                print(f"PASS {name} ({time.time() - t0:.1f} s)", flush=True)
            except Exception:
                failed += 1
                print(f"FAIL {name} ({time.time() - t0:.1f} s)\n{traceback.format_exc()}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_main())
