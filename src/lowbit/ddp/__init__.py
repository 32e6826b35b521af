"""DDP integration: one line turns a DDP script's gradient allreduce into a low-precision one.

    model = DDP(model)
    state = lowbit.ddp.register(model, codec="qsgd:bits=4")        # the one-line change

or, with the raw pieces, ``model.register_comm_hook(lowbit.ddp.make_state(model.module, ...), lowbit.ddp.hook)``.
How to use it, what each option does and when it pays: docs/ddp.md (the tuning guide).

How the package is organised:

* this module: :func:`register` and :func:`make_state`, which build the options, check that the ranks
  agree on them (:mod:`lowbit.comm.agreement`) before anything is created, and make the state;
* :mod:`lowbit.ddp.config`: :class:`DDPConfig`, every option, frozen and validated once;
* :mod:`lowbit.ddp.state`: :class:`LowbitState`, the hook's state (``codec="auto"``'s tuner from
  :mod:`lowbit.auto`, the statistics, the residuals and their checkpoint, :mod:`lowbit.feedback`'s);
* :mod:`lowbit.ddp.messages`: the message groups (consecutive tensors of one codec, a staging buffer and
  a flat residual each, planned from :func:`lowbit.timeline.plan_step`) and how a DDP bucket maps onto them;
* :mod:`lowbit.ddp.hooking`: :func:`hook`, DDP's comm hook, and the hook thread that issues the groups'
  collectives (:mod:`lowbit.comm`) in DDP's call order on a process group of its own.
"""

import logging
from typing import Any, List, Optional, Tuple, Union

import torch.distributed as dist
from torch import nn

from lowbit.auto.ddp_tuner import AutoTuner
from lowbit.choose import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_bucket_caps, message_limit
from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.agreement import ConfigMismatchError, agree, fingerprint
from lowbit.comm.registration import (LAUNCH_HINT, refuse_second_register, remember_register, warn_once,  # noqa: F401
                                      warn_uncompressed)
from lowbit.kernels.dispatch import warm_up_for

from lowbit.ddp.config import DDPConfig, _FP32, _is_flag, _is_int  # noqa: F401
from lowbit.ddp.messages import (_Group, _Layout, _Unit, _copy_all, _plan_groups,  # noqa: F401
                                 _remember, _ON_SIDE_STREAM)
from lowbit.ddp.state import LowbitState, _Option  # noqa: F401
from lowbit.ddp.hooking import _HOOK_THREAD, _HookThread, _bucket_capturing, _issue, _issue_bucket, hook  # noqa: F401

__all__ = ["DDPConfig", "LowbitState", "hook", "make_state", "register", "ConfigMismatchError", "message_limit"]

log = logging.getLogger(__name__)


def _check_same_config(state: Union[LowbitState, ValueError], group: Optional[dist.ProcessGroup],
                       thread_group: bool = False) -> None:
    """Every rank compares everything that shapes the messages: the configuration (:meth:`LowbitState.config`),
    DDP's bucket caps (message groups close where DDP's buckets end) and whether the hook thread gets a
    process group of its own (a collective ``new_group``); all raise the same error on a mismatch (no hang,
    no gloo abort). A rank whose options were refused passes its ``ValueError`` instead of a state and
    takes part all the same, so that every rank raises at once (:func:`lowbit.comm.agreement.agree`)."""
    mine: Any = state
    if isinstance(state, LowbitState):
        mine = [state.config(), {"bucket_bytes": state.bucket_bytes, "first_bucket_bytes": state.first_bucket_bytes,
                                 "hook_thread_group": thread_group}]
    agree(mine, group, "lowbit: ranks registered different compression settings:", _describe_config)


def _describe_config(settings: List[Any]) -> str:
    """One rank's line of a :class:`ConfigMismatchError` (``settings``: what :func:`_check_same_config`
    compares)."""
    cfg, ext = settings
    plan = cfg["plan"]
    return (f"fingerprint {fingerprint(settings)}, algorithm {cfg['algorithm']}, "
            f"error_feedback {cfg['error_feedback']}, message_mb {cfg['message_mb']}, "
            f"codecs {sorted(set(plan.values()))}, {len(plan)} parameters, "
            f"bucket caps {ext['first_bucket_bytes']:.0f}/{ext['bucket_bytes']:.0f} bytes, "
            f"hook thread group {ext['hook_thread_group']}")


