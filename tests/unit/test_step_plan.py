"""One plan of a step's messages (lowbit.timeline, issue 31 item 1): the groups lowbit.ddp's hook sends are
the messages codec="auto"'s replay (lowbit.choose.step_plan / simulate) prices, in every case the plan
distinguishes: codec changes, per-tensor codecs, a numeric message_mb and "auto" (closing at DDP's bucket
ends), fp32 riding in allgather messages, and trailing fp32 tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit.ddp as D
from lowbit import choose, timeline
from lowbit.codecs.base import get_codec

MiB = 2**20
Q8, Q4, ONEBIT = "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "onebit"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512),
                         nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


def _big_model() -> nn.Module:
    """67 MB of gradients: "auto" closes its messages at bucket ends once they hold 16 MiB."""
    return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])


def _hook_plan(model: nn.Module, plan: dict[str, str], message_mb, algorithm: str, bucket_mb: float):
    """The hook's groups as (spec, member names, rider names), and the state they were planned for."""
    state = D.make_state(model, Q8, algorithm=algorithm, message_mb=message_mb)
    state.plan = {**state.plan, **{n: get_codec(s) for n, s in plan.items()}}
    state.bucket_bytes = bucket_mb * MiB
    for name, p in model.named_parameters():
        state._numels[name] = p.numel()
    groups = sorted({id(g): g for g in D._plan_groups(state, 2, torch.device("cpu")).values()}.values(),
                    key=lambda g: g.index)
    out = []
    for g in groups:
        names = list(g.slot)
        members, riders = [], []
        for name in names:
            (members if sum(state._numels[m] for m in members) < g.n else riders).append(name)
        out.append((g.codec.spec, members, riders))
    return out, state


def _priced_plan(model: nn.Module, state, ride: bool, bucket_mb: float):
    """The messages choose.simulate replays for the same tensors, assignment and buckets."""
    names = [n for n in reversed(list(state.plan)) if n in set(state.params.values())]
    numels = [state._numels[n] for n in names]
    buckets = timeline.ddp_buckets(numels, bucket_mb * MiB)
    tl = choose.Timeline(tuple(choose.TensorTiming(n, k, 0.0, b) for n, k, b in zip(names, numels, buckets)),
                         backward_end_s=0.0, step_s=1.0, message_mb=state.message_mb, ride=ride)
    assignment = {n: state.plan[n].spec for n in names}
    costs = {}
    for spec in set(assignment.values()):
        c = get_codec(spec)
        costs[spec] = choose.CodecCost(spec, c.bits_per_value(1 << 20), c.sums_on_wire, 1.0, 0.0,
                                       per_tensor=c.per_tensor)
    plan = choose.step_plan(tl, assignment, costs)
    return [(m.spec, [names[i] for i in m.members], [names[i] for i in m.riders]) for m in plan.messages], plan, costs, tl


CASES = [
    # (layer codecs by parameter name prefix, message_mb, algorithm, bucket MiB[, model])
    ({}, "auto", "scatter_gather", 1, _big_model),
    ({"1.": Q4}, "auto", "scatter_gather", 3, _big_model),
    ({"0.": "fp32", "2.bias": "fp32"}, "auto", "allgather", 5, _big_model),
    ({}, "auto", "scatter_gather", 25),
    ({}, "auto", "scatter_gather", 1),
    ({}, 0, "scatter_gather", 25),
    ({}, 0.5, "scatter_gather", 2),
    ({"2.": Q4, "6.": Q4}, "auto", "scatter_gather", 1),
    ({"2.": Q4, "6.": Q4}, 1, "scatter_gather", 1),
    ({"4.": ONEBIT, "8.": ONEBIT}, "auto", "scatter_gather", 1),
    ({"0.": "fp32", "8.": "fp16"}, "auto", "allgather", 1),
    ({"0.": "fp32", "8.": "fp16"}, 2, "allgather", 1),
    ({"0.": "fp32", "4.": "fp32"}, "auto", "allgather", 2),
    ({"0.": "fp32", "4.": "fp32"}, 64, "allgather", 25),
    ({"0.": "fp32", "2.": "fp32"}, "auto", "scatter_gather", 1),
]


@pytest.mark.parametrize("codecs, message_mb, algorithm, bucket_mb, make", [c + (_model,) * (5 - len(c)) for c in CASES])
def test_the_hook_sends_the_plan_auto_prices(codecs, message_mb, algorithm: str, bucket_mb: float, make) -> None:
    model = make()
    plan = {n: spec for n, _ in model.named_parameters() for prefix, spec in codecs.items() if n.startswith(prefix)}
    hook, state = _hook_plan(model, plan, message_mb, algorithm, bucket_mb)
    priced, step, costs, tl = _priced_plan(model, state, algorithm == "allgather", bucket_mb)
    assert hook == priced
    assert len(step.messages) == len(hook) > 0
    # the replay's link time is one alpha (1 s, no per-value cost) per message and per native unit (one
    # collective per codec spec and DDP bucket)
    assignment = {t.name: state.plan[t.name].spec for t in tl.tensors}
    units = {(step.buckets[i], assignment[tl.tensors[i].name]) for i in step.native}
    assert choose.simulate(tl, assignment, costs) == pytest.approx(len(step.messages) + len(units))


