"""FSDP's error-feedback state and the ranks' agreement at register (issue 44, items 2, 7 and 8; 2 gloo
ranks, one spawn for all, the parts that may leave a rank behind last).

* a checkpoint whose residuals are missing, unexpected, of another size or dtype is refused, and nothing
  of it is loaded (item 2);
* a step whose reduced gradient is non-finite on any rank leaves every rank's residuals as they were,
  though each rank holds only its own shard of that gradient (item 8);
* a codec typo on one rank: every rank raises at once, not at the group's timeout (item 7).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api.FSDPModule, "set_custom_reduce_scatter"):  # pragma: no cover
    pytest.skip("this torch's FSDP2 has no custom reduce-scatter", allow_module_level=True)

from torch.distributed.fsdp import fully_shard  # noqa: E402

import lowbit.fsdp as lf  # noqa: E402

TIMEOUT_S = 30  # the group's timeout: a rank left waiting for a peer would wait this long
EF = "onebit:bucket=64"


class _Net(nn.Module):
    """Two blocks of their own fully_shard and a root: three FSDP modules, three residuals."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(12, 96)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(96, 96), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(96, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _sharded() -> _Net:
    model = _Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def _step(model: nn.Module, rank: int, i: int, plant_inf: bool = False) -> None:
    g = torch.Generator().manual_seed(100 * i + rank)
    x = torch.randn(8, 12, generator=g)
    y = x[:, :5] * 0.5
    if plant_inf:
        y[0, 0] = float("inf")
    (model(x) - y).pow(2).mean().backward()
    for p in model.parameters():
        p.grad = None


def _residuals(st: lf.FSDPState) -> dict:
    return {k: v.detach().clone() for k, v in st.feedback.residuals.items()}


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ item 2
def _body_checkpoint(rank: int, world: int) -> dict:
    model = _sharded()
    st = lf.register(model, codec=EF, error_feedback=True)
    for i in range(2):
        _step(model, rank, i)
    good = st.state_dict()
    res = good["feedback"]["residuals"]
    key = sorted(res, key=str)[0]

    def with_residuals(r: dict) -> dict:
        return {**good, "feedback": {**good["feedback"], "residuals": r}}

    bad = {
        "missing": with_residuals({k: v for k, v in res.items() if k != key}),
        "extra": with_residuals({**res, ("nope", 8): torch.zeros(world * 8)}),
        "wrong size": with_residuals({**res, key: torch.zeros(res[key].numel() - 1)}),
        "wrong dtype": with_residuals({**res, key: res[key].double()}),
    }
    out: dict = {"keys": len(res)}
    fresh = lf.register(_sharded(), codec=EF, error_feedback=True)  # a resumed job's state
    for name, state in (("trained", st), ("fresh", fresh)):
        before, it = _residuals(state), state.iter
        for what, sd in bad.items():
            try:
                state.load_state_dict(sd)
                out[name, what] = "accepted"
            except ValueError as exc:
                out[name, what] = str(exc)
        out[name, "unchanged"] = _same(before, _residuals(state)) and state.iter == it
    fresh.load_state_dict(good)  # the real one loads
    out["good loads"] = _same(_residuals(fresh), {k: v.to(fresh.device) for k, v in res.items()})
    return out


def test_fsdp_checkpoint_with_residuals_that_do_not_fit_is_refused_and_nothing_loads(ranks: list) -> None:
    for r in part(ranks, "checkpoint"):
        assert r["keys"] == 3  # one residual per FSDP module
        for name in ("trained", "fresh"):
            assert "no error-feedback residuals for" in r[name, "missing"], r[name, "missing"]
            assert "does not keep" in r[name, "extra"] and "nope" in r[name, "extra"], r[name, "extra"]
            assert "values, this state's has" in r[name, "wrong size"], r[name, "wrong size"]
            assert "float32" in r[name, "wrong dtype"] and "float64" in r[name, "wrong dtype"], r[name, "wrong dtype"]
            assert r[name, "unchanged"]
        assert r["good loads"]


