"""The trainers' FSDP2 paths where their clients build FSDP2 only on a GPU (issue 43 item 1), on one GPU.

On CPU Accelerate's FSDP2 plugin and the Hugging Face Trainer's ``fsdp`` option build a DDP model and
Lightning's ``ModelParallelStrategy`` needs a mesh of the devices: those tests (tests/distributed/
test_integrations.py) shard by hand. Here each client builds its FSDP2 model on ``cuda:0`` in a real NCCL
group of one process, and lowbit's adapter must find the FSDP2 model it built, register
:func:`lowbit.fsdp.register` on it (lowbit's reduce-scatter is installed on its modules; with
one rank FSDP2 calls none), say once that one rank exchanges nothing, and leave training finite. A run with two or more
GPUs (benchmarks/README.md, "Runs still to make") checks the bytes."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _env() -> None:  # as torchrun sets them for one process
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29581")


def _said(caught: Any) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("lowbit")]


def _lowbit_comms(model: nn.Module) -> set[str]:
    """The reduce-scatter objects installed on the FSDP2 modules of ``model``. One rank's FSDP2 runs no
    reduce-scatter (there is nothing to reduce), so what is installed is what can be checked here."""
    from torch.distributed.fsdp import FSDPModule

    out = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is not None:
                out |= {type(v).__name__ for k, v in vars(pg).items() if "reduce_scatter" in k and v is not None}
    return out


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))


def _accelerate(rank: int, world: int) -> dict:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    from lowbit.integrations._register import check_options, register_built
    from lowbit.integrations.accelerate import register

    _env()
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = acc.prepare(net, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        none = register(acc, model, codec="qsgd:bits=8,bucket=512")  # one process: None, and said
    # what register does with two or more processes, on the FSDP2 model the plugin built here
    state = register_built(model, check_options(None, {"codec": "qsgd:bits=8,bucket=512"}, "test"))
    g = torch.Generator(device="cuda").manual_seed(0)
    losses = []
    for _ in range(4):
        x = torch.randn(32, 64, device="cuda", generator=g)
        y = torch.randint(0, 4, (32,), device="cuda", generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
        losses.append(loss.item())
    return {"fsdp2": isinstance(model, FSDPModule), "device": str(next(model.parameters()).device),
            "none": none is None, "state": type(state).__name__, "comms": _lowbit_comms(model),
            "losses": losses, "said": _said(caught)}


def _transformers(rank: int, world: int, tmp: str) -> dict:
    import transformers
    from torch.distributed.fsdp import FSDPModule

    from lowbit.integrations.transformers import register

    _env()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256,
                                                                 n_positions=32))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (64, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=tmp, max_steps=4, per_device_train_batch_size=4,
                                          learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                                          disable_tqdm=True, seed=0, dataloader_num_workers=0,
                                          fsdp="full_shard", fsdp_config={"version": 2,
                                                                          "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    cb = register(trainer, codec="qsgd:bits=8,bucket=512")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    wrapped = trainer.model_wrapped
    return {"fsdp2": isinstance(wrapped, FSDPModule), "wrapped": type(wrapped).__name__,
            "state": type(cb.state).__name__, "comms": _lowbit_comms(wrapped),
            "losses": losses, "said": _said(caught)}


def _lightning(rank: int, world: int) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from lowbit.integrations.lightning import LowbitCallback

    _env()

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(256, 64, generator=g),
                                                  torch.randint(0, 4, (256,), generator=g))
            return torch.utils.data.DataLoader(data, batch_size=16)

    cb = LowbitCallback(codec="qsgd:bits=8,bucket=512")
    model = Net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(accelerator="gpu", devices=1, max_steps=4, callbacks=[cb], logger=False,
                   strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(model)
    return {"fsdp2": isinstance(model.net, FSDPModule), "device": str(next(model.parameters()).device),
            "state": type(cb.state).__name__, "said": _said(caught)}


@needs_cuda
def test_accelerate_fsdp2_plugin_on_a_gpu_gets_lowbit_fsdp() -> None:
    pytest.importorskip("accelerate")
    from lowbit.launch import spawn

    (r,) = spawn(_accelerate, 1, backend="nccl", timeout_s=300)
    assert r["fsdp2"] and r["device"].startswith("cuda"), r
    assert r["none"] and len(r["said"]) == 1 and "Accelerate runs 1 process" in r["said"][0], r["said"]
    assert r["state"] == "FSDPState" and "LowbitReduceScatter" in r["comms"], r
    assert all(torch.isfinite(torch.tensor(r["losses"]))), r


@needs_cuda
def test_transformers_trainer_fsdp2_on_a_gpu_gets_lowbit_fsdp(tmp_path) -> None:
    pytest.importorskip("transformers")
    from lowbit.launch import spawn

    (r,) = spawn(_transformers, 1, str(tmp_path), backend="nccl", timeout_s=300)
    assert r["fsdp2"], r
    assert r["state"] == "FSDPState" and "LowbitReduceScatter" in r["comms"], r
    assert len(r["losses"]) == 4 and all(torch.isfinite(torch.tensor(r["losses"]))), r


@needs_cuda
def test_lightning_model_parallel_strategy_on_a_gpu_says_one_rank() -> None:
    pytest.importorskip("lightning")
    from lowbit.launch import spawn

    (r,) = spawn(_lightning, 1, backend="nccl", timeout_s=300)
    assert r["fsdp2"] and r["device"].startswith("cuda"), r
    assert r["state"] == "NoneType", r  # a data-parallel mesh of 1 rank: nothing installed, and said
    assert len(r["said"]) == 1 and "data-parallel mesh of 1 rank" in r["said"][0], r["said"]
