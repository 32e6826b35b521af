"""lowbit.all_reduce on any tensor and any call: strided views, overlapping views, ranks that call
differently, huge finite values (issue 32, items 1, 2 and 6; gloo, CPU)."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

QUANTISED = [("qsgd:bits=8,bucket=64", "scatter_gather"), ("qsgd:bits=8,bucket=64", "allgather"),
             ("onebit:bucket=64", "scatter_gather")]


@pytest.fixture(scope="module")
def ranks() -> list:
    return spawn(run_parts, 2, (("strided", _body_strided, ()), ("crosswise", _body_crosswise, ())), backend="gloo",
                 timeout_s=60)


def _strided_cases(rank: int) -> dict[str, torch.Tensor]:
    """Views whose memory is not one dense run (each a fresh base per call)."""
    g = torch.Generator().manual_seed(rank)
    return {
        "every other": torch.randn(200, generator=g)[::2],
        "transposed": torch.randn(10, 30, generator=g).t(),
        "column": torch.randn(30, 7, generator=g)[:, 3],
        "fp16 strided": torch.randn(200, generator=g).half()[1::2],
        "reversed-ish 3d": torch.randn(4, 5, 6, generator=g).permute(2, 0, 1)[:, 1:, ::2],
    }


def _body_strided(rank: int, world: int) -> dict:
    out: dict = {}
    for spec, algorithm in [("fp32", "allreduce"), ("fp32", "scatter_gather")] + QUANTISED:
        for name, view in _strided_cases(rank).items():
            base = view._base if view._base is not None else view
            before = base.clone()
            dense = view.clone()  # the same values, contiguous: the answer to match
            lowbit.all_reduce(dense, spec, algorithm=algorithm, seed=3)
            lowbit.all_reduce(view, spec, algorithm=algorithm, seed=3)
            outside = torch.ones_like(base, dtype=torch.bool)
            outside.as_strided(view.shape, view.stride(), view.storage_offset() - base.storage_offset()).fill_(False)
            out[(spec, algorithm, name)] = (
                torch.equal(view, dense),                       # the right answer, as for a contiguous copy
                torch.equal(base[outside], before[outside]),   # nothing outside the view touched
                view.clone(),
            )
    refused = []
    for make in (lambda: torch.ones(1).expand(50), lambda: torch.ones(3, 1).expand(3, 4),
                 lambda: torch.ones(10).as_strided((5, 3), (1, 1))):
        try:
            lowbit.all_reduce(make(), "fp32", algorithm="allreduce")
            refused.append("accepted")
        except ValueError as exc:
            refused.append(str(exc))
    out["refused"] = refused
    t = torch.full((8,), float(rank))
    lowbit.all_reduce(t, "fp32", algorithm="allreduce")  # still in step
    out["in step"] = t.tolist()
    return out


def test_strided_tensors_get_the_right_answer_and_overlapping_ones_are_refused(ranks: list) -> None:
    r0, r1 = part(ranks, "strided")
    for key in r0:
        if key in ("refused", "in step"):
            continue
        for r in (r0, r1):
            same, untouched, _ = r[key]
            assert same, key
            assert untouched, key
        assert torch.equal(r0[key][2], r1[key][2]), key  # the same result on every rank
    for msg in r0["refused"]:
        assert "overlap" in msg and "clone()" in msg, msg
    assert r0["refused"] == r1["refused"]
    assert r0["in step"] == [1.0] * 8


HUGE_CODECS = [("qsgd:bits=8,bucket=64", "scatter_gather"), ("qsgd:bits=8,bucket=64", "allgather"),
               ("qsgd:bits=2,bucket=64,norm=l2", "scatter_gather"), ("onebit:bucket=64", "scatter_gather"),
               ("dettmers:type=dynamic", "allgather"), ("topk:ratio=0.5", "allgather"),
               ("onebit:bucket=0", "allgather")]


def _body_huge_mean(rank: int, world: int) -> dict:
    import torch.distributed as dist

    pair = dist.new_group([0, 1])
    out: dict = {}
    big = 3.0e38  # above float32's max (3.4e38) / 2: the sum of two overflows, their mean does not
    for spec, algorithm in HUGE_CODECS:
        for name, group, k in (("pair", pair, 2), ("three", None, 3)):
            if rank >= k:
                continue
            x = torch.full((40, 10), big) * (1 - 0.01 * torch.arange(400.0).view(40, 10) / 400)
            x[::7] *= -1
            lowbit.all_reduce(x, spec, group=group, algorithm=algorithm, op="mean", seed=1)
            out[(spec, algorithm, name)] = x
    return out


def test_the_mean_of_huge_finite_values_is_finite() -> None:
    """Finite in, finite out: the quantised algorithms summed before dividing, so a mean of values
    above float32's max / K came back as ±Inf (fp32's native allreduce divides first)."""
    res = spawn(_body_huge_mean, 3, backend="gloo", timeout_s=60)
    for key, y in res[0].items():
        assert torch.isfinite(y).all(), (key, y.view(-1)[:4])
        assert y.abs().max() < 3.41e38 and (y.view(-1)[::7].abs() > 1e38).any(), key  # still huge
        others = [r[key] for r in res[1:] if key in r]
        assert all(torch.equal(y, o) for o in others), key


def _body_crosswise(rank: int, world: int) -> list[str]:
    """Each pair first called alike by both ranks (so each combination has been seen), then crosswise."""
    a, b = "qsgd:bits=8,bucket=64", "qsgd:bits=8,bucket=64,rounding=nearest"  # the same payload size
    c = "qsgd:bits=4,bucket=64"                                              # a smaller one
    x = torch.ones(1000) * (rank + 1)
    for spec in (a, b, c):
        lowbit.all_reduce(x.clone(), spec)
    msgs = []
    for mine, theirs in ((a, b), (a, c), (a, "qsgd:bits=2,bucket=64")):  # the last: one known call, one new
        try:
            lowbit.all_reduce(x.clone(), mine if rank == 0 else theirs)
            msgs.append("no error")
        except lowbit.comm.CollectiveError as exc:
            msgs.append(str(exc))
    t = torch.full((8,), float(rank))
    lowbit.all_reduce(t, "fp32", algorithm="allreduce")  # the ranks are still in step
    msgs.append(str(t.tolist()))
    return msgs


def test_every_call_is_checked_not_only_the_first_of_a_combination(ranks: list) -> None:
    """Issue 32 item 2: the check ran once per combination, so known calls made crosswise gave silently
    different results (equal sizes), an abort (different sizes) or a timeout (one call new)."""
    m0, m1 = part(ranks, "crosswise")
    assert m0 == m1
    assert "rounding=stochastic" in m0[0] and "rounding=nearest" in m0[0] and "rank 1:" in m0[0], m0[0]
    assert "bits=8" in m0[1] and "bits=4" in m0[1], m0[1]
    assert "bits=2" in m0[2] and "timeout" not in m0[2], m0[2]
    assert m0[3] == str([1.0] * 8)
