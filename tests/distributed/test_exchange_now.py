"""lowbit.comm.flat.exchange_now (the synchronous call a CUDA graph captures) against the async path.

On gloo, 2 and 3 ranks: for scatter_gather and allgather, with stochastic rounding, error feedback,
riders and a non-finite step, exchange_now leaves the same bits in the tensor and the residual as
lowbit.comm.allreduce.start with the same arguments, and bytes_now counts what start counts.
"""

from __future__ import annotations

import pytest
import torch

from lowbit.codecs.base import get_codec
from lowbit.comm import flat
from lowbit.comm.allreduce import CommStats, start
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

CASES = [  # (codec, algorithm, n, riders, error feedback)
    ("qsgd:bits=4,bucket=512", "scatter_gather", 10_001, 0, False),
    ("qsgd:bits=8,bucket=512", "scatter_gather", 7, 0, True),
    ("onebit:bucket=64", "scatter_gather", 4_099, 0, True),
    ("qsgd:bits=2,bucket=128", "allgather", 3_001, 0, True),
    ("dettmers:type=dynamic", "allgather", 2_000, 13, False),
]


def _body(rank: int, world: int) -> list:
    out = []
    for spec, algo, n, riders, ef in CASES:
        codec = get_codec(spec)
        for step in range(3):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + n)
            x = torch.randn(n + riders, generator=g)
            if step == 2 and rank == 1:
                x[5] = float("inf")  # a non-finite step: every rank puts its residual back
            res_a = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 0.01 if ef else None
            res_b = res_a.clone() if ef else None
            a = x.clone()
            stats = CommStats()
            start(a, codec, None, algo, "mean", res_a, seed=17 + step, stats=stats, exact=riders).wait()
            b = x.clone()
            flat.exchange_now(b, codec, None, algo, "mean", res_b, flat.call_seeds(algo, 17 + step, rank, world),
                              (rank, world), exact=riders)
            same = torch.equal(a, b) or (torch.isnan(a) == torch.isnan(b)).all() and torch.equal(
                torch.nan_to_num(a), torch.nan_to_num(b))
            out.append({"case": (spec, algo, step), "same": bool(same),
                        "res_same": (not ef) or torch.equal(res_a, res_b),
                        "bytes": stats.bytes_sent == flat.bytes_now(codec, algo, n, world, rank, riders)})
    return out


@pytest.fixture(scope="module", params=[2, 3])
def ranks(request: pytest.FixtureRequest) -> list:
    return spawn(run_parts, request.param, (("now", _body, ()),), backend="gloo", timeout_s=120)


def test_exchange_now_gives_the_async_path_bits(ranks: list) -> None:
    for rows in part(ranks, "now"):
        for r in rows:
            assert r["same"], r["case"]
            assert r["res_same"], r["case"]
            assert r["bytes"], r["case"]


def test_exchange_now_refuses_what_it_does_not_run() -> None:
    with pytest.raises(ValueError, match="scatter_gather and allgather"):
        flat.exchange_now(torch.zeros(8), get_codec("qsgd:bits=8"), None, "hierarchical", "mean", None, [], (0, 1))
