"""The in-order, non-blocking pipeline: lowbit's collectives keep the caller's program order (mixing with
torch's own and DDP's, ``find_unused_parameters`` included), and bytes are counted from what is sent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import lowbit
from lowbit.launch import spawn
from tests.distributed.shared_spawn import part, run_parts

HOOK_CODECS = ["fp32", "fp16", "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "onebit:bucket=64",
               "dettmers:type=dynamic", "topk:ratio=0.1"]


@pytest.fixture(scope="module")
def ranks() -> list:
    parts = (("unused", _body_unused_both, ()), ("bytes", _body_bytes, ()), ("coalesce", _body_coalesce, ()),
             ("half", _body_half_as_torch, ()), ("bucket_caps", _body_bucket_caps, ()),
             ("in_backward", _body_collective_in_backward, ()),
             ("hook_thread", _body_hook_thread, ()))  # last: it ends in a planted failure
    return spawn(run_parts, 2, parts, backend="gloo", timeout_s=120)


class _Branchy(nn.Module):
    """Two heads; ``unused=True`` leaves one out of the graph (DDP must find it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.head = nn.Linear(128, 10)
        self.spare = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor, unused: bool) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) if unused else self.head(h) + self.spare(h)


def _body_unused(rank: int, world: int, unused: bool) -> dict:
    out = {}
    for spec in HOOK_CODECS:
        torch.manual_seed(0)
        model = DDP(_Branchy(), find_unused_parameters=True, bucket_cap_mb=0.05)
        state = lowbit.ddp.register(model, codec=spec)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):  # (was 5: DDP has rebuilt its buckets after the first)
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
            loss = nn.functional.cross_entropy(model(x, unused), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            # a native collective of the user's between steps stays in step with lowbit's
            t = torch.ones(3) * (rank + 1)
            dist.all_reduce(t)
        out[spec] = ([p.detach().clone() for p in model.parameters()], state.stats.calls, float(t[0]))
    return out


def _body_unused_both(rank: int, world: int) -> dict:
    return {unused: _body_unused(rank, world, unused) for unused in (False, True)}


@pytest.mark.parametrize("unused", [False, True])
def test_find_unused_parameters_trains_for_every_codec(ranks: list, unused: bool) -> None:
    r0, r1 = (r[unused] for r in part(ranks, "unused"))
    for spec in HOOK_CODECS:
        params0, calls, tsum = r0[spec]
        assert calls > 0, spec
        assert tsum == 3.0
        for a, b in zip(params0, r1[spec][0]):
            assert torch.equal(a, b), spec


def _body_async_then_native(rank: int, world: int) -> dict:
    out = {}
    for algo in ("scatter_gather", "allgather"):
        x = torch.randn(4000, generator=torch.Generator().manual_seed(rank))  # (below NUMBA_MIN_NUMEL: no numba import)
        ref = x.clone()
        lowbit.all_reduce(ref, "qsgd:bits=8", algorithm=algo, seed=4)
        x2 = torch.randn(4000, generator=torch.Generator().manual_seed(rank))
        h = lowbit.all_reduce(x2, "qsgd:bits=8", algorithm=algo, seed=4, async_op=True)
        y = torch.full((7,), float(rank + 1))
        dist.all_reduce(y)                                   # a native collective while lowbit's is in flight
        z = torch.full((9,), float(rank))
        lowbit.all_reduce(z, "fp32", algorithm="allreduce")  # and a synchronous lowbit one
        h.wait()
        out[algo] = (torch.equal(x2, ref), float(y[0]), float(z[0]))
    return out


def test_async_allreduce_then_native_collective_then_wait() -> None:
    for res in spawn(_body_async_then_native, 3, backend="gloo", timeout_s=60):
        for algo, (same, y, z) in res.items():
            assert same, algo
            assert y == 6.0 and z == 3.0  # 0 + 1 + 2: lowbit.all_reduce sums by default, as torch's


def _spy_bytes(monkeypatch_targets: list) -> list[int]:
    """Wrap the real torch.distributed ops lowbit calls and record the bytes each call sends."""
    import lowbit.comm.collectives as C

    sent: list[int] = []
    real_a2a, real_ag, real_ar = dist.all_to_all_single, C._gather_fn, dist.all_reduce
    rank, k = dist.get_rank(), dist.get_world_size()

    def a2a(out, inp, out_splits=None, in_splits=None, **kw):
        sent.append(sum(s for i, s in enumerate(in_splits) if i != rank) * inp.element_size())
        return real_a2a(out, inp, out_splits, in_splits, **kw)

    def ag(out, inp, **kw):
        if inp.dtype != torch.int64:  # (int64: all_reduce's per-call check, an 8-byte fingerprint, not a payload)
            sent.append((k - 1) * inp.numel() * inp.element_size())  # ring: my block goes to k-1 peers
        return real_ag(out, inp, **kw)

    def ar(t, *a, **kw):
        sent.append(2 * (k - 1) * t.numel() * t.element_size() // k)
        return real_ar(t, *a, **kw)

    C.dist.all_to_all_single = a2a  # type: ignore[assignment]
    C._gather_fn = ag
    C.dist.all_reduce = ar  # type: ignore[assignment]
    monkeypatch_targets.append((real_a2a, real_ag, real_ar))
    return sent


def _body_bytes(rank: int, world: int) -> dict:
    import lowbit.comm.collectives as C

    restore: list = []
    sent = _spy_bytes(restore)
    out = {}
    try:
        for spec, algo in [("qsgd:bits=8,bucket=512", "allgather"), ("qsgd:bits=4,bucket=512", "scatter_gather"),
                           ("onebit:bucket=64", "scatter_gather"), ("fp16", "allreduce")]:
            sent.clear()
            stats = lowbit.comm.CommStats()
            lowbit.all_reduce(torch.randn(10_000), spec, algorithm=algo, stats=stats)
            out[(spec, algo)] = (stats.bytes_sent, sum(sent))
        # the DDP hook: one collective per bucket, fp32 tensors riding in the message
        sent.clear()
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10)))
        state = lowbit.ddp.register(model, codec="qsgd:bits=8,bucket=512", start_iter=0)
        model(torch.randn(4, 100)).sum().backward()
        out["ddp"] = (state.stats.bytes_sent, sum(sent), state.stats.calls)
    finally:
        C.dist.all_to_all_single, C._gather_fn, C.dist.all_reduce = restore[0]  # type: ignore[assignment]
    return out


