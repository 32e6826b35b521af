"""Lightning and Accelerate, the real packages, 2 CPU processes over gloo: compression really runs."""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any
import os

import pytest
import torch
from torch import nn

from lowbit.launch import spawn

def _lightning():
    """lightning.pytorch, imported where a test uses it: not at module level, so that the ranks of the
    Accelerate test (which import this module to find their function) do not import Lightning (~3 s of
    CPU a rank)."""
    return pytest.importorskip("lightning.pytorch")


def _env(rank: int, world: int) -> None:
    # as torchrun would set them: the frameworks see an externally launched multi-process run
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")


@functools.cache
def _net_class() -> type:
    pl = _lightning()

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

        def training_step(self, batch, _):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = torch.utils.data.TensorDataset(torch.randn(512, 32, generator=g),
                                                  torch.randint(0, 4, (512,), generator=g))
            return torch.utils.data.DataLoader(data, batch_size=16)

    return Net


def _Net():  # noqa: N802 (stands for the class)
    return _net_class()()


def _trainer(world: int, cb, steps: int):
    return _lightning().Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=steps, callbacks=[cb],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)


def _body_lightning(rank: int, world: int, tmp: str) -> dict:
    from lowbit.integrations.lightning import LowbitCallback

    _env(rank, world)
    cb = LowbitCallback(codec="onebit:bucket=64")
    model = _Net()
    trainer = _trainer(world, cb, 6)
    trainer.fit(model)
    trainer.save_checkpoint(f"{tmp}/ck.ckpt")
    saved = {k: v.clone() for k, v in cb.state.residuals.items()}
    out = {"calls": cb.state.stats.calls, "bytes": cb.state.stats.bytes_sent,
           "params": [p.detach().clone() for p in model.parameters()]}
    # resume from the checkpoint rank 0 wrote: each rank gets its own residuals back
    cb2 = LowbitCallback(codec="onebit:bucket=64")
    _trainer(world, cb2, 6).fit(_Net(), ckpt_path=f"{tmp}/ck.ckpt")  # already at step 6: restores, trains 0 steps
    out["restored"] = all(torch.equal(saved[k], cb2.state.residuals[k].cpu()) for k in saved)
    out["ranks_differ"] = None
    out["residual0"] = next(iter(saved.values()))
    return out


@functools.cache
def _sharded_net_class() -> type:
    """The same net, sharded with FSDP2 in configure_model over the strategy's data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    class ShardedNet(_net_class()):
        def configure_model(self):
            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    return ShardedNet


def _body_lightning_fsdp(rank: int, world: int) -> dict:
    import warnings

    from lightning.pytorch.strategies import ModelParallelStrategy

    from lowbit.integrations.lightning import LowbitCallback

    _env(rank, world)
    out = {}
    for name, strategy in (("dp2", ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)),
                           ("defaults", ModelParallelStrategy())):  # data_parallel_size 1: nothing to send
        cb = LowbitCallback(codec="qsgd:bits=8,bucket=512", error_feedback=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _lightning().Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=4, callbacks=[cb],
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False).fit(_sharded_net_class()())
        out[name] = {"state": type(cb.state).__name__, "said": _lowbit_warnings(caught),
                     "grad_calls": cb.state.grad_stats.calls if cb.state else 0,
                     "grad_bytes": cb.state.grad_stats.bytes_sent if cb.state else 0,
                     "numel": sum(p.numel() for p in _Net().parameters())}
    return out


def test_lightning_callback_serves_model_parallel_strategy_on_cpu(reference_kernels) -> None:
    """ModelParallelStrategy (FSDP2 in configure_model) on 2 CPU gloo ranks: the callback registers
    lowbit.fsdp on the sharded model and its reduce-scatters run compressed; with the strategy's defaults
    the data-parallel mesh is 1 rank wide, and the callback installs nothing and says why."""
    _lightning()
    r0, r1 = spawn(_body_lightning_fsdp, 2, backend="gloo", timeout_s=120)
    for r in (r0, r1):
        dp2 = r["dp2"]
        assert dp2["state"] == "FSDPState" and dp2["grad_calls"] > 0, dp2
        # an fp32 reduce-scatter on 2 ranks sends half the gradient a step; 8-bit rows about a quarter of that
        # (measured 0.26: the small tensors ride exact)
        assert 0 < dp2["grad_bytes"] < 0.4 * (4 * dp2["numel"] / 2) * 4, dp2
        assert r["defaults"]["state"] == "NoneType"
    said = r0["defaults"]["said"]
    assert len(said) == 1 and "data-parallel mesh of 1 rank" in said[0] and "data_parallel_size=N" in said[0], said
    assert not r1["defaults"]["said"]  # rank 0 says it
    assert not r0["dp2"]["said"], r0["dp2"]["said"]


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch reference kernels in the ranks: they fork from a server without numba, whose import and
    cache load (~2 s a rank) would be most of these tests' time; the frameworks, not the kernels, are
    what they test (the kernels' backends: the kernel and DDP tests)."""
    monkeypatch.setenv("LOWBIT_KERNELS", "reference")


