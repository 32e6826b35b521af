"""torchtitan itself (not a stand-in spec), 2 CPU processes over gloo: its llama3 debug model, its job
config, its own ``parallelize_fn`` and optimizers, with lowbit turned on by ``with_lowbit``.

What runs is torchtitan's ``Trainer.__init__`` sequence, step by step, with torchtitan's pieces:
``llama3_debugmodel()`` (the job config of its debug run: bf16 mixed precision, selective activation
checkpointing, the chunked cross-entropy, fused AdamW), ``ParallelDims.from_config``,
``model_config.update_from_config``, the model built on the meta device, ``spec.parallelize_fn`` (which
ends in torchtitan's ``apply_fsdp_to_decoder``), ``to_empty`` / ``init_weights``, ``config.optimizer.build``,
then ``spec.post_optimizer_build_fn(optimizers, model_parts, parallel_dims)`` as the trainer calls it,
then three steps of the trainer's forward / loss / backward / step on random tokens.

What does not run, and why (torchtitan 0.3.0 on torch 2.13, CPU):

* ``Trainer`` itself: it calls ``torch.cuda.set_device`` (torchtitan takes ``"cuda"`` when no accelerator
  is found) and needs a tokenizer and a dataset on disk. Its mesh code reads the same ``device_type``,
  which is set to ``"cpu"`` here (the one change to torchtitan).
* FlexAttention (the debug model's backend) has no backward on CPU: each layer's inner attention is
  swapped for torchtitan's ``ScaledDotProductAttention``, as torchtitan's own graph_trainer tests do.
* ``spmd_backend="spmd_types"`` (torchtitan 0.3.0's default) fails inside torchtitan's parallelize_fn on
  torch 2.13 (``fully_shard`` wants DTensors on the SPMD mesh), before lowbit is involved: the test runs
  ``"partial_dtensor"`` and ``"full_dtensor"``.
* torchtitan's plain FSDP2 run: on gloo its reduce-scatter fails (torchtitan sets the gradient divide
  factor to 1, which FSDP2 sends as ``ReduceOp.PREMUL_SUM``, and gloo has none). The exact baseline is
  lowbit's ``fp32`` codec, whose bytes are the fp32 reduce-scatter's (checked against the shard sizes).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("torchtitan")

from lowbit.launch import spawn  # noqa: E402
from tests.distributed.shared_spawn import part, run_parts  # noqa: E402

pytestmark = pytest.mark.slow  # ~25 s on 2 cores: three model builds and nine steps on 2 ranks

STEPS = 3
Q8 = "qsgd:bits=8,bucket=512"
Q8_PARAMS = "qsgd:bits=8,bucket=512,rounding=nearest"  # deterministic: the docs' rule for param_codec


def _train(rank: int, world: int, spmd_backend: str, param_dtype: str, codec: str, param_codec: str) -> dict:
    """torchtitan's trainer build sequence (module doc) with ``with_lowbit``, then STEPS steps."""
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from lowbit.integrations.torchtitan import with_lowbit

    tt_parallel_dims.device_type = "cpu"  # torchtitan assumes "cuda" without an accelerator (module doc)
    config = llama3_debugmodel()
    config.training.seq_len, config.training.local_batch_size = 64, 2
    config.training.mixed_precision_param = param_dtype
    config.parallelism.spmd_backend = spmd_backend
    for layer in config.model_spec.model.layers:  # FlexAttention has no CPU backward (module doc)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    spec = config.model_spec = with_lowbit(config.model_spec, codec=codec, param_codec=param_codec)

    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    spec.model.update_from_config(config=config)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=parallel_dims, training=config.training,
                                parallelism=config.parallelism, compile_config=config.compile,
                                ac_config=config.activation_checkpoint, dump_folder=config.dump_folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):  # as the trainer does: lm_head applied per chunk in the loss
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], parallel_dims)

    g = torch.Generator().manual_seed(rank)
    shape = (config.training.local_batch_size, config.training.seq_len + 1)
    tokens = torch.randint(0, spec.model.vocab_size, shape, generator=g)  # one batch a rank, every step: the
    losses = []                                                           # loss falls within 3 steps
    for _ in range(STEPS):
        optimizers.zero_grad()
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        global_valid_tokens = torch.tensor(labels.numel() * world)  # the trainer's dist_sum over the batch mesh
        kwargs: dict = {}
        if spmd_backend == "full_dtensor":
            from torchtitan.distributed import full_dtensor
            inputs, labels, kwargs = full_dtensor.parallelize_inputs(parallel_dims, inputs, labels, kwargs)
        loss, _ = loss_fn(model(inputs, **kwargs), labels, global_valid_tokens)
        loss.backward()
        optimizers.step()
        losses.append(float(loss.detach()))

    states = spec.post_optimizer_build_fn.states
    state = states[0]
    return {"model": type(model).__name__, "states": [type(s).__name__ for s in states],
            "modules": list(state.modules), "grad": state.grad_stats.as_dict(), "param": state.param_stats.as_dict(),
            "losses": losses}


