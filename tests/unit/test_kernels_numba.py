"""The numba CPU kernels against the torch reference: same payload bytes, same decoded floats.

Everything is compared bit for bit (payload bytes, float32 bit patterns of decoded values, NaN
payloads included), the l2 scales and onebit's means too: both backends sum in the reference's own
order (reference.tree_sum), on every CPU.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

pytest.importorskip("numba")

from lowbit.kernels import dispatch  # noqa: E402
from lowbit.kernels import numba as nk  # noqa: E402
from lowbit.kernels import reference as ref  # noqa: E402

BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)
BUCKETS = (1, 7, 64, 512, 8192)
SIZES = (0, 1, 7, 4096, 4097, 100003)
MODES = (("max", False), ("max", True), ("l2", False), ("l2", True))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One thread (torch's, which the numba kernels follow) while this module runs: on a busy 2-core
    machine the thousands of small parallel calls here wait on preempted workers and the module ran
    ~5x slower. Results do not depend on thread counts: test_results_do_not_depend_on_thread_counts
    runs the parallel paths with all threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _data(n: int, seed: int) -> torch.Tensor:
    """Gaussian values with a spread of magnitudes across buckets (some buckets tiny, some large)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))


def _bits32(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _assert_payload_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == torch.uint8 and got.shape == want.shape, what
    assert torch.equal(got, want), f"{what}: {(got != want).sum().item()} bytes differ"


def _tree_sum_py(row: np.ndarray) -> np.float32:
    """reference.tree_sum's order written out in numpy float32: pad with +0 to a power of two, add
    neighbours level by level."""
    v = row.astype(np.float32)
    p = 1 << max(0, (v.size - 1).bit_length())
    v = np.concatenate([v, np.zeros(p - v.size, np.float32)]) if v.size else np.zeros(1, np.float32)
    while v.size > 1:
        v = (v[0::2] + v[1::2]).astype(np.float32)
    return v[0]


def test_tree_sum_is_the_defined_order() -> None:
    """The reference's sums are its own pairwise order, not torch's: equal bit for bit to the order
    written out in numpy, for row lengths around powers of two and across blocks of the kernels."""
    for n in (0, 1, 2, 3, 7, 8, 9, 64, 100, 2047, 2048, 2049, 5000):
        x = _data(3 * n, seed=n).view(3, n) if n else torch.zeros(3, 0)
        got = ref.tree_sum(x)
        want = torch.tensor([_tree_sum_py(r) for r in x.numpy()])
        assert torch.equal(_bits32(got), _bits32(want)), n
    # -0.0 alone stays -0.0; padded (n not a power of two) it meets +0 and becomes +0
    assert str(ref.tree_sum(torch.tensor([[-0.0]]))[0].item()) == "-0.0"
    assert str(ref.tree_sum(torch.tensor([[-0.0, -0.0, -0.0]]))[0].item()) == "0.0"


def test_l2_scale_is_the_correctly_rounded_norm() -> None:
    """bucket_l2 = m * sqrt(tree_sum((x/m)^2)) with IEEE's correctly rounded float32 square root (numpy's),
    not torch's CPU float32 sqrt, which is not correctly rounded."""
    x = _data(64 * 4096, seed=11).view(4096, 64)
    m = x.abs().amax(dim=1)
    sq = ((x / m[:, None]) ** 2).numpy()
    r = np.sqrt(np.array([_tree_sum_py(row) for row in sq], np.float32))
    want = (m.numpy() * r).astype(np.float32)
    assert torch.equal(_bits32(ref.bucket_l2(x)), _bits32(torch.from_numpy(want)))


# --------------------------------------------------------------------------------- qsgd
@pytest.mark.parametrize("bits", BITS)
def test_qsgd_encode_decode_match_reference(bits: int) -> None:
    for bucket in BUCKETS:
        for n in SIZES:
            x = _data(n, seed=bits * 1000 + n % 997 + bucket)
            for norm, stochastic in MODES:
                what = f"bits={bits} bucket={bucket} n={n} norm={norm} stochastic={stochastic}"
                want = ref.qsgd_encode(x, bits, bucket, norm, stochastic, 1234 + n)
                got = nk.qsgd_encode(x, bits, bucket, norm, stochastic, 1234 + n)
                _assert_payload_equal(got, want, what)
            # decode is pure float32 arithmetic: always bit-identical
            out_ref = ref.qsgd_decode(want, n, bits, bucket, torch.empty(n))
            out = nk.qsgd_decode(want, n, bits, bucket, torch.full((n,), 7.0))
            assert torch.equal(_bits32(out), _bits32(out_ref)), f"decode bits={bits} bucket={bucket} n={n}"


def test_qsgd_stochastic_seeds_and_unbiasedness() -> None:
    x = _data(50000, seed=5)
    for seed in (0, 1, 2**31 + 7, 2**40 + 3):
        assert torch.equal(nk.qsgd_encode(x, 4, 512, "max", True, seed), ref.qsgd_encode(x, 4, 512, "max", True, seed))
    a = nk.qsgd_encode(x, 4, 512, "max", True, 1)
    assert not torch.equal(a, nk.qsgd_encode(x, 4, 512, "max", True, 2))
    # E[decode(encode(x))] = x: the mean over seeds approaches x
    acc = torch.zeros_like(x)
    for seed in range(64):
        acc += nk.qsgd_decode(nk.qsgd_encode(x, 2, 64, "max", True, seed), x.numel(), 2, 64, torch.empty_like(x))
    rel = (acc / 64 - x).norm() / x.norm()
    assert rel < 0.1


@pytest.mark.parametrize("bits", (1, 3, 4, 8, 16))
def test_qsgd_decode_sum_is_ordered_float32_sum(bits: int) -> None:
    for bucket, n in ((7, 100003), (512, 4097), (64, 1), (8192, 20000)):
        payloads = [ref.qsgd_encode(_data(n, seed=k), bits, bucket, "max", True, k) for k in range(4)]
        for order in (payloads[:1], payloads[:2], payloads, payloads[::-1]):
            want = ref.qsgd_decode(order[0], n, bits, bucket, torch.empty(n))
            for p in order[1:]:
                want.add_(ref.qsgd_decode(p, n, bits, bucket, torch.empty(n)))
            out = torch.empty(n)
            got = nk.qsgd_decode_sum(order, n, bits, bucket, out)
            assert got is out
            assert torch.equal(_bits32(got), _bits32(want)), (bits, bucket, n, len(order))
            for d in (3, 7):  # the mean in the same pass: as torch's CPU out.div_(d) after the sum
                got = nk.qsgd_decode_sum(order, n, bits, bucket, torch.empty(n), divide_by=d)
                assert torch.equal(_bits32(got), _bits32(want.clone().div_(d))), (bits, bucket, n, d)
    with pytest.raises(ValueError):
        nk.qsgd_decode_sum([], 4, 8, 512, torch.empty(4))


_NAN = float("nan")
_INF = float("inf")
_DEFAULT_NAN = (torch.zeros(1) / torch.zeros(1)).item()  # 0/0: x86's "default NaN", sign bit set


@pytest.mark.parametrize(
    "values",
    [
        [1.0, _NAN, -2.0, 0.5],
        [1.0, _DEFAULT_NAN, -2.0, 0.5],
        [1.0, _INF, -2.0, 0.5],
        [1.0, -_INF, -2.0, 0.5],
        [_NAN, _INF, -_INF, 1.0],
        [0.0, -0.0, 0.0, 0.0],
        [1e-45, -1e-45, 3e-45, 0.0],
        [3e38, -3e38, 3.4e38, 1e38],
    ],
    ids=["nan", "default-nan", "inf", "-inf", "nan+inf", "zeros", "subnormal", "huge"],
)
def test_qsgd_nonfinite_and_extreme_values(values: list[float]) -> None:
    base = torch.tensor(values, dtype=torch.float32)
    for n in (4, 4099):
        x = base.repeat(-(-n // 4))[:n].clone()
        x[5::7] *= 0.3
        for bits in (1, 2, 5, 8, 16):
            for bucket in (1, 4, 7, 64):
                for norm, stochastic in MODES:
                    what = f"{values} n={n} bits={bits} bucket={bucket} norm={norm} stochastic={stochastic}"
                    want = ref.qsgd_encode(x, bits, bucket, norm, stochastic, 9)
                    got = nk.qsgd_encode(x, bits, bucket, norm, stochastic, 9)
                    _assert_payload_equal(got, want, what)
                    out_ref = ref.qsgd_decode(want, n, bits, bucket, torch.empty(n))
                    out = nk.qsgd_decode(want, n, bits, bucket, torch.empty(n))
                    assert torch.equal(_bits32(out), _bits32(out_ref)), what


def test_qsgd_nan_bucket_has_nan_scale_and_zero_codes() -> None:
    x = torch.ones(8192)
    x[100] = _NAN  # bucket 0 of 512
    x[600] = _INF  # bucket 1
    p = nk.qsgd_encode(x, 8, 512, "max", False, 0)
    scales = p[: 4 * 16].view(torch.float32)
    assert torch.isnan(scales[0]) and scales[1].item() == _INF and scales[2].item() == 1.0
    codes = p[4 * 16 :]
    assert codes[100].item() == 0 and codes[0].item() == 254  # NaN -> 0; a NaN scale divides by 1
    assert codes[600].item() == 254 and codes[601].item() == 127  # +inf -> 2s (keeps its sign); 1/inf = 0 -> s


# --------------------------------------------------------------------------------- onebit
def test_onebit_matches_reference() -> None:
    for bucket in (1, 2, 3, 5, 7, 8, 9, 16, 17, 64, 100, 512, 1000, 8192):
        for n in (0, 1, 7, 8, 4096, 4097, 100003):
            x = _data(n, seed=bucket * 31 + n % 101)
            want = ref.onebit_encode_buckets(x, bucket)
            got = nk.onebit_encode_buckets(x, bucket)
            _assert_payload_equal(got, want, f"onebit bucket={bucket} n={n}")
            out_ref = ref.onebit_decode_buckets(want, n, bucket, torch.empty(n))
            out = nk.onebit_decode_buckets(want, n, bucket, torch.empty(n))
            assert torch.equal(_bits32(out), _bits32(out_ref)), (bucket, n)


def test_onebit_nonfinite_and_single_large_bucket() -> None:
    x = _data(40000, seed=3)
    x[3], x[70], x[200], x[201] = _NAN, _INF, -_INF, -0.0
    for bucket in (7, 64, 40000):  # 40000: one bucket, in blocks of the tree
        assert torch.equal(nk.onebit_encode_buckets(x, bucket), ref.onebit_encode_buckets(x, bucket)), bucket


def _mixed_nans(n: int, bucket: int) -> torch.Tensor:
    """Every third bucket holds NaNs of several bit patterns (torch's 0x7FC00000, x86's 0xFFC00000 from
    0/0 or inf - inf, payloads 1 and 3), in an order that turns from bucket to bucket."""
    x = _data(n, seed=bucket)
    bits = x.view(torch.int32)
    patterns = torch.tensor([0x7FC00000, -0x00400000, 0x7FC00001, 0x7FC00003], dtype=torch.int32)  # -0x400000: 0xFFC00000
    k = torch.arange(n)
    b, j = k // bucket, k % bucket
    at = (b % 3 == 0) & (j < 4)
    bits[at] = patterns[((j + b) % 4)[at]]
    return x


def test_nan_scales_are_the_canonical_nan() -> None:
    """A bucket's L2 scale or onebit mean over NaNs of different bit patterns is the canonical NaN
    0x7FC00000 in both backends (a sum's NaN depends on the operand order compilers choose)."""
    for bucket in (2, 8, 9, 64, 100, 2049):
        x = _mixed_nans(20 * bucket + 3, bucket)
        nb = -(-x.numel() // bucket)
        for bits in (2, 8):
            want, got = ref.qsgd_encode(x, bits, bucket, "l2", True, 1), nk.qsgd_encode(x, bits, bucket, "l2", True, 1)
            _assert_payload_equal(got, want, f"l2 bucket={bucket} bits={bits}")
            scales = want[: 4 * nb].view(torch.int32)
            assert set(scales[torch.isnan(want[: 4 * nb].view(torch.float32))].tolist()) == {0x7FC00000}
        want, got = ref.onebit_encode_buckets(x, bucket), nk.onebit_encode_buckets(x, bucket)
        _assert_payload_equal(got, want, f"onebit bucket={bucket}")
        means = want[: 8 * nb]
        assert set(means.view(torch.int32)[torch.isnan(means.view(torch.float32))].tolist()) == {0x7FC00000}


@pytest.mark.parametrize("bits_checked", [pytest.param(BITS, marks=pytest.mark.slow, id="all-bits"),
                                          pytest.param((1, 3, 8, 16), id="bits-1-3-8-16")])
def test_results_do_not_depend_on_thread_counts(bits_checked: tuple[int, ...]) -> None:
    """The parallel paths with all threads (every chunk and block boundary, bit widths that straddle
    bytes), and the reference with 1 and 2 torch threads. [all-bits] (every width) is marked slow; its
    fast equivalent [bits-1-3-8-16] keeps a sub-byte packed width, one straddling bytes, a byte and
    two bytes, on the same tensor and buckets."""
    import numba

    x = _data(150001, seed=8)
    n = x.numel()
    all_threads = numba.config.NUMBA_NUM_THREADS
    torch.set_num_threads(all_threads)  # the numba kernels use as many threads as torch
    try:
        for bits in bits_checked:
            for bucket in (7, 64, 100000):
                p = nk.qsgd_encode(x, bits, bucket, "max", True, 5)
                assert torch.equal(p, ref.qsgd_encode(x, bits, bucket, "max", True, 5)), (bits, bucket)
                out = nk.qsgd_decode(p, n, bits, bucket, torch.empty(n))
                assert torch.equal(_bits32(out), _bits32(ref.qsgd_decode(p, n, bits, bucket, torch.empty(n))))
                total = nk.qsgd_decode_sum([p, p, p], n, bits, bucket, torch.empty(n))
                assert torch.equal(_bits32(total), _bits32((out + out) + out)), (bits, bucket)
        assert numba.get_num_threads() == all_threads
        for torch_threads in (1, 2):
            torch.set_num_threads(torch_threads)
            for bits, bucket in ((8, 512), (3, 7), (16, 100000)):
                for norm in ("max", "l2"):
                    what = f"torch_threads={torch_threads} bits={bits} bucket={bucket} norm={norm}"
                    want = ref.qsgd_encode(x, bits, bucket, norm, True, 4)
                    got = nk.qsgd_encode(x, bits, bucket, norm, True, 4)
                    _assert_payload_equal(got, want, what)
            for bucket in (64, 100000):
                want, got = ref.onebit_encode_buckets(x, bucket), nk.onebit_encode_buckets(x, bucket)
                _assert_payload_equal(got, want, f"onebit {bucket}")
    finally:
        torch.set_num_threads(1)


# --------------------------------------------------------------------------------- integration
def test_dispatch_routes_large_cpu_tensors_to_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    import lowbit

    monkeypatch.delenv("LOWBIT_KERNELS", raising=False)
    big, small = torch.randn(dispatch.NUMBA_MIN_NUMEL), torch.randn(16)
    assert dispatch.backend_for(big, "qsgd_encode") is nk
    assert dispatch.backend_for(small, "qsgd_encode") is ref
    codec = lowbit.get_codec("qsgd:bits=4,bucket=512")
    x = _data(10000, seed=11)
    fast = codec.encode(x, seed=3)
    y_fast = codec.decode(fast, x.numel())
    monkeypatch.setenv("LOWBIT_KERNELS", "reference")
    assert dispatch.backend_for(big, "qsgd_encode") is ref
    assert torch.equal(fast, codec.encode(x, seed=3))
    assert torch.equal(y_fast, codec.decode(fast, x.numel()))


def test_unusual_inputs_fall_back_and_bad_bits_raise() -> None:
    x64 = _data(5000, seed=2).double()
    assert torch.equal(nk.qsgd_encode(x64, 8, 512, "max", True, 1), ref.qsgd_encode(x64, 8, 512, "max", True, 1))
    p = ref.qsgd_encode(x64.float(), 4, 64, "max", False, 0)
    strided = torch.empty(10000)[::2]
    assert torch.equal(nk.qsgd_decode(p, 5000, 4, 64, strided), ref.qsgd_decode(p, 5000, 4, 64, torch.empty(5000)))
    with pytest.raises(ValueError):
        nk.qsgd_encode(x64.float(), 9, 512, "max", True, 1)


def test_unaligned_payload_slices_decode() -> None:
    # payloads cut from a received buffer can start at any byte
    x = _data(5000, seed=4)
    p = ref.qsgd_encode(x, 5, 100, "max", True, 1)
    buf = torch.cat([torch.zeros(3, dtype=torch.uint8), p])
    out = nk.qsgd_decode(buf[3:], 5000, 5, 100, torch.empty(5000))
    assert torch.equal(_bits32(out), _bits32(ref.qsgd_decode(p, 5000, 5, 100, torch.empty(5000))))
    q = ref.onebit_encode_buckets(x, 64)
    buf = torch.cat([torch.zeros(1, dtype=torch.uint8), q])
    out = nk.onebit_decode_buckets(buf[1:], 5000, 64, torch.empty(5000))
    assert torch.equal(_bits32(out), _bits32(ref.onebit_decode_buckets(q, 5000, 64, torch.empty(5000))))


def test_import_without_numba_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now raises ImportError
    for name in [m for m in sys.modules if m == nk.__name__ or m.startswith(nk.__name__ + ".")]:
        monkeypatch.delitem(sys.modules, name)  # import the package afresh (restored afterwards)
    with pytest.raises(ImportError):
        importlib.import_module(nk.__name__)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    src = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "src"))
    full_env = dict(os.environ, **env)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, full_env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=120)


def test_first_call_keeps_torch_thread_count() -> None:
    """numba's OpenMP pool start resets OpenMP's thread count (shared with torch) to all cores; the
    kernels put torch's back and use as many threads as torch (torchrun: OMP_NUM_THREADS=1 per rank)."""
    res = _run_python(
        """
        import numba, torch
        torch.set_num_threads(1)
        from lowbit.kernels import numba as nk
        nk.qsgd_decode(nk.qsgd_encode(torch.randn(5000), 8, 512, "max", True, 0), 5000, 8, 512, torch.empty(5000))
        assert torch.get_num_threads() == 1, torch.get_num_threads()
        assert numba.get_num_threads() == 1, numba.get_num_threads()
        """
    )
    assert res.returncode == 0, res.stderr[-2000:]


DETTMERS_SPECS = ("dettmers", "dettmers:bucket=4096", "dettmers:bucket=1000", "dettmers:type=linear",
                  "dettmers:type=dynamic_bnb,bucket=256", "dettmers:type=static",
                  "dettmers:type=mantissa,offset=-2", "dettmers:search=paper",
                  "dettmers:type=linear,search=paper,bucket=512")


@pytest.mark.parametrize("spec", DETTMERS_SPECS)
def test_dettmers_bit_identical_to_codec(spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """numba's Dettmers encode/decode give the codec's torch bytes and values, every type and search,
    bucketed or one scale, odd sizes, with NaN, +-inf and an all-zero bucket planted."""
    import lowbit

    codec = lowbit.get_codec(spec)
    for n in (1, 7, 5000, 100003):
        x = _data(n, seed=n) * torch.exp(_data(n, seed=n + 1))
        if n > 600:
            x[5], x[300], x[520] = float("nan"), float("inf"), -float("inf")
            x[100:164] = 0.0
        if not codec.normalised:
            x = x * 10.0 ** (codec.offset - 2)
        monkeypatch.setenv("LOWBIT_KERNELS", "reference")
        want = codec.encode(x)
        want_dec = codec.decode(want, n)
        monkeypatch.delenv("LOWBIT_KERNELS")
        got = nk.dettmers_encode(x, codec.type, codec.search, codec.bucket, codec.offset)
        assert torch.equal(got, want), (spec, n, int((got != want).sum()))
        dec = nk.dettmers_decode(want, n, codec.type, codec.bucket, codec.offset, torch.full((n,), 7.0))
        assert torch.equal(_bits32(dec), _bits32(want_dec)), (spec, n)
        # through the codec, which picks numba for CPU tensors of >= 4096 values
        assert torch.equal(codec.encode(x), want)
    with pytest.raises(ValueError, match="payload"):
        nk.dettmers_decode(torch.zeros(3, dtype=torch.uint8), 5000, "dynamic", 0, 0, torch.empty(5000))
