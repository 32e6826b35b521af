"""DDP integration: one line turns a DDP script's gradient allreduce into a low-precision one.

    model = DDP(model)
    state = lowbit.ddp.register(model, codec="qsgd:bits=4")        # the one-line change

or, with the raw pieces, ``model.register_comm_hook(lowbit.ddp.make_state(model.module, ...), lowbit.ddp.hook)``.
The options live in one frozen :class:`DDPConfig` (validated once; ``register(model, *, config=None,
**options)`` and ``make_state`` build it from their keywords or take ``config=``), kept on ``state.options``.

How a step goes (per DDP bucket, as the backward pass makes it ready):

1. Once, lowbit splits the model's quantised parameters into *message groups* (consecutive tensors in
   reverse model order, one codec, up to ``message_mb`` of fp32; the fp32 tensors ride along with the
   ``allgather`` algorithm), each with a persistent staging buffer and one flat error-feedback residual.
   Groups depend on the model only, not on DDP's buckets. Per (rebuilt) DDP bucket it notes, once,
   which of the bucket's gradients go to which group; natively summed tensors (fp32 that does not
   ride, fp16, bf16) are reduced per bucket, in place where the bucket holds them together.
2. ``hook`` copies the bucket's gradients into their groups' staging buffers (one fused copy); a group
   whose last gradient has arrived adds its residual, encodes in one call and issues its collective:
   without waiting, in DDP's program order (``find_unused_parameters`` and the user's own collectives
   mix freely), and on CUDA the host never waits for the device. On CUDA this work runs on one
   *hook thread* per process (``hook_thread``): DDP calls the hook on the autograd thread, which also
   launches the backward pass's kernels, so every microsecond of Python there delays the backward
   pass; the hook only records an event and queues the bucket, and the hook thread, on a side stream
   that waits for that event, copies, encodes and issues the collectives in the order DDP called
   (FIFO: the same order on every rank), on a process group of its own (the same ranks, made by
   ``make_state``): collectives that the backward pass itself issues on the user's group
   (SyncBatchNorm, ``torch.distributed.nn``, a custom autograd function) cannot meet lowbit's in a
   different order on different ranks.
3. Decoding, the mean and the copy back into the bucket(s) run when the data has arrived: on CUDA on a
   pool stream that waits for the collective (the backward pass goes on), on CPU on lowbit's completion
   thread (not gloo's own, which the interpreter cannot join at exit: :mod:`lowbit.comm.threads`).
   DDP waits for each bucket's future (its groups' messages) before the optimizer step.

Tuning guide (:class:`DDPConfig`'s options):

* ``codec`` / ``policy`` — 8-bit QSGD (bucket 512) recovered full accuracy in every experiment of the
  seed; 4-bit usually does; 2-bit loses about a point on conv nets. onebit needs error feedback.
  ``codec="auto"`` measures and chooses per tensor (:mod:`lowbit.auto`): ``auto_level`` says how far
  it may go (``"conservative"``: within 8-bit QSGD's error; ``"bold"``: 4-bit QSGD and 1bitSGD* too, up to
  the gradients' sampling noise), ``guard_every`` how often its guard checks the choice while training.
* ``algorithm`` — ``auto`` (default): ``allgather`` for two ranks, ``scatter_gather`` above (it sends
  about 2(K-1)/K payloads per rank and scales; allgather sends (K-1)). ``hierarchical``: several
  machines — native fp32 inside each node, compressed only between nodes (``node_size`` ranks per
  node, default ``$LOWBIT_NODE_SIZE`` or torchrun's ``LOCAL_WORLD_SIZE``; :mod:`lowbit.comm.hierarchical`).
* ``error_feedback`` — ``"auto"`` (default) turns it on for biased codecs (``codec.biased``: onebit,
  topk, dettmers) and off for unbiased QSGD, whose large variance at few bits can feed on itself
  through the residual.
* ``message_mb`` — quantised gradients go out in *message groups*: consecutive parameters (in reverse
  model order, the order their gradients become ready) of one codec, up to this many MiB of fp32
  (0: one message per parameter tensor), plus the fp32 tensors that ride along. The default,
  ``"auto"``, closes a group where one of DDP's buckets ends (as DDP cuts the model: 1 MiB first, then
  its ``bucket_cap_mb``) once it holds the larger of 16 MiB and an eighth of the model's quantised
  gradients, and sends DDP's last bucket of the step alone: at most about eight messages a step, and
  what is left to send after the backward pass is only the last bucket (a group that reached into it
  would wait for it). A group is sent as soon as its last gradient has arrived. Each collective costs
  a fixed time, which a fast link or a small model cannot hide, and a compressed bucket is 4-32x
  smaller than DDP sized it for: fewer, larger messages pay, while the first messages still overlap
  the rest of the backward pass. Groups depend on the model and DDP's bucket cap only, not on DDP's
  actual (rebuilt) buckets, so results are the same before and after DDP's bucket rebuild, and a
  resumed run is bit-identical.
* ``start_iter`` — DDP rebuilds its buckets after the first iteration, so compression (and error
  feedback) starts at iteration 2 by default; before, the plain fp32 allreduce runs.
* ``hook_thread`` — ``"auto"`` (default): on for CUDA buckets, off on CPU (there the thread would
  compete with the backward pass for the same cores); ``True``/``False`` force it. Results are
  bit-identical either way; only where the host time is spent changes.
* ``state.stats`` counts calls and bytes sent; ``state.stats.timing = True`` adds the time per phase
  (on CUDA it synchronises the device around each phase: for profiling, not for speed).

Residuals live in one flat buffer per message group; ``state.residuals`` holds per-parameter views of
them, so they survive bucket rebuilds and checkpoints: ``state.state_dict()`` / ``load_state_dict()``
resume a run bit-identically. Residuals differ between ranks: save and load each rank's own. The update,
the rule for non-finite values and the residuals' checkpoint format are :mod:`lowbit.feedback`'s (the
collectives apply the first two; a step whose reduced result is not finite leaves every residual as it was).

No ``from __future__ import annotations`` here: DDP inspects the hook's annotations at registration.
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
                                 _remember, _ON_HOOK_THREAD)
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
