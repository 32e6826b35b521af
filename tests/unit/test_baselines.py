"""lowbit.lab.baselines: PyTorch's DDP hooks named as specs (parsing, labels, errors), and registration on a
one-rank group (the two-rank behaviour: tests/distributed/test_baselines.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from lowbit.lab import baselines as B


def test_specs_canonical_labels_and_bits() -> None:
    assert B.get_baseline("torch:fp16").spec == "torch:fp16"
    assert B.get_baseline(" TORCH:BF16 ").spec == "torch:bf16"
    ps = B.get_baseline("torch:powersgd:rank=4")
    assert (ps.rank, ps.start_iter) == (4, 2)
    assert ps.spec == "torch:powersgd:rank=4,start_iter=2"
    assert B.get_baseline(ps.spec) == ps  # the canonical spec parses back to the same baseline
    assert B.get_baseline("torch:powersgd:start_iter=10,rank=1").spec == "torch:powersgd:rank=1,start_iter=10"
    assert ps.label == "PowerSGD r4 (torch)"
    assert "from step 10" in B.get_baseline("torch:powersgd:rank=1,start_iter=10").label
    assert B.get_baseline("torch:fp16").bits == 16 and B.get_baseline("torch:ddp").bits == 32
    assert math.isnan(ps.bits)
    assert ps.error_feedback and not B.get_baseline("torch:fp16").error_feedback
    assert B.is_baseline("torch:fp16") and not B.is_baseline("fp16") and not B.is_baseline(None)
    assert all(B.get_baseline(s).spec == s for s in B.available_baselines())


@pytest.mark.parametrize("spec, words", [
    ("torch:fp8", ["unknown torch baseline", "torch:fp16", "torch:powersgd"]),
    ("torch:powersgd", ["needs its rank"]),
    ("torch:powersgd:rank=0", ["rank must be an integer >= 1"]),
    ("torch:powersgd:rank=4,start_iter=1", ["start_iter must be an integer >= 2", "rebuilt buckets"]),
    ("torch:powersgd:rank=four", ["rank must be an integer"]),
    ("torch:powersgd:rank=4,rank=2", ["given twice"]),
    ("torch:powersgd:rank=4,warm=1", ["unknown parameter 'warm=1'", "rank=, start_iter="]),
    ("torch:fp16:rank=4", ["unknown parameter", "none"]),
    ("fp16", ["not a torch baseline"]),
])
def test_bad_specs_say_what_is_wrong(spec: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as exc:
        B.get_baseline(spec)
    for w in words:
        assert w in str(exc.value)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_register_on_one_rank(one_rank_group) -> None:
    """What gets registered: torch's own hook function for fp16 (nothing wrapped), nothing for plain DDP,
    and bf16 refused off NCCL with a message that says so; a step's bytes are 0 on one rank."""
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 4))
    state = B.register(model, "torch:fp16")
    assert state.numel == 36 and state.world == 1 and not state.serial and not state.link
    assert [h for h, _ in model._comm_hooks] == [default_hooks.fp16_compress_hook]  # torch's, unwrapped
    model(torch.randn(2, 8)).sum().backward()
    state.count_step()
    assert state.stats.bytes_sent == 0 and state.steps == 1
    plain = DDP(nn.Linear(8, 4))
    B.register(plain, "torch:ddp")
    assert plain._comm_hooks == []  # plain DDP: its own allreduce
    with pytest.raises(ValueError, match="bf16_compress_hook runs on NCCL only"):
        B.register(DDP(nn.Linear(8, 4)), "torch:bf16")
    with pytest.raises(ValueError, match="expects a torch.nn.parallel.DistributedDataParallel"):
        B.register(nn.Linear(8, 4), "torch:fp16")
