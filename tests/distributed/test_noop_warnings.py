"""A register that installs nothing says so: once, on rank 0, with the reason (issue 33, item 1).

Training that silently runs uncompressed while the user believes it compresses is the failure these
tests guard against: one process, hierarchical inside one node, codec="auto" keeping fp32."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
import lowbit.comm.registration
import lowbit.ddp
from lowbit.launch import spawn


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))


def _lowbit_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and str(w.message).startswith("lowbit:")]


def test_register_on_one_rank_warns_once_with_the_reason(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("lowbit.comm.registration._SAID", set())
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # "once" must be lowbit's doing, not the warnings filter's
            for _ in range(2):
                state = lowbit.ddp.register(DDP(_net()), codec="qsgd:bits=8,bucket=512")
                assert state is not None
    finally:
        dist.destroy_process_group()
    said = _lowbit_warnings(caught)
    assert len(said) == 1, said
    assert "1 rank" in said[0] and "torchrun --nproc-per-node 2" in said[0]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _body_two_ranks(rank: int, world: int) -> dict:
    lowbit.comm.registration._SAID.clear()  # (a fresh process: for clarity)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # hierarchical with both ranks in one node: nothing crosses nodes, no hook
        hier = DDP(_net())
        s1 = lowbit.ddp.register(hier, codec="qsgd:bits=4", algorithm="hierarchical", node_size=2)
        s2 = lowbit.ddp.register(DDP(_net()), codec="qsgd:bits=4", algorithm="hierarchical", node_size=2)
    handler = _Records()
    log = logging.getLogger("lowbit.ddp")  # (auto.ddp_tuner logs as lowbit.ddp)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        # codec="auto" allowed fp32 only: it decides fp32 everywhere, and must say so
        model = DDP(_net())
        auto = lowbit.ddp.register(model, codec="auto", allow=["fp32"])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for _ in range(auto.auto.last_decision_step(auto.start_iter) + 1):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        log.removeHandler(handler)
    return {"said": _lowbit_warnings(caught), "one_node": (s1.one_node, s2.one_node),
            "hooks": len(hier._comm_hooks), "decided": auto.auto.decision is not None,
            "fp32": auto.auto.decision is not None and auto.auto.decision.fp32_is_best,
            "auto_warnings": [r.getMessage() for r in handler.records if r.levelno >= logging.WARNING]}


def test_no_op_registers_warn_on_rank_0_only_once_with_the_reason() -> None:
    r0, r1 = spawn(_body_two_ranks, 2, backend="gloo")
    for r in (r0, r1):
        assert r["one_node"] == (True, True) and r["hooks"] == 0
        assert r["decided"] and r["fp32"]
    # hierarchical in one node: one warning (two registers), on rank 0 only, naming the reason
    assert len(r0["said"]) == 1 and "one node" in r0["said"][0] and "no hook" in r0["said"][0], r0["said"]
    assert r1["said"] == []
    # auto keeping fp32: one warning line on rank 0 that gives the reason
    assert len(r0["auto_warnings"]) == 1, r0["auto_warnings"]
    line = r0["auto_warnings"][0]
    assert "keeps fp32 everywhere" in line and "not compressed" in line and "faster than fp32" in line
    assert r1["auto_warnings"] == []
