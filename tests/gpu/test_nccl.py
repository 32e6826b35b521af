"""Compressed collectives and the DDP hook over NCCL on 2 GPUs (run on the device: ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

import lowbit
from lowbit.launch import spawn

pytestmark = pytest.mark.gpu

needs_2_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                  reason="needs 2 CUDA GPUs")

CODECS = ["fp32", "fp16", "qsgd:bits=8,bucket=512", "qsgd:bits=4,bucket=512", "qsgd:bits=2,bucket=128",
          "onebit:bucket=64", "dettmers:type=dynamic"]


def _body(rank: int, world: int) -> dict:
    dev = torch.device("cuda", rank)
    out = {}
    for spec in CODECS:
        for algo in ("scatter_gather", "allgather", "allreduce"):
            if algo == "allreduce" and spec not in ("fp32", "fp16"):
                continue
            for n in (1, 4097, 1 << 22):
                g = torch.Generator(device=dev).manual_seed(rank * 7 + n)
                t = torch.randn(n, device=dev, generator=g)
                exact = t.double().clone()
                torch.distributed.all_reduce(exact)
                exact /= world
                lowbit.all_reduce(t, spec, algorithm=algo, op="mean", seed=1)
                err = float((t.double() - exact).norm() / exact.norm())
                out[(spec, algo, n)] = (t.cpu(), err)
    return out


@needs_2_gpus
def test_nccl_collectives_identical_across_ranks_and_accurate() -> None:
    r0, r1 = spawn(_body, 2, backend="nccl")
    bounds = {"fp32": 1e-6, "fp16": 2e-3, "qsgd:bits=8,bucket=512": 0.05, "dettmers:type=dynamic": 0.05}
    for key, (t, err) in r0.items():
        assert torch.equal(t, r1[key][0]), key
        b = bounds.get(key[0])
        if b is not None and key[2] > 1:
            assert err < b, (key, err)


#: (codec, DDP bucket_cap_mb, lowbit message_mb): one bucket and one message; several buckets whose
#: gradients meet in message groups that span buckets; error feedback; fp32 through the hook.
#: The last: scatter_gather, whose side stream once let the caller's stream reuse the all-to-all's send
#: buffer too early (NaN losses on 4 GPUs).
DDP_CASES = [("qsgd:bits=4,bucket=512", 25.0, 64.0, "auto"), ("qsgd:bits=8,bucket=512", 0.1, 0.3, "auto"),
             ("onebit:bucket=64", 0.1, 0.3, "auto"), ("fp32", 0.1, 64.0, "auto"),
             ("qsgd:bits=4,bucket=512", 0.1, 0.3, "scatter_gather")]


def train_mlp(rank: int, spec: str, cap: float, mb: float, algorithm: str, steps: int,
              hook_thread="auto") -> tuple[list, object, list]:
    """A 256-512-256-10 MLP under DDP with lowbit's hook on this rank's GPU, ``steps`` SGD steps: (each step's
    reduced gradients, on the CPU; the hook's state; the final parameters). Gradients must stay finite."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)).to(dev)
    model = DDP(net, device_ids=[rank], bucket_cap_mb=cap)
    state = lowbit.ddp.register(model, codec=spec, message_mb=mb, algorithm=algorithm, hook_thread=hook_thread)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device=dev).manual_seed(rank)
    grads = []
    for _ in range(steps):
        x = torch.randn(64, 256, device=dev, generator=g)
        y = torch.randint(0, 10, (64,), device=dev, generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        # Replicas must agree on every step's reduced gradients (a stream race shows up here first).
        grads.append([p.grad.detach().cpu() for p in model.parameters()])
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()), (spec, algorithm)
        opt.step()
    return grads, state, [p.detach().cpu() for p in model.parameters()]


def _ddp_body(rank: int, world: int) -> list:
    out = []
    for spec, cap, mb, algorithm in DDP_CASES:
        grads, state, params = train_mlp(rank, spec, cap, mb, algorithm, steps=10)
        out += [(spec, g) for g in grads]
        out.append((spec, state.stats.bytes_sent, params))  # type: ignore[attr-defined]
    return out


@needs_2_gpus
def test_ddp_hook_on_nccl_keeps_ranks_identical() -> None:
    r0, r1 = spawn(_ddp_body, 2, backend="nccl")
    assert len(r0) == len(r1) == 11 * len(DDP_CASES)
    for a, b in zip(r0, r1):
        assert a[0] == b[0]
        if len(a) == 3:  # the end of a case: bytes sent and the parameters
            assert a[1] > 0, a[0]
            a, b = (a[0], a[2]), (b[0], b[2])
        for x, y in zip(a[1], b[1]):
            assert torch.equal(x, y), a[0]


def _thread_body(rank: int, world: int) -> list:
    out = []
    for spec, cap, mb, algorithm in DDP_CASES + [("bf16", 0.1, 0.3, "auto")]:
        inline = train_mlp(rank, spec, cap, mb, algorithm, steps=6, hook_thread=False)
        threaded = train_mlp(rank, spec, cap, mb, algorithm, steps=6, hook_thread=True)
        out.append((spec, inline[0], inline[2], threaded[0], threaded[2]))
    return out