def test_bytes_sent_count_what_crosses_the_wire(ranks: list) -> None:
    res = part(ranks, "bytes")
    r0 = res[0]
    for key, (counted, spied) in ((k, v[:2]) for k, v in r0.items()):
        assert counted == spied, (key, counted, spied)
    # worked out by hand, independently of the code: 10,000 values, 2 ranks
    # (messages come in 16-byte slots whose code streams start 16-byte aligned: lead + payload + tail)
    assert r0[("qsgd:bits=8,bucket=512", "allgather")][0] == 4 * 20 + 10_000            # 20 scales + 1 B/value
    # 5,000 values a chunk: 10 scales (40 B, so 8 lead bytes) + 2,500 B of codes = 2,548 -> 2,560
    assert r0[("qsgd:bits=4,bucket=512", "scatter_gather")][0] == 2 * 2_560
    # 79 (mean+, mean-) pairs = 632 B (8 lead bytes) + 625 B of signs = 1,265 -> 1,280
    assert r0[("onebit:bucket=64", "scatter_gather")][0] == 2 * 1_280
    assert r0[("fp16", "allreduce")][0] == 20_000                                       # ring: 2(K-1)/K x 2 B
    # DDP: weights 10,000 + 1,000 values in qsgd 8-bit (in one payload: 22 scales = 88 B, 8 lead bytes,
    # 11,096 -> 11,104), then the 110 biases raw in fp32 (440 B -> 448)
    counted, spied, calls = r0["ddp"]
    assert calls == 1
    assert counted == 11_104 + 448


def _body_coalesce(rank: int, world: int) -> dict:
    out = {}
    for mb in (0, 64):
        for spec in ("qsgd:bits=8,bucket=512", "onebit:bucket=64"):
            torch.manual_seed(0)
            net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
            model = DDP(net, bucket_cap_mb=0.1)
            state = lowbit.ddp.register(model, codec=spec, message_mb=mb, start_iter=0)
            g = torch.Generator().manual_seed(rank)
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            nn.functional.cross_entropy(model(x), y).backward()  # DDP's first buckets: one here
            model.zero_grad()
            calls = state.stats.calls
            nn.functional.cross_entropy(model(x), y).backward()  # rebuilt buckets: several
            calls = state.stats.calls - calls
            got = [p.grad.clone() for p in model.parameters()]
            # the exact mean of the same gradients, from plain DDP
            torch.manual_seed(0)
            ref = DDP(nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10)))
            nn.functional.cross_entropy(ref(x), y).backward()
            want = [p.grad.clone() for p in ref.parameters()]
            out[(mb, spec)] = (got, want, calls)
    return out


