"""lowbit.fsdp on FSDP2 over gloo (CPU): the custom reduce-scatter and all-gather against plain FSDP2.

Process starts are the cost here, so each spawn checks several things (issue 28's list): one 2-rank
run and one 4-rank run (2 nodes x 2, and HSDP).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbit
from lowbit.launch import spawn

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp_api.FSDPModule, "set_custom_reduce_scatter"):  # pragma: no cover
    pytest.skip("this torch's FSDP2 has no custom reduce-scatter", allow_module_level=True)

from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

import lowbit.fsdp as lf  # noqa: E402
import lowbit.comm.exchange  # noqa: E402


class Net(nn.Module):
    """Two blocks (each its own fully_shard) and a root holding an odd-sized head: shapes that do not
    split evenly over 2 or 4 ranks (padding), 1-D tensors the policy keeps exact, matrices it compresses."""

    def __init__(self, checkpoint: bool = False) -> None:
        super().__init__()
        self.checkpoint = checkpoint  # block 0 under activation checkpointing (non-reentrant)
        torch.manual_seed(0)
        self.inp = nn.Linear(24, 130)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(130), nn.Linear(130, 130), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(130, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            if self.checkpoint and i == 0:
                x = x + torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = x + b(x)
        return self.head(x)


def _shard(model: Net, mesh=None, **kw) -> Net:
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _train(model: nn.Module, rank: int, steps: int, lr: float = 0.05, start: int = 0, opt=None) -> list[float]:
    opt = opt or torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randn(16, 24, generator=g)
        y = x[:, :7].sum(dim=1, keepdim=True).expand(-1, 7) * 0.3
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


class _AsyncSpy:
    """Records the ``async_op`` of every collective lowbit.fsdp issues (the real ones run): FSDP's hooks
    must run theirs synchronously, which on NCCL puts them on FSDP's own all-gather and reduce-scatter
    streams; issued async, both would queue on the process group's one internal stream."""

    def __enter__(self) -> list[tuple[str, bool]]:
        from lowbit.comm import collectives as C
        self.saved = (C._scatter_fn, C._gather_fn, dist.all_to_all_single)
        self.calls: list[tuple[str, bool]] = []

        def spy(name: str, fn):
            def call(*a, **kw):
                self.calls.append((name, bool(kw.get("async_op", False))))
                return fn(*a, **kw)
            return call
        C._scatter_fn = spy("reduce_scatter", self.saved[0])
        C._gather_fn = spy("all_gather", self.saved[1])
        dist.all_to_all_single = spy("all_to_all", self.saved[2])
        return self.calls

    def __exit__(self, *exc: object) -> None:
        from lowbit.comm import collectives as C
        C._scatter_fn, C._gather_fn, dist.all_to_all_single = self.saved


