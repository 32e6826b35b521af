"""Property-based fuzzing of decode: any payload, size, numel or dtype gives either a float32 result of the
right shape or a ValueError naming the problem: never a crash, another exception type, or a read past
the payload (a wrong-size payload is refused before any kernel runs). Reference and numba backends."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lowbit

SPECS = ["fp32", "fp16", "bf16", "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=64", "qsgd:bits=2,bucket=128",
         "qsgd:bits=1,bucket=16", "qsgd:bits=16,bucket=512", "onebit:bucket=64", "dettmers:type=dynamic",
         "dettmers:type=linear,bucket=4096", "dettmers:type=static", "topk:ratio=0.1"]
DTYPES = [torch.uint8, torch.uint8, torch.uint8, torch.int8, torch.float32]


@st.composite
def cases(draw):
    spec = draw(st.sampled_from(SPECS))
    codec = lowbit.get_codec(spec)
    numel = draw(st.one_of(st.integers(0, 5000), st.integers(-3, -1)))
    right = codec.nbytes(max(numel, 0))
    size = draw(st.one_of(st.just(right), st.just(right), st.integers(0, right + 40)))
    raw = draw(st.binary(min_size=size, max_size=size))
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    dtype = draw(st.sampled_from(DTYPES))
    if dtype is torch.int8:
        payload = payload.view(torch.int8)
    elif dtype is torch.float32 and size % 4 == 0:
        payload = payload.view(torch.float32)
    if draw(st.booleans()) and payload.numel() > 1:
        payload = torch.stack([payload, payload], 1).reshape(-1)[::2]  # same values, strided
    return spec, numel, payload, draw(st.integers(1, 3))


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "numba"])
@settings(max_examples=250, **_SETTINGS)
@given(case=cases())
def test_decode_never_crashes(backend: str, case) -> None:
    """250 examples. Fast equivalent: test_decode_never_crashes_quick (the same property, 60 examples)."""
    _check_decode(backend, case)


@pytest.mark.parametrize("backend", ["reference", "numba"])
@settings(max_examples=60, **_SETTINGS)
@given(case=cases())
def test_decode_never_crashes_quick(backend: str, case) -> None:
    """Stands for the slow test_decode_never_crashes (250 examples): the same property on 60."""
    _check_decode(backend, case)


def _check_decode(backend: str, case) -> None:
    spec, numel, payload, copies = case
    codec = lowbit.get_codec(spec)
    old = os.environ.get("LOWBIT_KERNELS")
    os.environ["LOWBIT_KERNELS"] = backend
    try:
        for call in (lambda: codec.decode(payload, numel),
                     lambda: codec.decode_sum([payload] * copies, numel, divide_by=copies)):
            well_formed = (numel >= 0 and payload.dtype == torch.uint8 and payload.is_contiguous()
                           and payload.numel() == codec.nbytes(numel))
            try:
                y = call()
            except ValueError as exc:
                assert str(exc), spec
                # only top-k can refuse well-formed bytes (an index outside [0, numel))
                assert not well_formed or spec.startswith("topk"), (spec, numel, str(exc))
                continue
            assert well_formed, (spec, numel, payload.dtype, payload.numel())  # anything else must be refused
            assert isinstance(y, torch.Tensor) and y.dtype == torch.float32 and tuple(y.shape) == (numel,), spec
    finally:
        if old is None:
            os.environ.pop("LOWBIT_KERNELS", None)
        else:
            os.environ["LOWBIT_KERNELS"] = old
