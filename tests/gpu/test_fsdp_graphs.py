"""lowbit.fsdp's CUDA graphs (lowbit.comm.graphs) on one GPU: replays give the eager path's bits.

One process is rank 0 of a two-rank "mirror" group (a Python process group of this file): its
all-to-all hands every rank's slot back to itself (as if rank j sent me what I sent it) and its
all-gather gives every rank my shard, so the exchange moves real, deterministic bytes and decodes them.
The same model is trained with graphs off and on; parameters must agree bit for bit after every step,
with stochastic rounding (per-call seeds read from device memory), error feedback and the cast path.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _done(result):
    from torch._C._distributed_c10d import _create_work_from_future

    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class Mirror(dist.ProcessGroup):
    def getBackendName(self):  # noqa: N802
        return "mirror"

    def setGroupName(self, name):  # noqa: N802 - DeviceMesh reads the group's name
        self._name = name

    def getGroupName(self):  # noqa: N802
        return getattr(self, "_name", "mirror")

    def allreduce(self, tensors, opts):
        return _done(tensors)

    def broadcast(self, tensors, opts):
        return _done(tensors)

    def barrier(self, opts):
        return _done([])

    def allgather(self, outs, ins, opts):
        for out, x in zip(outs, ins):
            for o in out:
                o.copy_(x)
        return _done(outs)

    def _allgather_base(self, out, x, opts=None):
        for row in out.view(-1, x.numel()):
            if row.data_ptr() != x.data_ptr():  # FSDP gathers in place: its input is its own slot
                row.copy_(x.view(-1))
        return _done([out])

    all_gather_single = _allgather_base  # (the name newer torch calls)

    def alltoall_base(self, out, x, out_splits, in_splits, opts):
        out.copy_(x)
        return _done([out])

    def _reduce_scatter_base(self, out, x, opts=None):
        out.copy_(x.view(-1, out.numel())[0])
        return _done([out])

    reduce_scatter_single = _reduce_scatter_base


@pytest.fixture(scope="module")
def mirror_group():
    os.environ["LOWBIT_CHECK_CALLS"] = "0"
    dist.Backend.register_backend("mirror", lambda store, rank, size, timeout: Mirror(rank, size),
                                  devices=["cpu", "cuda"])
    dist.init_process_group("mirror", store=dist.HashStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _train(codec, param_codec, ef, reduce_dtype, graphs_on, steps=4):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import lowbit.fsdp as lf
    from lowbit.lab.models import build_model

    os.environ["LOWBIT_CUDA_GRAPHS"] = "1" if graphs_on else "0"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model("gpt2_small", num_classes=256, in_shape=(64,), context=64, n_layers=2, n_heads=2,
                            d_model=128)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    st = lf.register(model, codec=codec, param_codec=param_codec, error_feedback=ef, node_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 65), generator=g).cuda()
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(torch.cat([p.detach().to_local().float().reshape(-1) for p in model.parameters()]).cpu())
    torch.cuda.synchronize()
    return out, st


CASES = {
    "q8": ("qsgd:bits=8,bucket=512", None, False, torch.float32),
    "q8_p8": ("qsgd:bits=8,bucket=512", "qsgd:bits=8,bucket=512,rounding=nearest", False, torch.float32),
    "q4ef_p8": ("qsgd:bits=4,bucket=512", "qsgd:bits=8,bucket=512,rounding=nearest", True, torch.float32),
    "bf16_r16": ("bf16", None, False, torch.bfloat16),
    "onebit_ef": ("onebit:bucket=64", None, True, torch.float32),
}


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_graph_replays_match_the_eager_exchange(mirror_group, case):
    codec, pcodec, ef, rd = CASES[case]
    eager, st0 = _train(codec, pcodec, ef, rd, graphs_on=False)
    graphed, st1 = _train(codec, pcodec, ef, rd, graphs_on=True)
    assert st0.grad_graphs.replays == 0 and st0.param_graphs.replays == 0
    assert st1.grad_graphs.replays > 0, "no reduce-scatter was replayed from a graph"
    if pcodec is not None:
        assert st1.param_graphs.replays > 0, "no all-gather was replayed from a graph"
    assert st0.stats.bytes_sent == st1.stats.bytes_sent
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"{case}: step {i}: graph replay differs from the eager exchange"
    if ef:
        r0 = {k: v.cpu() for k, v in st0.feedback.residuals.items()}
        r1 = {k: v.cpu() for k, v in st1.feedback.residuals.items()}
        assert r0.keys() == r1.keys() and all(torch.equal(r0[k], r1[k]) for k in r0)


needs_2_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                  reason="needs 2 CUDA GPUs")


def _nccl_body(rank: int, world: int) -> dict:
    torch.cuda.set_device(rank)
    out = {}
    for case, (codec, pcodec, ef, rd) in CASES.items():
        eager, st0 = _train(codec, pcodec, ef, rd, graphs_on=False)
        graphed, st1 = _train(codec, pcodec, ef, rd, graphs_on=True)
        out[case] = {"same": all(torch.equal(a, b) for a, b in zip(eager, graphed)),
                     "replays": (st1.grad_graphs.replays, st1.param_graphs.replays),
                     "finite": all(bool(torch.isfinite(a).all()) for a in eager)}
    return out


@needs_2_gpus
def test_graph_replays_match_the_eager_exchange_over_nccl() -> None:
    """The same comparison over a real 2-rank NCCL group: NCCL's all-to-all and all-gather captured."""
    from lowbit.launch import spawn

    for r in spawn(_nccl_body, 2, backend="nccl", timeout_s=300):
        for case, got in r.items():
            assert got["finite"], case
            assert got["replays"][0] > 0, f"{case}: nothing replayed (capture failed: see the INFO log)"
            assert got["same"], f"{case}: graph replays over NCCL differ from the eager exchange"