def test_plan_step_is_pure_arithmetic() -> None:
    """Three tensors of one codec and an fp32 one between them: one message at "auto", the fp32 one
    natively with its bucket; riding, it travels in the message."""
    p = timeline.plan_step([100, 5, 100], ["q", "f", "q"], native={"f"})
    assert [m.members for m in p.messages] == [(0, 2)] and p.native == (1,)
    p = timeline.plan_step([100, 5, 100], ["q", "f", "q"], native={"f"}, rider="f")
    assert p.messages == (timeline.Message("q", (0, 2), (1,)),) and p.native == ()
    p = timeline.plan_step([100, 100, 5], ["q", "q", "f"], native={"f"}, rider="f", message_mb=0)
    assert [m.members for m in p.messages] == [(0,), (1,)] and p.messages[-1].riders == (2,)
    with pytest.raises(ValueError, match="2 tensor sizes for 3"):
        timeline.plan_step([1, 2], ["q", "q", "q"], native=())


def test_messages_whose_algorithm_takes_no_riders_carry_none() -> None:
    """scatter_gather and hierarchical messages (``riderless``) take no fp32 riders: the fp32 tensor goes
    natively, and riders waiting for the next message do too when that one takes none."""
    p = timeline.plan_step([100, 5, 100], ["q", "f", "q"], native={"f"}, rider="f", riderless={"q"})
    assert p.messages == (timeline.Message("q", (0, 2)),) and p.native == (1,)
    p = timeline.plan_step([5, 100, 5, 100], ["f", "h", "f", "q"], native={"f"}, rider="f", riderless={"h"},
                           message_mb=0)
    assert p.messages == (timeline.Message("h", (1,)), timeline.Message("q", (3,), (2,))) and p.native == (0,)
    p = timeline.plan_step([100, 5], ["h", "f"], native={"f"}, rider="f", riderless={"h"}, message_mb=1)
    assert p.messages == (timeline.Message("h", (0,)),) and p.native == (1,)  # no last message to ride in


@pytest.mark.parametrize("message_mb, algorithm, fp32_prefix", [("auto", "scatter_gather", ""), (0.5, "scatter_gather", ""),
                                                                ("auto", "allgather", "0."), (2, "allgather", "0.")])
def test_the_speed_model_prices_the_plan_the_hook_sends(monkeypatch, message_mb, algorithm: str, fp32_prefix: str) -> None:
    """perfmodel.model.simulate_step, on a model's tensors as layers, prices the hook's messages."""
    from lowbit.lab.perfmodel import model as pm
    from lowbit.lab.perfmodel.collectives import Topology
    from lowbit.lab.perfmodel.links import Link

    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(12)])
    plan = {n: "fp32" for n, _ in net.named_parameters() if fp32_prefix and n.startswith(fp32_prefix)}
    hook, _ = _hook_plan(net, plan, message_mb, algorithm, 1)
    names = [n for n, _ in net.named_parameters()]  # forward order, as the speed model takes layers
    layers = [pm.Layer(n, p.numel(), 1e-3) for n, p in net.named_parameters()]
    q = pm.LayerCodec(8.0625, algorithm, label=Q8)
    codecs = [pm.LayerCodec(32.0, "allreduce", label="fp32") if n in plan else q for n in names]
    seen = []
    monkeypatch.setattr(pm, "plan_step", lambda *a, **k: seen.append(timeline.plan_step(*a, **k)) or seen[-1])
    pm.simulate_step(layers, Topology(2, 2, Link(1e-5, 1e9)), algorithm="allreduce", bits=32.0, layer_codecs=codecs,
                     bucket_bytes=MiB, first_bucket_bytes=MiB, message_mb=message_mb)
    ready = list(reversed(names))
    priced = [(get_codec(Q8).spec, [ready[i] for i in m.members], [ready[i] for i in m.riders]) for m in seen[0].messages]
    assert priced == hook and hook


def test_the_hook_splits_messages_by_algorithm_as_the_replay_prices_them() -> None:
    """codec="auto" on several nodes sends some tensors hierarchically (state.algorithms): the hook's groups
    never mix algorithms, and are the messages the replay prices for the same choices."""
    model = _model()
    state = D.make_state(model, Q8, message_mb="auto")
    state.bucket_bytes = 1 * MiB
    state.algorithms = {n: "hierarchical" for n, _ in model.named_parameters() if n in ("2.weight", "6.weight")}
    groups = sorted({id(g): g for g in D._plan_groups(state, 4, torch.device("cpu")).values()}.values(),
                    key=lambda g: g.index)
    hook = [(g.algorithm, sorted(g.slot)) for g in groups]
    assert ("hierarchical", ["2.weight"]) in hook and ("hierarchical", ["6.weight"]) in hook
    assert all(g.exact == 0 for g in groups)  # neither scatter_gather nor hierarchical takes riders
    names = [n for n in reversed(list(state.plan))]
    numels = [state._numels[n] for n in names]
    tl = choose.Timeline(tuple(choose.TensorTiming(n, k, 0.0, b) for n, k, b in
                               zip(names, numels, timeline.ddp_buckets(numels, MiB))), 0.0, 1.0, "auto")
    assignment = {n: choose.choice(state.plan[n].spec, state.algorithms.get(n)) for n in names}
    costs = {}
    for key in set(assignment.values()):
        spec, algo = choose.split_choice(key)
        c = get_codec(spec)
        costs[key] = choose.CodecCost(key, c.bits_per_value(1 << 20), c.sums_on_wire, 1.0, 0.0,
                                      algorithm="allreduce" if c.sums_on_wire else algo or "scatter_gather")
    priced = [(costs[m.spec].algorithm, sorted(names[i] for i in m.members))
              for m in choose.step_plan(tl, assignment, costs).messages]
    assert priced == hook
