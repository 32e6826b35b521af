"""lowbit.fsdp's codec="auto" on FSDP2 over gloo (CPU): the big modules compressed on
an emulated slow one, every rank alike, the decision kept in checkpoints, the guard stepping a module up
(on non-finite gradients, on a reported loss that grows or is not finite), allow= and its checks. The rule
alone, in one process: tests/unit/test_fsdp_auto_rule.py.

The 2-rank checks share one spawn (tests/distributed/shared_spawn.py); each part sets its own link."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import lowbit
import lowbit.comm.collectives as C
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api.FSDPModule, "set_custom_reduce_scatter"):  # pragma: no cover
    pytest.skip("this torch's FSDP2 has no custom reduce-scatter", allow_module_level=True)

from torch.distributed.fsdp import fully_shard  # noqa: E402

import lowbit.fsdp as lf  # noqa: E402

# Runs beside `make test`'s other worker: what these checks judge by time is an emulated link (LINK: a
# sleep per reduce-scatter) slow enough that compression's saving outweighs what a busy machine adds to the
# compute. At 20 MB/s (rank 1: 10) a loaded run measured bf16 at 0.91x native (110.9 vs 121.6 ms a step:
# the link's 53 ms partly hidden behind the backward), failing the 0.9x check; at LINK they hold it twice
# as long, and a run here measured 8-bit QSGD at 0.42-0.50x native. The rule's close calls (ties within
# 3 %) are timed alone in tests/unit/test_fsdp_auto_rule.py.
LINK = 10e6

Q8 = lowbit.get_codec("qsgd:bits=8,bucket=512").spec
BF16 = lowbit.get_codec("bf16").spec
BLOCKS = ("blocks.0", "blocks.1")


class Net(nn.Module):
    """Two blocks (each its own fully_shard) and a root below 10,000 values (auto keeps it native). Width
    256: blocks of 66,304 values and a root of 9,476; width 100: blocks of 10,300 (barely big). ``frozen``:
    each block also holds a frozen, unused 256 x 257 parameter (made after the rest: the same trained
    weights), whose values its reduce-scatter leaves out."""

    def __init__(self, width: int = 256, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(2))
        self.head = nn.Linear(width, 4)
        if frozen:  # (a parameter of the Sequential itself: a submodule would join its forward chain)
            for b in self.blocks:
                b.register_parameter("frozen", nn.Parameter(torch.randn(256, 257), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _model(width: int = 256, frozen: bool = False, **kw) -> tuple[nn.Module, lf.FSDPState]:
    m = Net(width, frozen)
    for b in m.blocks:
        fully_shard(b)
    fully_shard(m)
    return m, lf.register(m, codec="auto", **kw)


def _train(model: nn.Module, rank: int, steps: int, start: int = 0, nan_at: int | None = None,
           state: lf.FSDPState | None = None, report=None) -> None:
    """SGD on random regression batches (each rank its own: the ranks' gradients differ); ``nan_at``: that
    step's loss (so every gradient) is NaN; ``report(step, loss)``: the loss reported to ``state.auto``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(16, 32, generator=g)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        if i == nan_at:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if report is not None:
            state.auto.report_loss(report(i, loss.detach()))


def _train_to_decision(model: nn.Module, rank: int, state: lf.FSDPState, steps: int, extra: int = 6) -> None:
    """_train for ``steps`` steps, then on (at most ``extra`` more) until auto has decided: a second pass
    over close finalists takes 3 steps each (the same on every rank: the ranks agree on which)."""
    _train(model, rank, steps)
    for i in range(steps, steps + extra):
        if state.auto.decision is not None:
            break
        _train(model, rank, 1, start=i)


def _train_accum(model: nn.Module, rank: int, steps: int, start: int = 0, nan_from: int | None = None,
                 until=None) -> int:
    """_train with 2 micro-batches a step, the first without reduce-scatter (set_requires_gradient_sync(False));
    ``nan_from``: from that step on the gradients are NaN; ``until()``: stop after the step where it is true.
    Returns the steps run."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(start, start + steps):
        opt.zero_grad()
        for j in range(2):
            model.set_requires_gradient_sync(j == 1)
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1000 * i + 10 * j + rank))
            loss = (model(x) - x[:, :4]).pow(2).mean()
            if nan_from is not None and i >= nan_from:
                loss = loss * float("nan")
            loss.backward()
        opt.step()
        if until is not None and until():
            return i - start + 1
    return steps


def _running(state: lf.FSDPState) -> dict[str, str]:
    """What each module's reduce-scatter runs now (not what the tuner says it runs)."""
    return {name: ex.choice for name, ex in state.auto.exchanges.items()}


def _decision(state: lf.FSDPState) -> dict:
    a = state.auto
    return {"decision": a.decision, "decided": a.decided_iter, "measured": a.measured_s, "chosen": a.chosen,
            "finalists": [label for label, _ in a.finalists], "retried": a.retried, "errors": a.errors, "limits": a.limits,
            "noise": a.noise, "running": _running(state), "table": a.table()}


def _body_slow(rank: int, world: int, path: str) -> dict:
    """LINK, 10 MB/s (rank 1: 5 MB/s, so the ranks measure differently): a block's fp32 gradients (265 KB a
    reduce-scatter) take 26-53 ms a step each. Then a checkpoint resumed by a new job, whose guard steps
    the compressed modules up when the gradients turn NaN."""
    C.emulate_link(LINK / (1 + rank))
    m, st = _model(guard_every=2)
    _train_to_decision(m, rank, st, 12)
    out = _decision(st)
    out["bytes_per_step"] = _bytes_per_step(m, st, rank, 12)
    torch.save(st.state_dict(), f"{path}.{rank}")
    m2, st2 = _model(guard_every=2)
    st2.load_state_dict(torch.load(f"{path}.{rank}", weights_only=False))
    out["resumed"] = {"phase": st2.auto.phase, "running": _running(st2), "decided": st2.auto.decided_iter}
    _train(m2, rank, 2, start=13)
    out["resumed_after"] = {"phase": st2.auto.phase, "running": _running(st2), "measured": st2.auto.measured_s}
    _train(m2, rank, 6, start=15, nan_at=15)
    out["guard"] = {"changes": st2.auto.changes, "assignment": dict(st2.auto.assignment), "running": _running(st2)}
    again = _model(guard_every=2)[1]
    again.load_state_dict(st2.state_dict())
    out["guard_resumed"] = {"changes": again.auto.changes, "running": _running(again)}
    C.emulate_link(None)
    return out


def _body_accum(rank: int, world: int) -> dict:
    """Gradient accumulation, 2 micro-batches a step, over the slow part's link: a step is the passes up to
    the one that reduce-scatters (the sample, the trials' timed steps and the guard's checks on those).
    Then NaN gradients: the guard sees them on the synced micro-batch and steps the compressed modules up
    (guard_every 3, odd: counting passes as steps, its watched passes would alternate between unsynced ones,
    "finite", and synced ones, never two non-finite checks in a row)."""
    C.emulate_link(LINK / (1 + rank))
    m, st = _model(guard_every=3)
    out = _decision(st)
    out["steps_to_decide"] = _train_accum(m, rank, 30, until=lambda: st.auto.decision is not None)
    out.update(_decision(st))
    out["iter"] = st.iter  # reduce-scatter calls: 3 modules a step
    C.emulate_link(None)
    n = out["steps_to_decide"]
    _train_accum(m, rank, 8, start=n, nan_from=n + 1)
    out["guard"] = {"changes": st.auto.changes, "running": _running(st)}
    return out


def _body_bold(rank: int, world: int) -> dict:
    """auto_level="bold" over the same slow link: 4-bit QSGD weighed up to the sampling noise, 1bitSGD* (biased)
    up to 8-bit QSGD's error."""
    C.emulate_link(LINK / (1 + rank))
    m, st = _model(auto_level="bold", guard_every=0)
    _train_to_decision(m, rank, st, 2 + 3 * 5 + 1, extra=3 * 5)
    out = _decision(st)
    out["residuals"] = sorted({key[0] for key in st.feedback.residuals})
    C.emulate_link(None)
    return out


def _body_frozen(rank: int, world: int) -> dict:
    """Bold's sampling noise on blocks with and without frozen parameters that their reduce-scatters leave
    out (the same trained weights and batches, so the same gradient rows): admission only (3 steps)."""
    out = {}
    for frozen in (False, True):
        m, st = _model(frozen=frozen, auto_level="bold", guard_every=0)
        _train(m, rank, 3)
        out[frozen] = {"noise": st.auto.noise, "errors": st.auto.errors, "numels": dict(st.auto.numels)}
    return out


_FIRST_CHECK = 13  # the first step the guard watches


def _body_loss(rank: int, world: int, path: str) -> dict:
    """The loss rule, on the slow part's checkpoint resumed (no measuring; no slow link needed) with its
    decision made 8-bit QSGD on both blocks (the slow part may choose bf16), the guard checking every 2
    steps (at steps 14, 16 and 18: each check takes the losses reported since the last). Rank 1 alone
    reports a loss 100x at step 15 (the ranks' mean about 25x its lowest at the check after) and NaN at
    step 17; rank 0 reports its loss as it is."""
    m, st = _model(guard_every=2)
    saved = torch.load(f"{path}.{rank}", weights_only=False)
    q8 = {n: Q8 if n in BLOCKS else "native" for n in saved["auto"]["decision"]}
    saved["auto"].update(decision=q8, assignment=dict(q8), chosen=Q8)
    # the guard watches steps 13, 15, 17 (its checks at 14, 16, 18) whenever the slow part decided: that
    # step varies with the load (a finalist's second pass), and a first watch at 14 moves the step-up
    # (two fresh-clone CI runs of 12-03 saw no change at step 15; forcing 14 here fails the same way)
    saved["auto"]["guard"]["next_check"] = _FIRST_CHECK
    st.load_state_dict(saved)

    def report(i: int, loss: torch.Tensor):
        if rank == 1 and i == 15:
            return 100 * loss  # a tensor
        return float("nan") if rank == 1 and i == 17 else float(loss)  # a float

    _train(m, rank, 6, start=13, state=st, report=report)
    out = {"changes": st.auto.changes, "assignment": dict(st.auto.assignment), "running": _running(st),
           "loss_best": st.auto.guard.loss_best}
    again = _model(guard_every=2)[1]
    again.load_state_dict(st.state_dict())
    out["resumed"] = {"changes": again.auto.changes, "running": _running(again),
                      "loss_best": again.auto.guard.loss_best}
    return out


def _body_options(rank: int, world: int) -> dict:
    """allow= (and error_budget=) through register, in the configuration the ranks compare: the same on
    both ranks, then differing (the same ConfigMismatchError on every rank)."""
    out = {}
    st = _model(allow=["bf16"], error_budget=2)[1]
    out["allow"], out["config"] = st.auto.allow, st.config()["auto"]
    for name, kw in (("allow_differs", dict(allow=["bf16"] if rank == 0 else ["bf16", "qsgd:bits=8,bucket=512"])),
                     ("budget_differs", dict(error_budget=1.0 if rank == 0 else None))):
        try:
            _model(**kw)
            out[name] = None
        except lowbit.ddp.ConfigMismatchError as e:
            out[name] = str(e)
    # a checkpoint whose auto decision fits but whose error-feedback entry does not: nothing loads
    m, st = _model(allow=[Q8, "onebit:bucket=64"])
    saved = st.state_dict()
    one = {n: "onebit:bucket=64" if n in BLOCKS else "native" for n in st.auto.exchanges}
    saved["auto"].update(decision=one, assignment=dict(one), chosen="onebit:bucket=64", decided_iter=5, forwards=5)
    saved["feedback"] = {"codec": "qsgd:bits=2", "residuals": {}}
    try:
        st.load_state_dict(saved)
        out["half_loaded"] = None
    except ValueError as e:
        out["half_loaded"] = {"error": str(e), "decision": st.auto.decision, "steps": st.auto.steps,
                              "running": _running(st)}
    # node_size=1: two nodes of one rank; FSDP's own reduce-scatter (auto's warm-up) sends all it sends
    # across them (K - 1 chunks a rank: every other rank is on another node)
    m, st = _model(node_size=1)
    _train(m, rank, 1)
    out["native_nodes"] = {"sent": st.grad_stats.bytes_sent, "inter": st.grad_stats.bytes_inter,
                           "running": set(_running(st).values())}
    return out


def _bytes_per_step(m: nn.Module, st: lf.FSDPState, rank: int, start: int) -> int:
    before = st.grad_stats.bytes_sent
    _train(m, rank, 1, start=start)
    return st.grad_stats.bytes_sent - before


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list:
    path = str(tmp_path_factory.mktemp("fsdp_auto") / "auto.pt")
    parts = (("slow", _body_slow, (path,)), ("loss", _body_loss, (path,)), ("accum", _body_accum, ()),
             ("bold", _body_bold, ()), ("frozen", _body_frozen, ()),
             ("options", _body_options, ()))
    return spawn(run_parts, 2, parts, backend="gloo", timeout_s=240)


def test_slow_link_compresses_the_big_modules_and_ranks_agree(ranks: list) -> None:
    r0, r1 = part(ranks, "slow")
    for key in ("decision", "measured", "chosen", "errors", "limits"):
        assert r0[key] == r1[key], key  # the agreed (averaged) times and errors: the same everywhere
    d = r0["decision"]
    assert d["<root>"] == "native"  # below 10,000 values
    assert all(d[b] != "native" for b in BLOCKS), r0["table"]
    assert r0["running"] == d
    # 2 warm-up steps, then 1 + 2 steps a finalist, and again for those within 10 % of the fastest
    assert r0["decided"] == 2 + 3 * (len(r0["finalists"]) + len(r0["retried"])), r0["table"]
    # the conservative level: every codec within 8-bit QSGD's error, which is its own limit
    for name in BLOCKS:
        assert r0["errors"][name][Q8] == r0["limits"][name] > 0
        assert r0["errors"][name][d[name]] <= r0["limits"][name]
    assert r0["measured"][r0["chosen"]] < 0.9 * r0["measured"]["native"], r0["table"]
    native_bytes = 2 * 66_304 * 4 // 2 + 9_476 * 4 // 2  # (K-1) x S float32 values a module, K = 2 (no padding)
    assert 0 < r0["bytes_per_step"] < 0.7 * native_bytes


def test_gradient_accumulation_steps_are_the_passes_that_reduce_scatter(ranks: list) -> None:
    """2 micro-batches a step: auto measures on steps (not passes) and compresses as without accumulation."""
    r0, r1 = part(ranks, "accum")
    for key in ("decision", "measured", "chosen", "errors", "limits"):
        assert r0[key] == r1[key], key
    d = r0["decision"]
    assert d["<root>"] == "native" and all(d[b] != "native" for b in BLOCKS), r0["table"]
    assert r0["running"] == d
    # 2 warm-up steps, then 1 + 2 a finalist and again for the close ones (each step 2 passes, one
    # reduce-scatter a module); decided at the first pass of the step after
    trial_steps = 3 * (len(r0["finalists"]) + len(r0["retried"]))
    assert r0["decided"] == r0["steps_to_decide"] - 1 == 2 + trial_steps, r0["table"]
    assert r0["iter"] == 3 * r0["steps_to_decide"]
    for name in BLOCKS:
        assert math.isfinite(r0["errors"][name][Q8]) and r0["errors"][name][Q8] == r0["limits"][name] > 0
    assert r0["measured"][r0["chosen"]] < 0.9 * r0["measured"]["native"], r0["table"]


def test_guard_sees_non_finite_gradients_under_gradient_accumulation(ranks: list) -> None:
    r0, r1 = (r["guard"] for r in part(ranks, "accum"))
    assert r0 == r1
    compressed = {n for n, k in part(ranks, "accum")[0]["decision"].items() if k != "native"}
    assert compressed and {c["tensor"] for c in r0["changes"]} == compressed, r0["changes"]
    assert all(c["to"] == "native" and "not finite" in c["reason"] for c in r0["changes"]), r0["changes"]
    assert set(r0["running"].values()) == {"native"}


def test_checkpoint_resumes_the_decision_without_measuring(ranks: list) -> None:
    for r in part(ranks, "slow"):
        assert r["resumed"] == {"phase": "done", "running": r["decision"], "decided": r["decided"]}
        assert r["resumed_after"] == {"phase": "done", "running": r["decision"], "measured": r["measured"]}


def test_guard_steps_a_module_with_non_finite_gradients_up_to_native(ranks: list) -> None:
    r0, r1 = (r["guard"] for r in part(ranks, "slow"))
    assert r0 == r1  # every rank alike
    stepped = {c["tensor"] for c in r0["changes"]}
    compressed = {n for n, k in part(ranks, "slow")[0]["decision"].items() if k != "native"}
    assert stepped == compressed and all(c["to"] == "native" and "not finite" in c["reason"] for c in r0["changes"])
    assert all(c["step"] > 15 for c in r0["changes"])  # after the NaN step, not before
    assert set(r0["assignment"].values()) == set(r0["running"].values()) == {"native"}
    resumed = part(ranks, "slow")[0]["guard_resumed"]
    assert resumed["changes"] == r0["changes"] and resumed["running"] == r0["running"]


def test_a_reported_loss_that_grows_or_is_not_finite_steps_compressed_modules_up(ranks: list) -> None:
    r0, r1 = part(ranks, "loss")
    assert r0 == r1  # every rank alike, though only rank 1 reported the bad losses
    compressed = list(BLOCKS)  # 8-bit QSGD (the root native)
    grew = [c for c in r0["changes"] if c["step"] == 15]
    assert sorted(c["tensor"] for c in grew) == compressed  # every compressed module ...
    assert all(c["from"] == Q8 and c["to"] == BF16 and "reported loss" in c["reason"] for c in grew)  # ... one up
    nan = [c for c in r0["changes"] if c["step"] == 17]
    assert sorted(c["tensor"] for c in nan) == compressed
    assert all(c["to"] == "native" and c["reason"] == "the reported loss is not finite" for c in nan)
    assert len(r0["changes"]) == 2 * len(compressed)  # nothing else, nothing before step 15
    assert set(r0["assignment"].values()) == set(r0["running"].values()) == {"native"}
    assert 0 < r0["loss_best"] < 1e3
    assert r0["resumed"] == {"changes": r0["changes"], "running": r0["running"], "loss_best": r0["loss_best"]}


def test_allow_and_error_budget_are_part_of_the_configuration_the_ranks_compare(ranks: list) -> None:
    for r in part(ranks, "options"):
        assert r["allow"] == [BF16]
        assert r["config"] == {"level": "conservative", "guard_every": 50, "allow": [BF16], "error_budget": 2.0}
    for name in ("allow_differs", "budget_differs"):
        msgs = [r[name] for r in part(ranks, "options")]
        assert msgs[0] is not None and msgs[0] == msgs[1], name
        assert "ranks registered different settings" in msgs[0]


def test_a_checkpoint_that_does_not_fit_loads_nothing(ranks: list) -> None:
    for r in part(ranks, "options"):
        h = r["half_loaded"]
        assert h is not None and "error-feedback checkpoint was saved for codec" in h["error"]
        assert h["decision"] is None and h["steps"] == 0 and set(h["running"].values()) == {"native"}


def test_native_reduce_scatter_counts_what_crosses_nodes(ranks: list) -> None:
    for r in part(ranks, "options"):
        n = r["native_nodes"]
        assert n["running"] == {"native"} and n["inter"] == n["sent"] > 0


def test_bad_auto_options_are_refused() -> None:
    lin = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="auto_level must be one of 'conservative', 'bold'"):
        lf.register(lin, codec="auto", auto_level="reckless")
    with pytest.raises(ValueError, match="go with codec='auto'"):
        lf.register(lin, codec="qsgd:bits=8", auto_level="bold")
    with pytest.raises(ValueError, match="go with codec='auto'"):
        lf.register(lin, codec="qsgd:bits=8", guard_every=10)
    with pytest.raises(ValueError, match="guard_every must be an int >= 0"):
        lf.register(lin, codec="auto", guard_every=-1)
    with pytest.raises(ValueError, match="leave error_feedback off"):
        lf.register(lin, codec="auto", error_feedback=True)
    with pytest.raises(ValueError, match="go with codec='auto'"):
        lf.register(lin, codec="qsgd:bits=8", allow=["bf16"])
    with pytest.raises(ValueError, match="go with codec='auto'"):
        lf.register(lin, codec="qsgd:bits=8", error_budget=None)
    with pytest.raises(ValueError, match="allow must be a list of codec specs, got the string 'bf16'"):
        lf.register(lin, codec="auto", allow="bf16")
    with pytest.raises(ValueError, match="allow must be a list of codec specs"):
        lf.register(lin, codec="auto", allow={"bf16"})
    with pytest.raises(ValueError, match="allow must name at least one codec"):
        lf.register(lin, codec="auto", allow=[])
    with pytest.raises(ValueError, match="allow: unknown codec 'nope'"):
        lf.register(lin, codec="auto", allow=["bf16", "nope"])
    with pytest.raises(ValueError, match="allow's codec dettmers.* keeps one scale per tensor"):
        lf.register(lin, codec="auto", allow=["dettmers"])
    with pytest.raises(ValueError, match="allow's codec must be a codec spec"):
        lf.register(lin, codec="auto", allow=[8])
    # with auto, a policy keeps parameters exact; a lossy codec in it would be ignored: refused
    for pol in ("bf16", lowbit.Policy(by_name={"weight": "qsgd:bits=4"}), lowbit.Policy(by_type={"Linear": "bf16"})):
        with pytest.raises(ValueError, match="with codec='auto' a policy only keeps parameters exact"):
            lf.register(lin, codec="auto", policy=pol)
    with pytest.raises(ValueError, match="fully_shard"):  # fp32 entries are what it is for
        lf.register(lin, codec="auto", policy=lowbit.Policy(by_name={"bias": "fp32"}, min_numel=5))
    for eb in (0, -1.0, True, "1", float("nan")):
        with pytest.raises(ValueError, match="error_budget must be a number > 0"):
            lf.register(lin, codec="auto", error_budget=eb)
    with pytest.raises(ValueError, match="fully_shard"):  # the options were fine: on to the model's checks
        lf.register(lin, codec="auto", auto_level="bold", guard_every=0)
    with pytest.raises(ValueError, match="fully_shard"):  # native and fp32 name FSDP's own reduce-scatter
        lf.register(lin, codec="auto", allow=["native", "fp32", "qsgd:bits=4"], error_budget=None)


