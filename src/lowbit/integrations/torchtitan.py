"""torchtitan: lowbit's FSDP2 exchanges on the model torchtitan shards, with one line in a config function.

    from lowbit.integrations.torchtitan import with_lowbit

    config.model_spec = with_lowbit(config.model_spec, codec="qsgd:bits=8")   # off: delete this line

Where it plugs in, and why there: torchtitan's trainer builds the model on the meta device, calls the
spec's ``parallelize_fn`` (tensor parallelism, activation checkpointing, compile, then ``fully_shard``),
materialises the parameters (``to_empty``, ``init_weights``), builds the optimizers, and then calls the
spec's ``post_optimizer_build_fn(optimizers, model_parts, parallel_dims)``. That last call sees every
model part sharded, with real parameters, before the first forward: where :func:`lowbit.fsdp.register`
belongs. (Wrapping ``parallelize_fn`` would register on meta tensors; torchtitan's model converters
rewrite the model's config before the model exists, before ``fully_shard``, so they cannot.) A spec's own
``post_optimizer_build_fn`` (the MoE models' load-balancing hook) still runs, first.

Each part sharded with ``fully_shard`` gets :func:`lowbit.fsdp.register`; a part that is not (``dp_shard``
of 1, or ``dp_replicate`` alone, whose composable ``replicate`` lowbit has no exchange for) installs
nothing, and that is said once. HSDP (``dp_replicate`` and ``dp_shard`` both above 1) shards on a 2-D mesh,
which :func:`lowbit.fsdp.register` refuses with its reason.

This adapter does not import torchtitan: it relies only on the spec being a dataclass with a
``post_optimizer_build_fn`` field and on that call's arguments, as in torchtitan 0.3 (0.2's ``TrainSpec``
has no such field, and is refused). Tested with a stand-in spec (tests/distributed/test_integrations.py)
and against torchtitan 0.3.0 itself on torch 2.13 (tests/distributed/test_torchtitan_real.py: its llama3
debug model through its own ``parallelize_fn``, ``spmd_backend`` "partial_dtensor" and "full_dtensor").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import lowbit.fsdp
from lowbit.comm.registration import warn_uncompressed
from lowbit.integrations._register import is_fsdp

__all__ = ["LowbitPostBuild", "with_lowbit"]


class LowbitPostBuild:
    """A torchtitan ``post_optimizer_build_fn`` that runs ``previous`` (the spec's own, if any), then
    registers lowbit on every model part sharded with ``fully_shard``. ``states`` holds each part's
    :class:`lowbit.fsdp.FSDPState` (None for a part left alone) once torchtitan has called it.

    Args:
        previous: the spec's ``post_optimizer_build_fn`` (None: none).
        config: a :class:`lowbit.fsdp.FSDPConfig`, instead of ``**options``.
        **options: :func:`lowbit.fsdp.register`'s options, keyword-only.

    Raises:
        ValueError: an option out of range (naming it), or ``config`` together with options.
        TypeError: an option :class:`lowbit.fsdp.FSDPConfig` does not have.
    """

    def __init__(self, previous: Optional[Callable[..., Any]] = None, *,
                 config: Optional[lowbit.fsdp.FSDPConfig] = None, **options: Any) -> None:
        self.previous = previous
        self.config = lowbit.fsdp.FSDPConfig.of(config, **options)  # checked now, not at step 0
        self.states: list[Optional[lowbit.fsdp.FSDPState]] = []

    def __call__(self, optimizers: Any, model_parts: list[Any], parallel_dims: Any, *args: Any,
                 **kwargs: Any) -> Any:
        out = self.previous(optimizers, model_parts, parallel_dims, *args, **kwargs) if self.previous else None
        if self.states:
            raise ValueError("lowbit.integrations.torchtitan: this post_optimizer_build_fn already registered its "
                             "model parts; build one with_lowbit spec per training run")
        for part in model_parts:
            if is_fsdp(part):
                self.states.append(lowbit.fsdp.register(part, config=self.config))
            else:
                self.states.append(None)
                warn_uncompressed(f"torchtitan's model part {type(part).__name__} is not sharded with fully_shard "
                                  f"({_dims(parallel_dims)}): lowbit serves FSDP2 only; set "
                                  "parallelism.data_parallel_shard_degree to the data-parallel ranks")
        return out


def _dims(parallel_dims: Any) -> str:
    names = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    found = [f"{n}={getattr(parallel_dims, n)}" for n in names if hasattr(parallel_dims, n)]
    return ", ".join(found) or "parallel_dims unknown"


def with_lowbit(model_spec: Any, *, config: Optional[lowbit.fsdp.FSDPConfig] = None, **options: Any) -> Any:
    """A copy of torchtitan's ``model_spec`` whose ``post_optimizer_build_fn`` also registers lowbit
    (:class:`LowbitPostBuild`; the copy's ``post_optimizer_build_fn.states`` holds the states).

    Args:
        model_spec: a torchtitan ``ModelSpec`` (a dataclass with a ``post_optimizer_build_fn`` field).
        config: a :class:`lowbit.fsdp.FSDPConfig`, instead of ``**options``.
        **options: :func:`lowbit.fsdp.register`'s options, keyword-only.

    Returns:
        The new spec (``model_spec`` itself is left as it was).

    Raises:
        ValueError: ``model_spec`` has no ``post_optimizer_build_fn`` field; an option out of range.
        TypeError: an option :class:`lowbit.fsdp.FSDPConfig` does not have.
    """
    fields = {f.name for f in dataclasses.fields(model_spec)} if dataclasses.is_dataclass(model_spec) else set()
    if "post_optimizer_build_fn" not in fields:
        raise ValueError("lowbit.integrations.torchtitan.with_lowbit expects a torchtitan ModelSpec (a dataclass "
                         f"with a post_optimizer_build_fn field), got {type(model_spec).__name__}")
    previous = model_spec.post_optimizer_build_fn
    if isinstance(previous, LowbitPostBuild):
        raise ValueError("lowbit.integrations.torchtitan.with_lowbit: this spec already has lowbit's hook")
    hook = LowbitPostBuild(previous, config=config, **options)
    return dataclasses.replace(model_spec, post_optimizer_build_fn=hook)