def make_state(module: nn.Module, codec: Union[str, Codec, None] = None, *,
               process_group: Optional[dist.ProcessGroup] = None, config: Optional[DDPConfig] = None,
               **options: Any) -> LowbitState:
    """Build the hook's state for ``module`` (the model *inside* DDP) without registering it.

    For frameworks that register the hook themselves, e.g. PyTorch Lightning::

        state = lowbit.ddp.make_state(lightning_module, codec="qsgd:bits=4")
        Trainer(strategy=DDPStrategy(ddp_comm_state=state, ddp_comm_hook=lowbit.ddp.hook))

    Where the hook thread may run (``hook_thread`` True, or "auto" with the module on CUDA) and
    torch.distributed is initialised, it creates the thread's own process group: then every rank of
    ``process_group`` must call it, in the same order as their other ``new_group`` calls.

    Args:
        module: the model inside DDP (``ddp_model.module``): its trainable parameters are planned.
        codec: :class:`DDPConfig`'s ``codec``, the one option that may be passed by position.
        process_group: the group the gradients are reduced over (default: the world).
        config: a :class:`DDPConfig`, instead of ``**options``.
        **options: :class:`DDPConfig`'s options (``policy``, ``algorithm``, ``error_feedback``, ...).

    Returns:
        The :class:`LowbitState` to register with ``lowbit.ddp.hook``.

    Raises:
        ValueError: an option out of range or that does not fit the others (the message names it), or
            ``config`` together with options.
        TypeError: an option :class:`DDPConfig` does not have.
    """
    if codec is not None:
        options["codec"] = codec
    state = _state_for(module, DDPConfig.of(config, **options), process_group)
    state.open_thread_group(module)
    return state


def _state_for(module: nn.Module, options: DDPConfig, process_group: Optional[dist.ProcessGroup],
               bucket_caps: Tuple[float, float] = (DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES)) -> LowbitState:
    """The state of ``options`` for ``module``'s trainable parameters (``bucket_caps``: DDP's first and
    other buckets' caps in bytes); with ``codec="auto"``, its tuner watching ``module``. A framework's hook
    (registered for the state) reduces in fp32 until the tuner decides."""
    tuner = None
    if options.auto:
        tuner = AutoTuner(options.allow, options.error_budget, options.measure_steps, options.remeasure_every,
                          level=options.auto_level, guard_every=options.guard_every)
    named = list(module.named_parameters())
    state = LowbitState(options, options.resolved_policy().resolve(module),
                        {id(p): name for name, p in named if p.requires_grad}, process_group=process_group,
                        shapes={name: tuple(p.shape) for name, p in named},
                        devices={name: p.device for name, p in named},
                        first_bucket_bytes=bucket_caps[0], bucket_bytes=bucket_caps[1], auto=tuner)
    if tuner is not None:
        tuner.attach(module, state)
    return state


