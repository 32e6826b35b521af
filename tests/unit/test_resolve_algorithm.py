"""``algorithm="auto"``: one rule, read by the collectives, the DDP hook and the speed model alike (issue 31
item 1, issue 33 item 7). Two ranks take allgather on CUDA at every size and scatter_gather for large CPU
tensors, as measured (docs/bench.md, "Which algorithm auto runs")."""

from __future__ import annotations

import pytest

import lowbit
from lowbit.comm.allreduce import AUTO_TWO_RANKS_SCATTER_FROM, auto_algorithm, resolve_algorithm
from lowbit.lab.perfmodel.model import Cluster, predict
from lowbit.lab.perfmodel.model import resolve_algorithm as model_resolve_algorithm

SPECS = ["fp32", "fp16", "bf16", "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "qsgd:bits=16",
         "onebit:bucket=64", "onebit:bucket=0", "dettmers:type=dynamic", "topk:ratio=0.1"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 64])
def test_speed_model_prices_what_the_collectives_run_on_gpus(spec: str, world: int) -> None:
    codec = lowbit.get_codec(spec)
    runs = resolve_algorithm("auto", codec, world, numel=1 << 24, device="cuda")
    assert model_resolve_algorithm("auto", spec, world) == runs
    assert predict({"l": (1 << 20, 0.01)}, Cluster(world, 8, "nvlink", "10gbit"), batch_per_gpu=1, codec=spec,
                   algorithm="auto").algorithm == runs


def test_two_ranks_on_cuda_take_allgather_at_every_size() -> None:
    q8 = lowbit.get_codec("qsgd:bits=8,bucket=512")
    for numel in (1, 1 << 20, 1 << 24, 1 << 28):
        assert resolve_algorithm("auto", q8, 2, numel=numel, device="cuda") == "allgather"
    assert model_resolve_algorithm("auto", "qsgd:bits=4", 2) == "allgather"
    assert model_resolve_algorithm("auto", 4, 2) == "allgather" and model_resolve_algorithm("auto", 4, 3) == \
        "scatter_gather" and model_resolve_algorithm("auto", 16, 2) == "allreduce"


def test_two_ranks_on_cpu_take_scatter_gather_for_large_tensors() -> None:
    start_at = AUTO_TWO_RANKS_SCATTER_FROM["cpu"]
    assert start_at is not None and AUTO_TWO_RANKS_SCATTER_FROM["cuda"] is None
    for spec in ("qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "onebit:bucket=64"):
        codec = lowbit.get_codec(spec)
        assert resolve_algorithm("auto", codec, 2, numel=16 << 20, device="cpu") == "scatter_gather"
        assert resolve_algorithm("auto", codec, 2, numel=start_at, device="cpu") == "scatter_gather"
        assert resolve_algorithm("auto", codec, 2, numel=start_at - 1, device="cpu") == "allgather"
        assert resolve_algorithm("auto", codec, 3, numel=1000, device="cpu") == "scatter_gather"
        assert resolve_algorithm("auto", codec, 1, numel=16 << 20, device="cpu") == "allgather"
    # what the call runs, not only what auto says: per-tensor codecs and natively summed ones keep their rule
    assert resolve_algorithm("auto", lowbit.get_codec("onebit:bucket=0"), 2, numel=16 << 20, device="cpu") == \
        "allgather"
    assert resolve_algorithm("auto", lowbit.get_codec("fp16"), 2, numel=16 << 20, device="cpu") == "allreduce"


def test_without_size_or_device_two_ranks_take_allgather() -> None:
    # (the DDP hook resolves before it knows a message's size: its small fp32 tensors ride in allgather's message)
    assert auto_algorithm(2) == auto_algorithm(2, numel=16 << 20) == auto_algorithm(2, device="cpu") == "allgather"
    q8 = lowbit.get_codec("qsgd:bits=8,bucket=512")
    assert resolve_algorithm("auto", q8, 2) == "allgather"
    n = 16 << 20
    assert lowbit.comm.bytes_sent_per_rank(q8, n, 2, "auto", device="cpu") == \
        lowbit.comm.bytes_sent_per_rank(q8, n, 2, "scatter_gather")
    assert lowbit.comm.bytes_sent_per_rank(q8, n, 2, "auto") == lowbit.comm.bytes_sent_per_rank(q8, n, 2, "allgather")
