"""algorithm="hierarchical" on gloo: 4 ranks as 2 nodes x 2 (and as 1 x 4, 4 x 1).

Identical results on every rank, within the codec's error of the exact mean, bytes counted from the
buffers equal to the formula (inter-node bytes too), error feedback on the node sums, and the DDP hook.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.codecs.base import get_codec
from lowbit.comm.allreduce import CommStats, bytes_sent_per_rank
from lowbit.comm.hierarchical import bytes_between_nodes
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

CODECS = ["qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "onebit:bucket=64", "dettmers:type=dynamic,bucket=4096"]
SIZES = (1, 3, 4097, 50_001)
BOUND = {"qsgd:bits=8,bucket=512": 0.02, "dettmers:type=dynamic,bucket=4096": 0.05}  # relative L2 error of the mean


@pytest.fixture(scope="module")
def ranks() -> list:
    parts = (("allreduce", _body, ()), ("ddp", _ddp_body, ()), ("one_node", _one_node_body, ()),
             ("auto", _auto_body, ()))
    return spawn(run_parts, 4, parts, backend="gloo", timeout_s=120)


def _x(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n))


def _body(rank: int, world: int) -> dict:
    out: dict = {}
    for node_size in (2, 4, 1):
        for spec in CODECS:
            for n in SIZES:
                x = _x(rank, n)
                exact = x.double().clone()
                dist.all_reduce(exact)
                exact /= world
                t = x.clone()
                st = CommStats()
                lowbit.all_reduce(t, spec, algorithm="hierarchical", op="mean", node_size=node_size, stats=st,
                                  key=("h", node_size, spec, n), seed=3)
                err = float((t.double() - exact).norm() / exact.norm())
                out[(node_size, spec, n)] = (t, err, st.bytes_sent, st.bytes_inter, st.calls)
    # error feedback on the node sums: the same input every step; the time average of the results
    # converges to the exact mean (EF: the error of the average is |last residual| / steps), which the
    # biased codec alone does not reach
    x = _x(rank, 4097)
    exact = x.double().clone()
    dist.all_reduce(exact)
    exact /= world
    for fb in (True, False):
        ef = lowbit.ErrorFeedback("onebit:bucket=64") if fb else None
        acc = torch.zeros(4097, dtype=torch.float64)
        # (without feedback: the same input gives the same result every step (onebit is deterministic), so
        # its error, measured 0.59, is the same after 10 steps as after 100)
        steps = 100 if fb else 10
        for s in range(steps):
            t = x.clone()
            lowbit.all_reduce(t, "onebit:bucket=64", algorithm="hierarchical", op="mean", node_size=2,
                              feedback=ef, key=("ef", fb), seed=s)
            acc += t.double()
        out[("ef", fb)] = float((acc / steps - exact).norm() / exact.norm())
    # one node: nothing is compressed, per-tensor codecs (per-column 1bitSGD) included
    t = x.clone()
    st = CommStats()
    lowbit.all_reduce(t, "onebit:bucket=0", algorithm="hierarchical", op="mean", node_size=4, stats=st)
    out["one-node-per-tensor"] = (float((t.double() - exact).norm() / exact.norm()), st.bytes_sent,
                                  bytes_sent_per_rank(get_codec("onebit:bucket=0"), 4097, 4, "hierarchical",
                                                      rank, node_size=4))
    # the mean of values near float32's max: finite in, finite out (sums at 2^-ceil(log2 K) of the values)
    huge = torch.full((4097,), 3.0e38) * (1 if rank % 2 else 0.9)
    for spec in ("fp32", "qsgd:bits=8,bucket=512"):
        t = huge.clone()
        lowbit.all_reduce(t, spec, algorithm="hierarchical", op="mean", node_size=2, key=("huge", spec))
        out[("huge", spec)] = (bool(torch.isfinite(t).all()), float((t.double() - 0.95 * 3.0e38).abs().max() / 3.0e38))
    # a node size that does not divide the group, on every rank alike
    try:
        lowbit.all_reduce(x.clone(), "qsgd:bits=8", algorithm="hierarchical", node_size=3)
        out["bad"] = None
    except ValueError as exc:
        out["bad"] = str(exc)
    return out


def test_hierarchical_allreduce_on_2_nodes_of_2(ranks: list) -> None:
    res = part(ranks, "allreduce")
    r0 = res[0]
    for key, v in r0.items():
        if not isinstance(key, tuple) or key[0] in ("ef", "huge"):
            continue
        node_size, spec, n = key
        t, err, sent, inter, calls = v
        for r in range(1, 4):
            assert torch.equal(t, res[r][key][0]), (key, r)  # bit-identical on every rank
        assert calls == 1
        codec = get_codec(spec)
        for r in range(4):
            _, _, sent_r, inter_r, _ = res[r][key]
            assert sent_r == bytes_sent_per_rank(codec, n, 4, "hierarchical", r, node_size=node_size), (key, r)
            assert inter_r == bytes_between_nodes(codec, n, 4, node_size, r), (key, r)
        if node_size == 4:  # one node: nothing is compressed, the mean is fp32's
            assert inter == 0 and err < 1e-6, (key, err)
        elif spec in BOUND and n > 1:
            assert err < BOUND[spec], (key, err)
        if node_size == 2 and n > 1000:
            # between nodes only the compressed half-tensor: far fewer bytes than the fp32 traffic inside
            assert 0 < inter < 0.5 * (sent - inter), (key, inter, sent)
    assert r0[("ef", True)] < 0.07 and r0[("ef", False)] > 0.3, (r0[("ef", True)], r0[("ef", False)])
    for spec in ("fp32", "qsgd:bits=8,bucket=512"):
        finite, rel = r0[("huge", spec)]
        assert finite and rel < 0.02, (spec, rel)
    err, sent, predicted = r0["one-node-per-tensor"]
    assert err < 1e-6 and sent == predicted > 0
    assert r0["bad"] is not None and "do not split into nodes of 3" in r0["bad"]


def _ddp_body(rank: int, world: int) -> tuple[list, int, int]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DDP(net, bucket_cap_mb=0.05)
    state = lowbit.ddp.register(model, codec="qsgd:bits=4,bucket=512", algorithm="hierarchical", node_size=2,
                                start_iter=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x = torch.randn(16, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], state.stats.bytes_sent, state.stats.bytes_inter


def test_ddp_hook_hierarchical_keeps_replicas_identical(ranks: list) -> None:
    res = part(ranks, "ddp")
    for r in range(1, 4):
        for a, b in zip(res[0][0], res[r][0]):
            assert torch.equal(a, b)
    assert 0 < res[0][2] < res[0][1]


def _auto_body(rank: int, world: int) -> dict:
    """codec="auto" told of 2 nodes of 2 (node_size=2): it probes and weighs the hierarchical algorithm too.
    Every lowbit collective crosses an emulated 20 MB/s link, so compression pays and the finalists run."""
    import lowbit.comm.collectives as C

    C.emulate_link(20e6)
    try:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)))
        state = lowbit.ddp.make_state(model.module, codec="auto", node_size=2, measure_steps=2)
        model.register_comm_hook(state, lowbit.ddp.hook)  # (a framework's way: the fp32 steps cross the link too)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(state.auto.last_decision_step(state.start_iter) + 2):
            x = torch.randn(32, 64, generator=g)
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (32,), generator=g))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        C.emulate_link(None)
    d = state.auto.decision
    return {"node_size": state.auto.node_size, "costs": state.auto.measured["costs"], "assignment": d.assignment,
            "tried": [(label, d.algorithms_of(a)) for label, a, _ in d.finalists], "measured": d.measured_s,
            "chosen": d.algorithms_of(d.assignment), "table": d.table(), "now": dict(state.algorithms),
            "params": [p.detach().clone() for p in model.parameters()]}


def test_auto_weighs_the_hierarchical_algorithm_on_two_nodes(ranks: list) -> None:
    res = part(ranks, "auto")
    r0 = res[0]
    assert r0["node_size"] == 2
    hier = {k: c for k, c in r0["costs"].items() if k.endswith("@hierarchical")}
    assert hier and all(c["algorithm"] == "hierarchical" for c in hier.values())  # probed, as choices of their own
    assert {c["algorithm"] for k, c in r0["costs"].items() if k not in hier} == {"allreduce", "scatter_gather"}
    # tried on the job (measured), and named, flat and hierarchical alike
    assert any("hierarchical" in algos for _, algos in r0["tried"]), r0["table"]
    assert any("scatter_gather" in algos for _, algos in r0["tried"]), r0["table"]
    assert all(label in r0["measured"] for label, _ in r0["tried"])
    assert "hierarchical" in r0["table"] and r0["chosen"]
    for r in res[1:]:
        assert r["assignment"] == r0["assignment"] and r["now"] == r0["now"]
        for a, b in zip(r0["params"], r["params"]):
            assert torch.equal(a, b)  # replicas identical through every finalist's algorithms


def _one_node_body(rank: int, world: int) -> tuple[list, bool, int, int]:
    """hierarchical with all ranks in one node installs no hook: DDP's own allreduce, bit for bit."""
    out = []
    for how in ("plain", "register", "make_state"):  # make_state: a framework installs lowbit.ddp.hook itself
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)), bucket_cap_mb=0.01)
        if how == "register":
            state = lowbit.ddp.register(model, codec="onebit:bucket=64", algorithm="hierarchical", node_size=4)
        elif how == "make_state":
            hooked = lowbit.ddp.make_state(model.module, codec="onebit:bucket=64", algorithm="hierarchical",
                                           node_size=4, start_iter=0)
            model.register_comm_hook(hooked, lowbit.ddp.hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(4):
            x = torch.randn(16, 32, generator=g)
            y = torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out, state.one_node, state.stats.calls, state.iter, hooked.stats.bytes_inter


def test_ddp_hierarchical_in_one_node_is_plain_ddp(ranks: list) -> None:
    for (plain, ours, hooked), one_node, calls, it, inter in part(ranks, "one_node"):
        assert one_node and calls == 0 and it == 0 and inter == 0
        for a, b, c in zip(plain, ours, hooked):
            assert torch.equal(a, b)
            assert torch.allclose(a, c, rtol=1e-6, atol=1e-7)  # the hook's fp32 mean: the same sums


def test_hierarchical_needs_a_node_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowbit.comm.hierarchical import node_size_for

    for var in ("LOWBIT_NODE_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="ranks per node"):
        node_size_for(None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert node_size_for(None) == 1  # no process group: one process, in one node
    monkeypatch.setenv("LOWBIT_NODE_SIZE", "0")  # the emulation's variable wins over torchrun's
    with pytest.raises(ValueError, match="LOWBIT_NODE_SIZE must be a positive int"):
        node_size_for(None)
    monkeypatch.setenv("LOWBIT_NODE_SIZE", "two")
    with pytest.raises(ValueError, match="LOWBIT_NODE_SIZE"):
        node_size_for(None)
    with pytest.raises(ValueError, match="positive int"):
        node_size_for(None, 0)