def test_lightning_callback_compresses_on_cpu_and_checkpoints_every_rank(tmp_path, reference_kernels) -> None:
    _lightning()
    r0, r1 = spawn(_body_lightning, 2, str(tmp_path), backend="gloo", timeout_s=120)
    for r in (r0, r1):
        assert r["calls"] > 0 and r["bytes"] > 0
        assert r["restored"]
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)
    assert not torch.equal(r0["residual0"], r1["residual0"])  # residuals are per rank, and both came back


def _body_accelerate(rank: int, world: int) -> dict:
    from accelerate import Accelerator

    from lowbit.integrations.accelerate import register

    _env(rank, world)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model, opt = acc.prepare(net, opt)
    state = register(acc, model, codec="qsgd:bits=8,bucket=512")
    g = torch.Generator().manual_seed(rank)
    for _ in range(5):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
    return {"calls": state.stats.calls, "bytes": state.stats.bytes_sent, "n": acc.num_processes,
            "params": [p.detach().clone() for p in model.parameters()]}


def test_accelerate_recipe_compresses(reference_kernels) -> None:
    pytest.importorskip("accelerate")
    r0, r1 = spawn(_body_accelerate, 2, backend="gloo", timeout_s=120)
    for r in (r0, r1):
        assert r["n"] == 2 and r["calls"] > 0 and r["bytes"] > 0
    for a, b in zip(r0["params"], r1["params"]):
        assert torch.equal(a, b)


def _body_accelerate_fsdp2(rank: int, world: int) -> dict:
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard

    import lowbit.fsdp
    from lowbit.integrations.accelerate import register

    _env(rank, world)
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

    def train(model: nn.Module, steps: int = 3) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    out: dict[str, Any] = {}
    ddp = acc.prepare(net())  # on CPU the FSDP2 plugin is ignored: a DistributedDataParallel
    out["prepared"] = type(ddp).__name__
    try:
        lowbit.fsdp.register(ddp, codec="qsgd:bits=8")
    except ValueError as e:
        out["fsdp_error"] = str(e)
    state = register(acc, ddp, codec="qsgd:bits=8,bucket=512")
    train(ddp)
    out["ddp"] = (type(state).__name__, state.stats.calls)
    # what the plugin builds on GPU, an FSDP2 model, sharded here by hand: register serves it as well
    sharded = net()
    for m in sharded:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(sharded)
    try:
        register(acc, sharded, algorithm="allgather")  # a DDP option: refused with FSDP's word
    except TypeError as e:
        out["option_error"] = str(e)
    state = register(acc, sharded, codec="qsgd:bits=8,bucket=512")
    train(sharded)
    out["fsdp"] = (type(state).__name__, state.grad_stats.calls, state.grad_stats.bytes_sent)
    try:
        register(acc, net(), codec="qsgd:bits=8,bucket=512")
    except ValueError as e:
        out["plain_error"] = str(e)
    return out