def test_bold_weighs_4_bit_and_1bitsgd_up_to_the_sampling_noise(ranks: list) -> None:
    r0, r1 = part(ranks, "bold")
    for key in ("decision", "measured", "errors", "limits", "noise"):
        assert r0[key] == r1[key], key
    q4, one = (lowbit.get_codec(s).spec for s in ("qsgd:bits=4,bucket=512", "onebit:bucket=64"))
    for name in ("<root>", *BLOCKS):
        e = r0["errors"][name]
        assert e[one] > e[q4] > e[Q8] > e["bf16"] > 0  # measured on the module's own gradient
        assert r0["noise"][name] > 0  # each rank its own batches
        assert r0["limits"][name] == max(e[Q8], r0["noise"][name])
    # the noise allowance is for unbiased codecs: 1bitSGD* (biased) is held to 8-bit QSGD's error
    def limit(n: str, c: str) -> float:
        return r0["errors"][n][Q8] if lowbit.get_codec(c).biased else r0["limits"][n]

    assert all(r0["errors"][b][one] > limit(b, one) for b in BLOCKS), r0["table"]  # so not admitted here
    # the finalists: each codec wherever its error is within the module's limit, else the next one up
    admitted = [c for c in (q4, one) if all(r0["errors"][b][c] <= limit(b, c) for b in BLOCKS)]
    assert admitted == [q4], r0["table"]  # (this model's noise admits 4-bit QSGD)
    assert all(c in r0["finalists"] for c in admitted) and set(r0["finalists"]) == set(r0["measured"])
    assert one not in r0["finalists"]  # everywhere above its limit: the finalist would be 4-bit's again
    d = r0["decision"]
    assert all(r0["errors"][n][k] <= limit(n, k) for n, k in d.items() if k != "native"), r0["table"]
    # 1bitSGD* runs with error feedback (its residuals exist exactly for the modules that run it)
    assert r0["residuals"] == sorted(n for n, k in d.items() if k == one)


def test_bold_noise_counts_what_a_call_carried_not_frozen_parameters(ranks: list) -> None:
    """The noise is scaled, as the codecs' errors are, by the values the call carried: a block's frozen
    parameter (65,792 values its reduce-scatter leaves out) changes neither: scaled by the parameters'
    count, the noise came out about twice as high (66,304 + 65,792 against 66,304 values)."""
    for r in part(ranks, "frozen"):
        plain, frozen = r[False], r[True]
        for b in BLOCKS:
            assert frozen["numels"][b] == plain["numels"][b] + 256 * 256 + 256  # the parameters it holds ...
            # ... not what it sends; the same values, at other places in the row (FSDP lays the shards out
            # around the frozen parameter), so the samples differ a little (1 % measured)
            assert frozen["errors"][b] == pytest.approx(plain["errors"][b], rel=0.05)
            assert plain["noise"][b] > 0
            assert frozen["noise"][b] == pytest.approx(plain["noise"][b], rel=0.05), (frozen["noise"], plain["noise"])