@needs_2_gpus
def test_hook_thread_on_nccl_is_bit_identical_to_the_calling_thread() -> None:
    r0, r1 = spawn(_thread_body, 2, backend="nccl")
    for a, b in zip(r0, r1):
        spec = a[0]
        for part in (1, 3):  # every step's reduced gradients: ranks agree
            for step_a, step_b in zip(a[part], b[part]):
                assert all(torch.equal(u, v) for u, v in zip(step_a, step_b)), (spec, part)
        for step_a, step_b in zip(a[1], a[3]):  # the hook thread reduces what the calling thread does
            assert all(torch.equal(u, v) for u, v in zip(step_a, step_b)), spec
        assert all(torch.equal(u, v) for u, v in zip(a[2], a[4])), spec  # and the final parameters


def test_join_waits_for_the_device_work_of_every_input() -> None:
    """C.join's result is ordered after its inputs' stream work; collect_all's is not (it records no
    events). A slow kernel on a side stream writes x; the join's waiter must see the write."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from lowbit.comm import collectives as C

    dev = torch.device("cuda", 0)
    x = torch.zeros(1 << 20, device=dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    f = torch.futures.Future(devices=[dev])
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50-100 ms of spinning before the write
        x.fill_(1.0)
        f.set_result(x)  # records an event on the side stream
    ready = C.done(torch.ones(1, device=dev), dev)
    res = C.join([f.then(lambda fut: fut.value().add_(1)), ready], lambda: x, dev)
    res.wait()  # the current stream now waits for the join's events
    assert float(res.value().sum()) == 2.0 * x.numel()


def _auto_body(rank: int, world: int) -> dict:
    """codec="auto" on NCCL: the hook registered up front (so the fp32 steps, the probes and the trials
    all run through it) with 8-bit QSGD allowed; as many steps as measuring, probing and the trials can
    take (AutoTuner.last_decision_step: close finalists are tried twice)."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", rank)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)).to(dev)
    model = DDP(net, device_ids=[rank])
    state = lowbit.ddp.make_state(net, codec="auto", allow=["fp32", "bf16", "qsgd:bits=8,bucket=512"])
    state.auto.faster_than_fp32 = 0.0  # (test only) always go on to the trials, to exercise them on CUDA
    model.register_comm_hook(state, lowbit.ddp.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device=dev).manual_seed(rank)
    for _ in range(state.auto.last_decision_step(state.start_iter) + 1):
        x, y = torch.randn(64, 256, device=dev, generator=g), torch.randint(0, 10, (64,), device=dev, generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        opt.step()
    d = state.auto.decision
    return {"plan": d.assignment, "measured": sorted(d.measured_s), "params": [p.detach().cpu() for p in net.parameters()]}


@needs_2_gpus
def test_auto_decides_alike_on_every_rank_over_nccl() -> None:
    r0, r1 = spawn(_auto_body, 2, backend="nccl")
    assert r0["plan"] == r1["plan"] and r0["measured"] == r1["measured"] and len(r0["measured"]) >= 2
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def _body_crosswise_cuda(rank: int, world: int) -> tuple[list[int], str, str]:
    """Equal-size codecs called crosswise over NCCL: a rolling fingerprint of every call is compared
    once per CHECK_EVERY calls and read CHECK_LAG comparisons later (no host wait), so the mismatch
    surfaces at the same later call on both ranks; one in the last calls surfaces at flush_checks."""
    from lowbit.comm import collectives as C

    dev = torch.device("cuda", rank)
    a, b = "qsgd:bits=8,bucket=64", "qsgd:bits=8,bucket=64,rounding=nearest"
    x = torch.ones(1000, device=dev) * (rank + 1)
    for spec in (a, b):
        lowbit.all_reduce(x.clone(), spec)
    C.flush_checks(None)  # agreed calls: nothing to report
    raised_at, first = [], ""
    lowbit.all_reduce(x.clone(), a if rank == 0 else b)  # the crosswise call, first of a window
    for i in range(3 * C.CHECK_EVERY * (C.CHECK_LAG + 1)):
        try:
            lowbit.all_reduce(x.clone(), a)
        except lowbit.comm.CollectiveError as exc:
            raised_at.append(i)
            first = str(exc)
    lowbit.all_reduce(x.clone(), b if rank == 0 else a)  # crosswise again, the last call of the run
    try:
        C.flush_checks(None)
        last = "no error"
    except lowbit.comm.CollectiveError as exc:
        last = str(exc)
    return raised_at, first, last


@needs_2_gpus
def test_nccl_every_call_checked_lagged_and_flushed() -> None:
    """Issue 32 item 2 on CUDA: every call is in a compared fingerprint; the window holding the
    crosswise call is compared at its CHECK_EVERY-th call and read when its ring slot comes round again
    (CHECK_LAG windows later), on both ranks at the same call; flush_checks reads the rest."""
    from lowbit.comm import collectives as C

    (r0, f0, l0), (r1, f1, l1) = spawn(_body_crosswise_cuda, 2, backend="nccl", timeout_s=120)
    assert r0 == r1 == [C.CHECK_EVERY * (C.CHECK_LAG + 1) - 2], (r0, r1)
    assert f0 == f1 and "rounding=nearest" in f0 and "rank 1:" in f0 and "call 1 of" in f0, f0
    assert l0 == l1 and "rounding=nearest" in l0, l0