# ------------------------------------------------------------------------------------------ item 8
def _body_nonfinite(rank: int, world: int) -> dict:
    out: dict = {}
    # training: Inf in rank 1's loss makes every gradient of rank 1 non-finite
    model = _sharded()
    st = lf.register(model, codec=EF, error_feedback=True)
    _step(model, rank, 0)
    first = _residuals(st)
    _step(model, rank, 1)
    out["finite step moves"] = [not torch.equal(first[k], v) for k, v in _residuals(st).items()]
    before = _residuals(st)
    _step(model, rank, 2, plant_inf=rank == 1)
    out["training kept"] = [torch.equal(before[k], v) for k, v in _residuals(st).items()]
    # one reduce-scatter whose Inf lies in rank 1's own chunk: only rank 1's reduced shard is non-finite,
    # rank 0 receives and holds only finite values
    codec = lowbit.get_codec(EF)
    state = lf.FSDPState(codec, None, True, None, None, None, rank, world, torch.device("cpu"))
    rs = lf.LowbitReduceScatter(state, "blk", 0, [128], [False], codec, lf._make_groups(dist.group.WORLD, None))
    shard = torch.empty(128)
    rs(shard, torch.randn(world * 128, generator=torch.Generator().manual_seed(rank)), dist.group.WORLD)
    before = _residuals(state)
    g = torch.randn(world * 128, generator=torch.Generator().manual_seed(10 + rank))
    if rank == 1:
        g[128 + 5] = float("inf")
    rs(shard, g, dist.group.WORLD)
    out["shard finite"] = bool(torch.isfinite(shard).all())
    out["shard kept"] = _same(before, _residuals(state))
    rs(shard, torch.randn(world * 128, generator=torch.Generator().manual_seed(20 + rank)), dist.group.WORLD)
    out["then moves"] = not _same(before, _residuals(state))  # the next finite step updates them again
    return out


def test_fsdp_non_finite_step_keeps_every_ranks_residuals(ranks: list) -> None:
    r0, r1 = part(ranks, "nonfinite")
    for r in (r0, r1):
        assert r["finite step moves"] == [True] * 3  # (the check below can fail)
        assert r["training kept"] == [True] * 3, r["training kept"]
        assert r["shard kept"] and r["then moves"]
    assert r0["shard finite"] and not r1["shard finite"]  # only rank 1 saw the Inf, yet rank 0 put its back


# ------------------------------------------------------------------------------------------ item 7
def _outcome(fn) -> tuple:
    t = time.monotonic()
    try:
        fn()
        return ("no error", "", None, time.monotonic() - t)
    except Exception as exc:  # noqa: BLE001 — reported to the test
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return (type(exc).__name__, str(exc), cause, time.monotonic() - t)


def _ddp_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _body_typo(rank: int, world: int) -> dict:
    typo = "qsgdd:bits=8"
    one = typo if rank == 1 else "qsgd:bits=8"
    return {
        "ddp": _outcome(lambda: lowbit.ddp.register(DDP(_ddp_net()), codec=one)),
        "fsdp": _outcome(lambda: lf.register(_sharded(), codec=one)),
        "fsdp param": _outcome(lambda: lf.register(_sharded(), codec="fp32", param_codec=one)),
        # the same typo on every rank (one script): each rank's own ValueError, as in one process
        "ddp all": _outcome(lambda: lowbit.ddp.register(DDP(_ddp_net()), codec=typo)),
        "fsdp all": _outcome(lambda: lf.register(_sharded(), codec=typo)),
        "after": _outcome(lambda: lf.register(_sharded(), codec="qsgd:bits=8")),  # the group still works
    }


def test_a_codec_typo_on_one_rank_raises_on_every_rank_at_once(ranks: list) -> None:
    r0, r1 = part(ranks, "typo")
    for what in ("ddp", "fsdp", "fsdp param"):
        for r in (r0, r1):
            kind, msg, cause, seconds = r[what]
            assert kind == "ConfigMismatchError", (what, r[what])
            assert "rank 1: invalid: unknown codec 'qsgdd'" in msg and "rank 0: " in msg, msg
            assert seconds < TIMEOUT_S / 3, (what, seconds)  # at once, not at the group's timeout
        assert r0[what][1] == r1[what][1]  # the same message on every rank
        assert r0[what][2] is None and r1[what][2] == "ValueError"  # rank 1's chained from its own error
    for what in ("ddp all", "fsdp all"):
        for r in (r0, r1):
            assert r[what][0] == "ValueError" and "unknown codec 'qsgdd'" in r[what][1], r[what]
    assert r0["after"][0] == r1["after"][0] == "no error"


@pytest.fixture(scope="module")
def ranks() -> list:
    return spawn(run_parts, 2, (("checkpoint", _body_checkpoint, ()), ("nonfinite", _body_nonfinite, ()),
                                ("typo", _body_typo, ())), backend="gloo", timeout_s=TIMEOUT_S)