def test_accelerate_register_serves_ddp_and_fsdp2_models(reference_kernels) -> None:
    """Accelerate with the FSDP2 plugin on 2 CPU ranks: it builds a DDP model (on CPU it ignores the
    plugin), on which lowbit.fsdp.register's error points to the DDP path and register serves DDP; an
    FSDP2 model (what the plugin builds on GPU; sharded by hand here) gets lowbit.fsdp's exchanges."""
    pytest.importorskip("accelerate")
    r0, r1 = spawn(_body_accelerate_fsdp2, 2, backend="gloo", timeout_s=120)
    for r in (r0, r1):
        assert r["prepared"] == "DistributedDataParallel"
        assert "is a DistributedDataParallel" in r["fsdp_error"] and "lowbit.ddp.register" in r["fsdp_error"], r
        assert r["ddp"][0] == "LowbitState" and r["ddp"][1] > 0, r
        assert r["fsdp"][0] == "FSDPState" and r["fsdp"][1] > 0 and r["fsdp"][2] > 0, r
        assert "sharded with fully_shard (FSDP2), and lowbit.fsdp.register refuses" in r["option_error"], r
        assert "Sequential" in r["plain_error"] and "FSDP1" in r["plain_error"], r["plain_error"]


@dataclasses.dataclass
class _Spec:
    """A stand-in for torchtitan's ModelSpec (torchtitan is not installed here): its fields that matter."""

    name: str
    post_optimizer_build_fn: Any = None


def _body_torchtitan(rank: int, world: int) -> dict:
    import warnings

    from torch.distributed.fsdp import fully_shard

    from lowbit.integrations.torchtitan import with_lowbit

    seen = []
    spec = with_lowbit(_Spec("llama3", post_optimizer_build_fn=lambda *a: seen.append(len(a))),
                       codec="qsgd:bits=8,bucket=512")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    for m in model:  # what parallelize_fn does with dp_shard = 2 (then torchtitan materialises the parameters)
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    plain = nn.Linear(4, 4)  # a part nothing sharded
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec.post_optimizer_build_fn(opt, [model, plain], types.SimpleNamespace(dp_shard=2, tp=1))
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    states = spec.post_optimizer_build_fn.states
    return {"seen": seen, "states": [type(s).__name__ for s in states], "calls": states[0].grad_stats.calls,
            "said": _lowbit_warnings(caught)}


def test_torchtitan_spec_registers_after_the_optimizers_are_built(reference_kernels) -> None:
    """with_lowbit's post_optimizer_build_fn, called as torchtitan's trainer calls it, runs the spec's own
    hook, then registers lowbit.fsdp on the sharded part (its reduce-scatters run) and says that a part
    not sharded is left alone. torchtitan itself: test_torchtitan_real.py (skipped where it is absent)."""
    from lowbit.integrations.torchtitan import with_lowbit

    r0, r1 = spawn(_body_torchtitan, 2, backend="gloo", timeout_s=120)
    for r in (r0, r1):
        assert r["seen"] == [3] and r["states"] == ["FSDPState", "NoneType"] and r["calls"] > 0, r
    assert len(r0["said"]) == 1 and "Linear is not sharded" in r0["said"][0] and "dp_shard=2" in r0["said"][0], r0
    with pytest.raises(ValueError, match="expects a torchtitan ModelSpec"):
        with_lowbit(object())


def _lowbit_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, RuntimeWarning) and str(w.message).startswith("lowbit:")]


def test_accelerate_with_one_process_says_nothing_is_compressed(monkeypatch) -> None:
    """`accelerate launch --cpu --num_processes 2` runs one process: register returns None, and says so
    once, with what to launch instead (issue 33)."""
    pytest.importorskip("accelerate")
    import warnings

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import lowbit.ddp
    from lowbit.integrations.accelerate import register

    monkeypatch.setattr("lowbit.comm.registration._SAID", set())
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # what that launch sets in its one process
    try:
        acc = Accelerator()
        model = acc.prepare(nn.Linear(4, 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert register(acc, model, codec="qsgd:bits=8,bucket=512") is None
            assert register(acc, model, codec="qsgd:bits=8,bucket=512") is None
    finally:
        AcceleratorState._reset_state(True)
    said = _lowbit_warnings(caught)
    assert len(said) == 1, said
    assert "1 process" in said[0] and "--multi_gpu --num_processes" in said[0], said[0]


def test_lightning_without_ddp_says_nothing_is_compressed_once(monkeypatch) -> None:
    import warnings

    pl = _lightning()

    import lowbit.ddp
    from lowbit.integrations.lightning import LowbitCallback

    monkeypatch.setattr("lowbit.comm.registration._SAID", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two fits (a tuner and a trainer, say): said once
            cb = LowbitCallback(codec="qsgd:bits=8,bucket=512")
            pl.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[cb], logger=False,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(_Net())
            assert cb.state is None
    said = _lowbit_warnings(caught)
    assert len(said) == 1, said
    assert "SingleDeviceStrategy" in said[0] and "strategy='ddp'" in said[0], said[0]


def _gpt2_run(tmp: str, world: int, with_lowbit: bool) -> tuple[list[float], Any]:
    """A tiny random GPT-2 (no download) trained for a few steps by the Hugging Face Trainer on CPU."""
    import transformers

    from lowbit.integrations.transformers import register

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256,
                                                                 n_positions=32))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (64, 16), generator=g)
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=tmp, use_cpu=True, max_steps=6, per_device_train_batch_size=4,
                                          learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                                          disable_tqdm=True, seed=0, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    sent: list[int] = []  # lowbit's bytes after each step
    if with_lowbit:
        cb = register(trainer, codec="qsgd:bits=8,bucket=512")

        class Bytes(transformers.TrainerCallback):
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                sent.append(cb.state.stats.bytes_sent)

        trainer.add_callback(Bytes())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return losses, None if not with_lowbit else (cb.state.stats.calls, sent, numel, type(trainer.model_wrapped).__name__)