def _body_two(rank: int, world: int) -> dict:
    out: dict = {}
    # 1. codec="fp32" is plain FSDP2 (the same sum, in rank order)
    plain = _shard(Net())
    _train(plain, rank, 4)
    ref = _full(plain)
    m = _shard(Net())
    lf.register(m, codec="fp32")
    _train(m, rank, 4)
    out["fp32_diff"] = _max_diff(ref, _full(m))

    # 2. 8-bit gradients train and stay within the codec's error of plain FSDP2
    m = _shard(Net())
    st = lf.register(m, codec="qsgd:bits=8,bucket=512")
    losses = _train(m, rank, 12)
    out["q8_losses"] = losses
    out["q8_diff"] = _max_diff(_train_ref(rank, 12), _full(m))
    out["q8_bytes"] = st.grad_stats.bytes_sent

    # 3. parameters in 8 bits: identical unsharded weights on every rank, full-precision master shards,
    # forward outputs within the codec's error
    m = _shard(Net())
    before = [p.to_local().detach().clone() for p in m.parameters()]
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        y_plain = m(x)
    lf.register(m, codec="fp32", param_codec="qsgd:bits=8,bucket=512,rounding=nearest")
    seen: list[torch.Tensor] = []
    hook = m.blocks[0][1].register_forward_pre_hook(lambda mod, a: seen.append(mod.weight.detach().clone()))
    with torch.no_grad():
        y_q = m(x)
    hook.remove()
    m.reshard()
    out["unsharded_w"] = seen[0]
    out["master_same"] = all(torch.equal(a, p.to_local()) and p.dtype == torch.float32 for a, p in zip(before, m.parameters()))
    out["fwd_err"] = float((y_q - y_plain).abs().max() / y_plain.abs().max())

    # 4. mixed precision (bf16 parameters, fp32 and bf16 reduce), reshard_after_forward=False, gradient
    # accumulation and activation checkpointing
    for reduce_dtype in (torch.float32, torch.bfloat16):
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        m = _shard(Net(), mp_policy=mp, reshard_after_forward=False)
        lf.register(m, codec="qsgd:bits=8", param_codec="qsgd:bits=8,rounding=nearest")
        out[f"mp_{reduce_dtype}"] = _train(m, rank, 10)
    m = _shard(Net(checkpoint=True))
    st = lf.register(m, codec="qsgd:bits=4,bucket=128", error_feedback=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    calls = []
    for i in range(3):
        last = i == 2
        m.set_requires_gradient_sync(last)
        g = torch.Generator().manual_seed(i + 10 * rank)
        m(torch.randn(8, 24, generator=g)).pow(2).mean().backward()
        calls.append(st.grad_stats.calls)
    opt.step()
    out["accum_calls"] = calls
    out["accum_finite"] = all(bool(torch.isfinite(p.grad.to_local()).all()) for p in m.parameters())

    # 5. error feedback: a checkpoint resumes bit-identically
    m = _shard(Net())
    st = lf.register(m, codec="onebit:bucket=64", error_feedback=True)
    opt = torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9)
    _train(m, rank, 3, opt=opt)
    buf = io.BytesIO()
    torch.save({"model": {k: v.to_local().clone() for k, v in m.state_dict().items()}, "opt": opt.state_dict(),
                "lowbit": st.state_dict()}, buf)
    _train(m, rank, 3, start=3, opt=opt)
    out["ef_a"] = [p.to_local().clone() for p in m.parameters()]
    out["ef_residual_norm"] = st.feedback.residual_norm()
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    m2 = _shard(Net())
    st2 = lf.register(m2, codec="onebit:bucket=64", error_feedback=True)
    with torch.no_grad():
        for (k, v) in m2.state_dict().items():
            v.to_local().copy_(ck["model"][k])
    opt2 = torch.optim.SGD(m2.parameters(), lr=0.02, momentum=0.9)
    opt2.load_state_dict(ck["opt"])
    st2.load_state_dict(ck["lowbit"])
    _train(m2, rank, 3, start=3, opt=opt2)
    out["ef_b"] = [p.to_local().clone() for p in m2.parameters()]
    bad = dict(ck["lowbit"])
    del bad["rank"]
    try:
        st2.load_state_dict(bad)
        out["bad_ckpt"] = None
    except ValueError as e:
        out["bad_ckpt"] = str(e)

    # 6. FSDP's parameter order, which the policy's column layout relies on
    from torch.distributed.fsdp import FSDPModule
    for mod in [m2, *m2.blocks]:
        group = mod._get_fsdp_state()._fsdp_param_group
        theirs = [id(fp.sharded_param) for fp in group.fsdp_params]
        ours = [id(p) for _, p in lf._managed_params(mod, FSDPModule)]
        out.setdefault("order_same", []).append(theirs == ours)

    # 8. float codecs take the cast path (straight into and out of the message): the same weights, bit
    # for bit, as the codec's encode / frame / decode path, with the policy's exact columns, with bf16
    # parameters and fp32 reduce, and through a 16-bit parameter all-gather
    spy = _AsyncSpy()
    for codec, pcodec, mp in (("bf16", "bf16", None), ("fp16", None, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                              ("fp32", "fp16", None)):
        runs = []
        for fast in (True, False):
            lowbit.comm.exchange.FAST_FLOATS = fast
            m = _shard(Net(), **({"mp_policy": mp} if mp else {}))
            lf.register(m, codec=codec, param_codec=pcodec)
            with spy as calls:
                _train(m, rank, 3)
            out.setdefault("sync_calls", []).extend(calls)
            runs.append(_full(m))
        lowbit.comm.exchange.FAST_FLOATS = True
        out.setdefault("cast_same", []).append(all(torch.equal(a, b) for a, b in zip(*runs)))

    # 8b. a bf16 reduce buffer whose rows are already the message (bf16 codec, 8 | S): sent as it is,
    # summed in fp32 like the codec path, for SUM and AVG
    groups = lf._make_groups(dist.group.WORLD, None)
    g = torch.randn(world * 64, generator=torch.Generator().manual_seed(3 + rank)).to(torch.bfloat16)
    outs = []
    for fast in (True, False):
        lowbit.comm.exchange.FAST_FLOATS = fast
        codec = lf.get_codec("bf16")
        st = lf.FSDPState(codec, None, False, None, None, None, rank, world, torch.device("cpu"))
        rs = lf.LowbitReduceScatter(st, "blk", 0, [64], [False], codec, groups)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            o = torch.empty(64, dtype=torch.bfloat16)
            rs(o, g, dist.group.WORLD, op)
            outs.append(o)
    lowbit.comm.exchange.FAST_FLOATS = True
    rows = [torch.randn(world * 64, generator=torch.Generator().manual_seed(3 + j)).to(torch.bfloat16)
            .view(world, 64)[rank].float() for j in range(world)]
    want = sum(rows[j] for j in range(world) if j != rank) + rows[rank]  # the others in order, then mine
    out["r16_same"] = all(torch.equal(a, b) for a, b in zip(outs[:2], outs[2:]))
    out["r16_sum"] = torch.equal(outs[0], want.to(torch.bfloat16))
    # FSDP's own reduce-scatter (codec="auto"'s native choice) runs synchronously too
    st = lf.FSDPState(None, None, False, None, None, None, rank, world, torch.device("cpu"))
    native = lf.LowbitReduceScatter(st, "blk", 0, [64], [False], None, groups)
    o = torch.empty(64, dtype=torch.bfloat16)
    with spy as calls:
        native(o, g, dist.group.WORLD, dist.ReduceOp.SUM)
    out["sync_calls"].extend(calls)
    out["native_sum"] = torch.equal(o, want.to(torch.bfloat16))  # two ranks: one rounding either way

    # 7. ranks that disagree: the same error on every rank, no hang
    m = _shard(Net())
    try:
        lf.register(m, codec="qsgd:bits=8" if rank == 0 else "qsgd:bits=4")
        out["mismatch"] = None
    except lowbit.ddp.ConfigMismatchError as e:
        out["mismatch"] = str(e)
    return out


def _train_ref(rank: int, steps: int) -> list[torch.Tensor]:
    plain = _shard(Net())
    _train(plain, rank, steps)
    return _full(plain)


def test_fsdp_two_ranks() -> None:
    """Also the fast equivalent of test_fsdp_with_torch_compile (slow): part 1, codec fp32 against plain FSDP2,
    without torch.compile."""
    r0, r1 = spawn(_body_two, 2, backend="gloo", timeout_s=240)
    for r in (r0, r1):
        assert r["fp32_diff"] == 0.0  # the same float32 sums as FSDP's reduce-scatter
        assert r["q8_losses"][-1] < 0.5 * r["q8_losses"][0]
        assert 0 < r["q8_diff"] < 2e-3  # 12 steps of 8-bit gradients: close to plain, not identical
        assert r["master_same"]
        assert 0 < r["fwd_err"] < 0.02
        for key in ("mp_torch.float32", "mp_torch.bfloat16"):
            assert r[key][-1] < r[key][0] and all(map(lambda v: v == v, r[key]))
        assert r["accum_calls"][0] == r["accum_calls"][1] == 0 and r["accum_calls"][2] > 0  # one sync, at the end
        assert r["accum_finite"]
        assert r["ef_residual_norm"] > 0
        assert all(torch.equal(a, b) for a, b in zip(r["ef_a"], r["ef_b"]))
        assert r["bad_ckpt"] and "rank" in r["bad_ckpt"]
        assert all(r["order_same"])
        assert r["cast_same"] == [True, True, True]
        assert r["native_sum"]
        kinds = {name for name, _ in r["sync_calls"]}
        assert kinds == {"all_to_all", "all_gather", "reduce_scatter"}, kinds
        assert not any(asyn for _, asyn in r["sync_calls"]), r["sync_calls"]
        assert r["r16_same"] and r["r16_sum"]
        assert r["mismatch"] and "rank 0" in r["mismatch"] and "rank 1" in r["mismatch"]
    assert torch.equal(r0["unsharded_w"], r1["unsharded_w"])  # every rank decodes the same codes
    assert r0["q8_bytes"] == r1["q8_bytes"] > 0


def _body_four(rank: int, world: int) -> dict:
    out: dict = {}
    plain = _shard(Net())
    out["plain_losses"] = _train(plain, rank, 4)  # (4 steps: was a reference of 4 and another plain run of 8)
    ref = _full(plain)
    # 2 nodes x 2: native inside a node, compressed between
    m = _shard(Net())
    st = lf.register(m, codec="fp32", node_size=2)
    _train(m, rank, 4)
    out["nodes_fp32_diff"] = _max_diff(ref, _full(m))
    m = _shard(Net())
    st = lf.register(m, codec="qsgd:bits=8", param_codec="qsgd:bits=8,rounding=nearest", node_size=2)
    with _AsyncSpy() as calls:  # inside a node too, FSDP's collectives run synchronously
        out["nodes_q8_losses"] = _train(m, rank, 4)  # measured within 0.2% of plain's last loss (was 8 steps)
    out["nodes_sync_calls"] = calls
    out["nodes_stats"] = (st.stats.bytes_sent, st.stats.bytes_inter)
    seen: list[torch.Tensor] = []
    h = m.blocks[1][1].register_forward_pre_hook(lambda mod, a: seen.append(mod.weight.detach().clone()))
    with torch.no_grad():
        m(torch.randn(2, 24))
    h.remove()
    out["nodes_w"] = seen[0]
    # HSDP: shard inside pairs, replicate across them, the replicas' all-reduce in lowbit's codec
    mesh = dist.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    m = _shard(Net(), mesh=mesh["shard"])
    st = lf.register(m, codec="fp32", replicate_group=mesh["rep"].get_group())
    _train(m, rank, 4)
    out["hsdp_diff"] = _max_diff(ref, _full(m))
    m = _shard(Net(), mesh=mesh["shard"])
    st = lf.register(m, codec="qsgd:bits=8", replicate_group=mesh["rep"].get_group())
    out["hsdp_q8_losses"] = _train(m, rank, 4)  # measured within 0.01% (was 8 steps)
    out["hsdp_full"] = _full(m)
    # inside a shard group (a node) FSDP's own reduce-scatter runs: every byte lowbit sends crosses nodes
    out["hsdp_bytes"] = (st.grad_stats.bytes_sent, st.grad_stats.bytes_inter, st.iter)
    return out


def test_fsdp_four_ranks_nodes_and_hsdp() -> None:
    rs = spawn(_body_four, 4, backend="gloo", timeout_s=240)
    for r in rs:
        assert r["nodes_fp32_diff"] < 1e-6  # another order of float32 sums than FSDP's
        plain = r["plain_losses"][-1]
        assert abs(r["nodes_q8_losses"][-1] - plain) < 0.02 * plain  # trains as plain FSDP2 does
        sent, inter = r["nodes_stats"]
        assert 0 < inter < sent
        assert {name for name, _ in r["nodes_sync_calls"]} == {"all_to_all", "all_gather", "reduce_scatter"}
        assert not any(asyn for _, asyn in r["nodes_sync_calls"])
        assert r["hsdp_diff"] < 1e-6
        assert abs(r["hsdp_q8_losses"][-1] - plain) < 0.02 * plain
        sent, inter, calls = r["hsdp_bytes"]
        assert 0 < sent == inter and calls > 0, r["hsdp_bytes"]
    assert all(torch.equal(rs[0]["nodes_w"], r["nodes_w"]) for r in rs)
    # replicas hold bit-identical parameters
    assert all(torch.equal(a, b) for a, b in zip(rs[0]["hsdp_full"], rs[2]["hsdp_full"]))


def test_register_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="fully_shard"):
        lf.register(nn.Linear(4, 4), codec="qsgd:bits=8")
    with pytest.raises(ValueError, match="unknown codec"):
        lf.register(nn.Linear(4, 4), codec="qsgd8")
    with pytest.raises(ValueError, match="bucketed codec"):
        lf.register(nn.Linear(4, 4), codec="onebit:bucket=0")
    with pytest.raises(ValueError, match="no error feedback"):
        lf.register(nn.Linear(4, 4), codec="bf16", error_feedback=True)