def test_message_groups_match_per_tensor_messages(ranks: list) -> None:
    r0, r1 = part(ranks, "coalesce")
    for key, (got, want, calls) in r0.items():
        mb, spec = key
        for a, b in zip(got, r1[key][0]):
            assert torch.equal(a, b), key                       # ranks agree bit for bit
        err = sum(float((a - b).norm()) for a, b in zip(got, want)) / sum(float(b.norm()) for b in want)
        assert err < (0.05 if spec.startswith("qsgd") else 1.0), (key, err)
        assert (calls == 1) == (mb == 64), (key, calls)         # 64 MiB: one message for the step


THREAD_CODECS = ["bf16", "qsgd:bits=8,bucket=512", "onebit:bucket=64"]


def _body_hook_thread(rank: int, world: int) -> dict:
    """Every codec trained twice, its host work on the autograd thread and on the hook thread; small
    buckets and messages (several per step, groups spanning buckets), unused parameters found by DDP,
    and the user's own collective between steps."""
    out = {}
    for spec in THREAD_CODECS:
        for thread in (False, True):
            torch.manual_seed(0)
            model = DDP(_Branchy(), find_unused_parameters=True, bucket_cap_mb=0.02)
            state = lowbit.ddp.register(model, codec=spec, hook_thread=thread, message_mb=0.03)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(rank)
            for step in range(6):
                x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
                loss = nn.functional.cross_entropy(model(x, step % 2 == 0), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                t = torch.ones(2) * (rank + 1)
                dist.all_reduce(t)
            out[(spec, thread)] = ([p.detach().clone() for p in model.parameters()], state.stats.calls,
                                   state.stats.bytes_sent, float(t[0]))
    # a failure inside the hook thread's job reaches the training loop as DDP's error, on every rank
    torch.manual_seed(0)
    model = DDP(_Branchy(), bucket_cap_mb=0.02)
    state = lowbit.ddp.register(model, codec="qsgd:bits=8,bucket=512", hook_thread=True, start_iter=0)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    nn.functional.cross_entropy(model(x, False), y).backward()  # builds the message groups

    class _Planted:
        def __getattr__(self, name):
            raise RuntimeError(f"planted failure in {name}")

    for g in state._group_of.values():
        g.codec = _Planted()
    try:
        nn.functional.cross_entropy(model(x, False), y).backward()
        out["error"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["error"] = str(exc)
    return out


def test_hook_thread_is_bit_identical_and_passes_errors_on(ranks: list) -> None:
    r0, r1 = part(ranks, "hook_thread")
    for spec in THREAD_CODECS:
        inline, threaded = r0[(spec, False)], r0[(spec, True)]
        assert inline[1] > 6 and inline[1:] == threaded[1:], spec  # same calls, bytes, user's collective
        for a, b in zip(inline[0], threaded[0]):
            assert torch.equal(a, b), spec
        for a, b in zip(threaded[0], r1[(spec, True)][0]):
            assert torch.equal(a, b), spec
    for r in (r0, r1):
        assert "planted failure" in r["error"], r["error"]


def _body_half_as_torch(rank: int, world: int) -> dict:
    """lowbit's fp16 plan (big tensors fp16, staged in fp16 out of a bucket that mixes them with fp32
    biases; bf16 takes the same path) reduces the big tensors exactly as torch's fp16_compress_hook does
    (cast, divide, sum, cast back), and the small ones exactly in fp32. (torch's bf16 hook refuses gloo.)"""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out: dict = {}
    for which in ("torch", "lowbit", "plain"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        model = DDP(net, bucket_cap_mb=0.2)
        if which == "torch":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif which == "lowbit":
            out["plan"] = {n: c.spec for n, c in lowbit.ddp.register(model, codec="fp16", start_iter=0).plan.items()}
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        nn.functional.cross_entropy(model(x), y).backward()
        out[which] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    return out


def test_half_plan_reduces_big_tensors_as_torch_and_small_ones_in_fp32(ranks: list) -> None:
    r0, _ = part(ranks, "half")
    plan = r0["plan"]
    assert sorted(set(plan.values())) == ["fp16", "fp32"]
    for name, g in r0["lowbit"].items():
        if plan[name] == "fp16":
            assert torch.equal(g, r0["torch"][name]), name
        else:
            assert torch.allclose(g, r0["plain"][name], rtol=1e-6, atol=1e-8), name
    assert any(not torch.equal(r0["lowbit"][n], r0["torch"][n]) for n in plan if plan[n] == "fp32")


_LAG: list = []  # non-empty: the lags below are on (the threaded run; the inline run issues in autograd's order)


class _SyncInBackward(torch.autograd.Function):
    """Identity whose backward all-reduces on the default group, on the autograd thread, while lowbit's
    hook thread still has buckets queued (what SyncBatchNorm and torch.distributed.nn do)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        import time

        if dist.get_rank() == 0 and _LAG:
            time.sleep(0.3)  # rank 0's hook thread issues its queued buckets first ...
        g = g.clone()
        dist.all_reduce(g)
        return g / dist.get_world_size()


class _SyncNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(_SyncInBackward.apply(torch.relu(self.a(x))))))


def _body_collective_in_backward(rank: int, world: int) -> list:
    import time

    issue = lowbit.ddp.hooking._issue

    def slow(*a, **k):  # noqa: ANN002, ANN003, ANN202
        time.sleep(0.3)
        return issue(*a, **k)

    out = []
    for thread in (False, True):
        # ... and rank 1's hook thread lags (host jitter): on one shared group the two ranks' orders differ
        # (the inline run, the reference, issues in autograd's order whatever the lags: run without them)
        lowbit.ddp.hooking._issue = slow if rank == 1 and thread else issue
        _LAG[:] = [True] if thread else []
        torch.manual_seed(0)
        model = DDP(_SyncNet(), bucket_cap_mb=0.01)
        lowbit.ddp.register(model, codec="qsgd:bits=8,bucket=512", hook_thread=thread, message_mb=0, start_iter=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    lowbit.ddp.hooking._issue = issue
    _LAG.clear()
    return out


def test_collectives_in_the_backward_pass_do_not_interleave_with_the_hook_thread(ranks: list) -> None:
    """The hook thread sends on its own process group (same ranks), so a collective of the backward
    pass on the user's group cannot meet lowbit's in a different order on different ranks (on one
    shared group this hung: found in review)."""
    r0, r1 = part(ranks, "in_backward")
    for inline, threaded, other in zip(r0[0], r0[1], r1[1]):
        assert torch.equal(inline, threaded) and torch.equal(threaded, other)


def _body_bucket_caps(rank: int, world: int) -> dict:
    from lowbit import choose

    out = {}
    for kw in ({}, {"bucket_cap_mb": 25}, {"bucket_cap_mb": 4}):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(12)]), **kw)
        seen: dict = {}

        def record(state, bucket):  # noqa: ANN001, ANN202
            seen[bucket.index()] = bucket.buffer().numel()
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, record)
        for _ in range(2):  # DDP rebuilds its buckets after the first (was 3 steps)
            model(torch.randn(4, 512)).sum().backward()
        numels = [p.numel() for p in reversed(list(model.module.parameters()))]
        first, cap = choose.ddp_bucket_caps(model)
        cut = choose.ddp_buckets(numels, cap, first_bytes=first)
        out[str(kw)] = ([seen[i] for i in sorted(seen)],
                        [sum(n for n, b in zip(numels, cut) if b == i) for i in range(max(cut) + 1)])
    return out


def test_ddp_bucket_cut_matches_the_buckets_ddp_rebuilds(ranks: list) -> None:
    """lowbit cuts the model as DDP's reducer does after its rebuild: 1 MiB first only with the default
    cap (an explicit bucket_cap_mb makes the first bucket that size too: found in review)."""
    res = part(ranks, "bucket_caps")[0]  # (on 2 ranks: DDP cuts its buckets as on 1)
    for kw, (real, predicted) in res.items():
        assert real == predicted, kw