def _body_transformers(rank: int, world: int, tmp: str) -> dict:
    _env(rank, world)
    plain, _ = _gpt2_run(f"{tmp}/plain", world, False)
    lossy, (calls, sent, numel, wrapped) = _gpt2_run(f"{tmp}/lowbit", world, True)
    return {"plain": plain, "lowbit": lossy, "calls": calls, "sent": sent, "numel": numel, "wrapped": wrapped}


def test_transformers_trainer_callback_compresses_on_cpu(tmp_path, reference_kernels) -> None:
    """The Hugging Face Trainer on 2 CPU processes: the callback registers on the DDP model the Trainer
    built, the loss curve stays the uncompressed one within 8-bit QSGD's error, and once compression
    starts (step 3: DDP rebuilds its buckets after step 1) each rank sends, counted from lowbit's buffers,
    well under the fp32 all-reduce's bytes of the first steps."""
    pytest.importorskip("transformers")
    r0, r1 = spawn(_body_transformers, 2, str(tmp_path), backend="gloo", timeout_s=120)
    assert r0["wrapped"] == "DistributedDataParallel"
    assert len(r0["plain"]) == len(r0["lowbit"]) == 6
    for a, b in zip(r0["plain"], r0["lowbit"]):
        assert abs(a - b) <= 0.02 * abs(a), (r0["plain"], r0["lowbit"])
    for r in (r0, r1):
        assert r["calls"] > 0 and len(r["sent"]) == 6
        step = [b - a for a, b in zip([0, *r["sent"]], r["sent"])]
        fp32 = 4 * r["numel"]  # a ring all-reduce on 2 ranks: each sends numel fp32 values a step
        assert step[0] == fp32, (step, fp32)  # the first steps run exact: the count is the buffers' bytes
        assert all(s < 0.35 * fp32 for s in step[3:]), (step, fp32)  # 8-bit QSGD on ~90% of the values


def test_transformers_with_one_process_says_nothing_is_compressed(tmp_path, monkeypatch) -> None:
    """One process: the Trainer wraps nothing, so the callback installs nothing and says so, once, with
    what to launch instead; the options were checked when the callback was built."""
    pytest.importorskip("transformers")
    import warnings

    import transformers
    from accelerate.state import AcceleratorState

    from lowbit.integrations.transformers import register

    monkeypatch.setattr("lowbit.comm.registration._SAID", set())
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32,
                                                                 n_positions=8))
    data = [{"input_ids": torch.arange(8), "labels": torch.arange(8)}] * 4
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[],
                                          save_strategy="no", disable_tqdm=True, per_device_train_batch_size=2)
    try:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        with pytest.raises(TypeError, match="codex"):
            register(trainer, codex="qsgd:bits=8")  # a typo: refused before training
        cb = register(trainer, codec="qsgd:bits=8,bucket=512")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
            trainer.train()
    finally:
        AcceleratorState._reset_state(True)
    assert cb.state is None
    said = _lowbit_warnings(caught)
    assert len(said) == 1, said
    assert "1 process" in said[0] and "GPT2LMHeadModel" in said[0] and "torchrun" in said[0], said[0]
