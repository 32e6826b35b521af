"""What ``register`` tells a user where the configuration does not do what they may think (issue 43 item 2):
an FSDP mesh of one rank compresses nothing; FSDP's codec="auto" that compresses nothing says why, and a
module without parameters of its own is not "a module without a gradient sample"; a stochastic parameter
codec (a warning); a second register on the same model. One process on a file store (a 1-rank group) where one rank
tells, two ranks in one spawn for codec="auto"."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit.ddp
from lowbit.launch import spawn

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api.FSDPModule, "set_custom_reduce_scatter"):  # pragma: no cover
    pytest.skip("this torch's FSDP2 has no custom reduce-scatter", allow_module_level=True)

from torch.distributed.fsdp import fully_shard  # noqa: E402

import lowbit.fsdp as lf  # noqa: E402
from tests.distributed.test_noop_warnings import _Records


def _blocks(width: int = 32) -> nn.Module:
    """Two blocks, each its own fully_shard, under a root that has no parameter of its own."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(width, width), nn.Linear(width, width))
    for b in m:
        fully_shard(b)
    fully_shard(m)
    return m


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    monkeypatch.setattr("lowbit.comm.registration._SAID", set())
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def _lowbit_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("lowbit")]


def test_fsdp_on_a_one_rank_mesh_warns_that_nothing_is_compressed(one_rank) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lf.register(_blocks(), codec="qsgd:bits=8")
    said = _lowbit_warnings(caught)
    assert len(said) == 1, said
    assert "gradients are not compressed" in said[0] and "1 rank" in said[0], said[0]
    assert "torchrun --nproc-per-node 2" in said[0]


def test_a_stochastic_parameter_codec_warns_with_the_fix(one_rank) -> None:
    """docs/fsdp.md: use a deterministic parameter codec. A stochastic one is allowed (ranks that pass one
    still agree, tests/distributed/test_state_checks.py), with a warning that says why and what to pass."""
    for stochastic in ("qsgd:bits=8", "qsgd:bits=4,bucket=512"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lf.register(_blocks(), codec="qsgd:bits=8", param_codec=stochastic)
        said = [w for w in _lowbit_warnings(caught) if "param_codec" in w]
        assert len(said) == 1 and "stochastic" in said[0] and "rounding=nearest" in said[0], said
    for deterministic in ("qsgd:bits=8,rounding=nearest", "bf16"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lf.register(_blocks(), codec="qsgd:bits=8", param_codec=deterministic)
        assert not [w for w in _lowbit_warnings(caught) if "param_codec" in w]


def test_a_second_register_on_the_same_model_is_refused(one_rank) -> None:
    model = DDP(nn.Linear(8, 4))
    first = lowbit.ddp.register(model, codec="qsgd:bits=8")
    for again in (dict(codec="qsgd:bits=8"), dict(codec="auto")):
        with pytest.raises(ValueError, match=r"already registered.*LowbitState.*qsgd:bits=8"):
            lowbit.ddp.register(model, **again)
    assert lowbit.ddp.register(DDP(nn.Linear(8, 4)), codec="auto") is not first  # another model: fine
    sharded = _blocks()
    lf.register(sharded, codec="qsgd:bits=8")
    with pytest.raises(ValueError, match=r"already registered.*FSDPState.*qsgd:bits=8"):
        lf.register(sharded, codec="bf16")


def _body_auto_native(rank: int, world: int) -> dict:
    """codec="auto" on small modules under a root without parameters: native everywhere, decided at once."""
    handler = _Records()
    log = logging.getLogger("lowbit.fsdp")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        m = _blocks()
        st = lf.register(m, codec="auto")
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for i in range(6):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * i + rank))
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        log.removeHandler(handler)
    return {"decision": st.auto.decision, "decided": st.auto.decided_iter,
            "warnings": [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]}


@pytest.fixture(scope="module")
def auto_ranks() -> list:
    return spawn(_body_auto_native, 2, backend="gloo", timeout_s=120)


def test_fsdp_auto_gives_no_missing_sample_warning_for_a_module_without_parameters(auto_ranks: list) -> None:
    for r in auto_ranks:
        assert not any("no finite gradient sample" in w for w in r["warnings"]), r["warnings"]
        assert r["decided"] == 2, r  # at the end of the warm-up: admission was not put off for the root
        assert set(r["decision"]) == {"0", "1"} and set(r["decision"].values()) == {"native"}, r["decision"]


def test_fsdp_auto_that_compresses_nothing_warns_with_the_reason(auto_ranks: list) -> None:
    r0, r1 = auto_ranks
    said = [w for w in r0["warnings"] if "not compressed" in w]
    assert len(said) == 1, r0["warnings"]
    assert "FSDP's own reduce-scatter" in said[0] and "10,000 values" in said[0], said[0]
    assert not any("not compressed" in w for w in r1["warnings"])  # rank 0 only