def register(ddp_model: nn.Module, *, process_group: Optional[dist.ProcessGroup] = None,
             config: Optional[DDPConfig] = None, **options: Any) -> LowbitState:
    """Install lowbit's comm hook on ``ddp_model`` and return its state.

    Collective: every rank must call it, and a configuration that differs across ranks raises
    :class:`ConfigMismatchError` on every rank (no hang), and so do options refused on some ranks only (a
    typo in one rank's codec): on those ranks it is chained from their ``ValueError``.
    ``algorithm="hierarchical"`` with the whole group in one node (``state.one_node``) installs no hook
    (with a warning): nothing would be compressed, and DDP's own allreduce is the fastest fp32 mean;
    ``one_node_native=False`` installs it anyway (one fp32 allreduce per bucket, counted in
    ``state.stats``, as the study does to measure it). With ``codec="auto"`` DDP's own allreduce runs
    while the first steps are measured, and the hook is installed once the decision compresses
    something (:mod:`lowbit.auto`; the decision is on ``state.auto.decision``).

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` model.
        process_group: the group to reduce over (default: the DDP model's).
        config: a :class:`DDPConfig`, instead of ``**options``.
        **options: :class:`DDPConfig`'s options, keyword-only:

            * ``codec``: the policy's default codec (a spec such as ``"qsgd:bits=4"``, a Codec, or
              ``"auto"``: measured, then chosen per tensor among ``allow``; default ``qsgd:bits=8,bucket=512``).
            * ``policy``: a :class:`lowbit.Policy` (or spec) deciding per tensor (not with ``codec``).
            * ``algorithm``: ``"auto"`` (default), ``"allgather"``, ``"scatter_gather"``, ``"hierarchical"``,
              or an algorithm that sums on the wire (``"allreduce"``, fp32/fp16/bf16 only).
            * ``error_feedback``: True, False or ``"auto"`` (default: on for biased codecs).
            * ``start_iter`` (2), ``seed`` (0), ``message_mb`` (``"auto"``), ``node_size`` (None: from the
              environment), ``hook_thread`` (``"auto"``: on for CUDA), ``one_node_native`` (True).
            * with ``codec="auto"`` only: ``allow``, ``error_budget`` (1.0), ``auto_level``
              (``"conservative"`` or ``"bold"``), ``guard_every`` (50; 0: no guard), ``measure_steps`` (3),
              ``remeasure_every`` (0).

            The module docstring is the tuning guide for each.

    Returns:
        The :class:`LowbitState`: statistics (``state.stats``), checkpoints (``state_dict()``), the auto
        tuner (``state.auto``).

    Raises:
        ValueError: ``ddp_model`` is not a DDP model, an option is out of range or does not fit the
            others (the message names it), or ``config`` comes with options.
        ConfigMismatchError: the ranks' settings differ, or some ranks' options were refused.
        TypeError: an option :class:`DDPConfig` does not have.
    """
    module = getattr(ddp_model, "module", None)
    if module is None or not hasattr(ddp_model, "register_comm_hook"):
        raise ValueError("lowbit.ddp.register expects a torch.nn.parallel.DistributedDataParallel model")
    group = process_group if process_group is not None else getattr(ddp_model, "process_group", None)
    try:
        cfg = DDPConfig.of(config, **options)
        refuse_second_register(ddp_model, "lowbit.ddp.register")
        state = _state_for(module, cfg, group, ddp_bucket_caps(ddp_model))
        warm_up_for([*state.plan.values(), *map(get_codec, state.auto.allow if state.auto else ())], module.parameters())
    except ValueError as exc:  # refused here: still compare, so that the other ranks raise now, not at a timeout
        _check_same_config(exc, group)
        raise
    _check_same_config(state, group, state.wants_thread_group(module))
    state.open_thread_group(module)  # after the check: a rank that made it alone would wait in new_group
    remember_register(ddp_model, state, f"codec {cfg.codec!r}" if cfg.codec is not None
                      else f"policy {cfg.resolved_policy().describe()}")
    size = C.world(group)[1]
    if size == 1:
        warn_uncompressed(f"the process group has 1 rank, so no gradient is exchanged (the hook is installed "
                          f"but sends nothing); {LAUNCH_HINT}", group)
    one_node = (f"algorithm='hierarchical' with all {size} ranks in one node (node_size={state.node_size}): "
                "nothing crosses nodes, so DDP's own fp32 allreduce stays and no hook is installed")
    if state.auto is not None:
        # codec="auto": DDP's own allreduce runs while the first steps are measured; lowbit's hook is
        # registered only once the decision compresses something.
        if cfg.one_node_native and state.one_node:
            state.auto.detach()  # nothing crosses nodes: DDP's allreduce stays, as for any codec
            warn_uncompressed(one_node, group)
        else:
            state.auto.attach(module, state, install=lambda: ddp_model.register_comm_hook(state, hook))
        return state
    if cfg.one_node_native and state.one_node:
        # hierarchical inside one node compresses nothing: leave DDP's own C++ allreduce in place, which no
        # Python hook can match (state.stats then counts nothing).
        warn_uncompressed(one_node, group)
        return state
    ddp_model.register_comm_hook(state, hook)
    return state