def test_row_layout_merges_neighbours_and_falls_back() -> None:
    q8, fp32 = lowbit.get_codec("qsgd:bits=8"), lowbit.get_codec("fp32")
    lay, ok = lf._row_layout([10, 3, 20, 5, 4], [False, True, False, True, True], 42, q8, fp32)
    assert ok and lay.codec == q8 and lay.numel == 42
    assert lay.exact == ((10, 3), (33, 9)) and lay.exact_numel == 12
    assert lay.index(torch.device("cpu")).tolist() == [10, 11, 12] + list(range(33, 42))
    assert lay.message == lf._slot(q8, 42)[1] + lf._slot(fp32, 12)[1]
    lay, ok = lf._row_layout([10, 3], [False, True], 12, q8, fp32)  # FSDP left a parameter out
    assert not ok and lay.codec == q8 and lay.exact == ()
    lay, ok = lf._row_layout([10, 3], [True, True], 13, q8, fp32)  # all exact: the exact codec carries the row
    assert ok and lay.codec == fp32 and lay.exact == ()
    lay, ok = lf._row_layout([10, 3], [False, True], 13, fp32, fp32)  # an exact codec needs no patch
    assert ok and lay.exact == ()


def _body_compile(rank: int, world: int) -> dict:
    out = {}
    for mode in ("plain", "lowbit"):
        m = Net()
        for b in m.blocks:
            b.compile()  # torch.compile per block, as torchtitan does
        _shard(m)
        if mode == "lowbit":
            lf.register(m, codec="fp32", param_codec="fp32")
        out[mode] = _train(m, rank, 3)
    return out


@pytest.mark.slow
def test_fsdp_with_torch_compile() -> None:
    """Compiled blocks (fast equivalent without torch.compile: test_fsdp_two_ranks, part 1, codec fp32 is plain
    FSDP2)."""
    for r in spawn(_body_compile, 2, backend="gloo", timeout_s=600):
        assert r["lowbit"] == r["plain"]  # fp32 on the wire: the same losses as plain FSDP2, compiled blocks


def test_reduce_ops_fsdp_may_pass() -> None:
    assert lf._op_scale(dist.ReduceOp.SUM, 4) == 1.0
    assert lf._op_scale(dist.ReduceOp.AVG, 4) == 0.25
    assert lf._op_scale(dist.ReduceOp.PREMUL_SUM(1 / 6), 4) == pytest.approx(1 / 6)  # set_gradient_divide_factor(6)
    with pytest.raises(ValueError, match="unsupported reduce op"):
        lf._op_scale(dist.ReduceOp.MAX, 4)
