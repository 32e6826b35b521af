"""lowbit.fsdp over NCCL on 2 GPUs (run on the device: ``pytest -m gpu``): FSDP's streams, bf16 parameters."""

from __future__ import annotations

import pytest
import torch

from lowbit.launch import spawn

pytestmark = pytest.mark.gpu

needs_2_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                  reason="needs 2 CUDA GPUs")


def _body(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import lowbit.fsdp as lf
    from tests.distributed.test_fsdp import Net, _shard, _train

    torch.cuda.set_device(rank)
    out: dict = {}
    with torch.device("cuda", rank):
        plain = _shard(Net())
        fp32 = _shard(Net())
    lf.register(fp32, codec="fp32")
    out["fp32"] = (_full(plain, rank, _train), _full(fp32, rank, _train))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with torch.device("cuda", rank):
        base = _shard(Net(), mp_policy=mp)
        q8 = _shard(Net(), mp_policy=mp)
    st = lf.register(q8, codec="qsgd:bits=8", param_codec="qsgd:bits=8,rounding=nearest")
    out["base_losses"] = _losses(base, rank, _train)
    out["q8_losses"] = _losses(q8, rank, _train)
    seen = []
    h = q8.blocks[0][1].register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().float().cpu()))
    with torch.no_grad():
        q8(torch.randn(2, 24, device="cuda"))
    h.remove()
    out["w"] = seen[0]
    out["bytes"] = st.stats.bytes_sent
    return out


def _cuda_train(model, rank, train, steps=8):
    # tests' _train makes CPU batches: move the model's inputs by wrapping its forward
    inner = model.forward

    def fwd(x):
        return inner(x.cuda()).float().cpu()
    model.forward = fwd
    return train(model, rank, steps)


def _losses(model, rank, train):
    return _cuda_train(model, rank, train)


def _full(model, rank, train):
    _cuda_train(model, rank, train)
    return [p.full_tensor().detach().float().cpu() for p in model.parameters()]


@needs_2_gpus
def test_fsdp_over_nccl() -> None:
    r0, r1 = spawn(_body, 2, backend="nccl", timeout_s=180)
    for r in (r0, r1):
        plain, ours = r["fp32"]
        assert max(float((a - b).abs().max()) for a, b in zip(plain, ours)) < 1e-6
        assert abs(r["q8_losses"][-1] - r["base_losses"][-1]) < 0.05 * r["base_losses"][-1]
    assert torch.equal(r0["w"], r1["w"])
    assert r0["bytes"] > 0