@pytest.fixture(scope="module")
def ranks() -> list:
    parts = (("fp32", _train, ("partial_dtensor", "float32", "fp32", "fp32")),
             ("q8", _train, ("partial_dtensor", "float32", Q8, Q8_PARAMS)),
             ("q8_full_bf16", _train, ("full_dtensor", "bfloat16", Q8, Q8_PARAMS)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWBIT_KERNELS", "reference")  # the framework, not the kernels, is under test here
        return spawn(run_parts, 2, parts, backend="gloo", timeout_s=300)


def _shards(modules: list[str]) -> list[int]:
    """Each FSDP unit's per-rank shard size, from state.modules' ``name:numel`` (units with parameters)."""
    sizes = [int(m.rsplit(":", 1)[1]) for m in modules]
    return [s for s in sizes if s > 0]


def test_torchtitan_parallelize_fn_gets_lowbit_exchanges(ranks) -> None:
    """torchtitan's own FSDP units (embedding, each of the 6 blocks, norm, lm_head) each get lowbit's
    reduce-scatter once a step and its all-gather at least once a step, on both DTensor backends."""
    for name in ("fp32", "q8", "q8_full_bf16"):
        for r in part(ranks, name):
            assert r["model"] == "FSDPLlama3Model" and r["states"] == ["FSDPState"], (name, r)
            names = [m.rsplit(":", 1)[0] for m in r["modules"]]
            assert {"tok_embeddings", "norm", "lm_head"} <= set(names), (name, names)
            assert [n for n in names if n.startswith("layers.")] == [f"layers.{i}" for i in range(6)], (name, names)
            units = len(_shards(r["modules"]))
            assert r["grad"]["calls"] == STEPS * units, (name, units, r["grad"])
            assert r["param"]["calls"] >= STEPS * units, (name, units, r["param"])
            assert all(math.isfinite(x) for x in r["losses"]), (name, r["losses"])
            assert r["losses"][-1] < r["losses"][0] - 0.3, (name, r["losses"])  # it trains (about 0.5 here)


def test_torchtitan_bytes_drop_and_loss_follows_fp32(ranks) -> None:
    """The fp32 codec sends what FSDP's fp32 reduce-scatter would ((K-1) shards of 4 bytes a value, per
    unit and step); 8-bit QSGD sends about a quarter of it in both directions, and its loss stays within
    the codec's error of the exact run's (0.0015 apart here, of a 0.49 fall in 3 steps)."""
    fp32, q8 = part(ranks, "fp32"), part(ranks, "q8")
    for e, q in zip(fp32, q8):
        shards = _shards(e["modules"])
        assert e["grad"]["bytes_sent"] == STEPS * (2 - 1) * 4 * sum(shards), (e["grad"], shards)
        assert 0.2 < q["grad"]["bytes_sent"] / e["grad"]["bytes_sent"] < 0.3, (q["grad"], e["grad"])
        assert q["param"]["calls"] == e["param"]["calls"], (q["param"], e["param"])
        assert 0.2 < q["param"]["bytes_sent"] / e["param"]["bytes_sent"] < 0.3, (q["param"], e["param"])
        for a, b in zip(e["losses"], q["losses"]):
            assert abs(a - b) < 0.01, (e["losses"], q["losses"])
