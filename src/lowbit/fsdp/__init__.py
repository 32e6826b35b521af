"""FSDP2 with low-bit gradient reduce-scatter and parameter all-gather.

    for block in model.blocks:
        fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
    state = lowbit.fsdp.register(model, codec="qsgd:bits=8", param_codec="qsgd:bits=8,rounding=nearest")

FSDP2 (``torch.distributed.fsdp.fully_shard``) moves about three times a model's bytes a step: the
parameters are all-gathered before the forward and again before the backward, and the gradients are
reduce-scattered after it. :func:`register` plugs lowbit into both through FSDP2's public extension
points, ``FSDPModule.set_custom_reduce_scatter`` and ``set_custom_all_gather`` (torch >= 2.9); nothing
of FSDP is patched.

Communication plan of one FSDP module (a parameter group; K ranks; FSDP hands us a flat buffer whose
row r (of S values) holds, for every parameter of the group, the padded chunk that rank r owns):

``reduce_scatter`` (gradients, ``codec``)
    Phase 1: for every other rank i, encode row i (worker error feedback when asked) and send it to
             rank i (one ``all_to_all_single`` of packed bytes). My own row never crosses the wire and
             stays exact.
    Phase 2: decode the K-1 rows I received, sum them in rank order in float32, add my own row, apply
             FSDP's reduction (SUM, AVG or PREMUL_SUM's factor, also in float32) and write my shard in
             FSDP's reduce dtype. Bytes sent per rank: (K-1) payloads of S values.

``all_gather`` (parameters, ``param_codec``)
    Encode my shard once, all-gather the payloads, every rank decodes all K of them in rank order into
    the unsharded buffer (my own shard too), so the unsharded parameters are bit-identical on every
    rank while the sharded (master) parameters keep full precision. The encoding of a shard is
    deterministic (a fixed seed per module and rank): the backward's re-gather sees the same weights as
    the forward did. Bytes sent per rank: (K-1) payloads of S values.

Several nodes (``node_size`` ranks per node, or torchrun's ``LOCAL_WORLD_SIZE``, K = N nodes x L):
only what crosses nodes is compressed. The reduce-scatter first sums each node's rows natively
(a reduce-scatter inside the node, in the reduce dtype), then runs phase 1-2 among the N ranks of the
same local index; the all-gather runs compressed among those N ranks first, then natively inside the
node. HSDP (replicate x shard): shard with ``fully_shard`` on the inner (node) mesh and pass
``replicate_group=``; lowbit all-reduces the reduced shards across it (compressed, bit-identical on
every replica) through FSDP's ``set_all_reduce_hook``.

``codec="auto"`` (:mod:`lowbit.auto.fsdp_tuner`): each module's reduce-scatter starts as FSDP's own (the
custom reduce-scatter calls ``reduce_scatter_tensor`` in FSDP's reduce dtype and op) and takes, per module,
whatever the first steps measure to pay: a codec within the level's error limit, or FSDP's own.

Policy: parameters that the policy keeps in fp32 (by default the seed's rule: 1-D tensors and tensors
below 10,000 values, such as norms and biases) ride exactly in the same message (float32 for
gradients, the parameter dtype for parameters); every other parameter of a group takes the group's
codec.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowbit.auto.fsdp_tuner import NATIVE, FSDPAuto
from lowbit.auto.options import AutoOptions, FSDP_WORDS
from lowbit.codecs.base import Codec, get_codec
from lowbit.comm.agreement import agree
from lowbit.comm.allreduce import CommStats, all_reduce
from lowbit.comm.hierarchical import node_size_for
from lowbit.comm.registration import LAUNCH_HINT, refuse_second_register, remember_register, warn_once, warn_uncompressed
from lowbit.feedback import ErrorFeedback
from lowbit.kernels.dispatch import warm_up_for
from lowbit.comm.framing import _slot  # noqa: F401  (tests read it here)
from lowbit.fsdp.hooks import (LowbitAllGather, LowbitReduceScatter, _Groups, _make_groups, _op_scale,  # noqa: F401
                               _row_layout, _seed)
from lowbit.fsdp.state import FSDPState
from lowbit.policy import Policy

__all__ = ["FSDPConfig", "FSDPState", "LowbitReduceScatter", "LowbitAllGather", "register", "MIN_TORCH"]

log = logging.getLogger("lowbit.fsdp")

#: The first torch release whose FSDP2 has ``set_custom_reduce_scatter`` / ``set_custom_all_gather``.
MIN_TORCH = "2.9"


def _fsdp_api() -> tuple[type, Any]:
    """FSDP2's module class and fully_shard, with a clear error on a torch without the extension points."""
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError as e:  # pragma: no cover - torch < 2.6
        raise RuntimeError(f"lowbit.fsdp needs FSDP2 (torch >= {MIN_TORCH}); this torch is {torch.__version__}") from e
    if not (hasattr(FSDPModule, "set_custom_reduce_scatter") and hasattr(FSDPModule, "set_custom_all_gather")):
        raise RuntimeError(f"lowbit.fsdp needs FSDPModule.set_custom_reduce_scatter / set_custom_all_gather "
                           f"(torch >= {MIN_TORCH}); this torch is {torch.__version__}")
    return FSDPModule, fully_shard


# ------------------------------------------------------------------------------------------ register
def _managed_params(module: nn.Module, fsdp_cls: type) -> list[tuple[str, nn.Parameter]]:
    """The parameters FSDP2 puts in ``module``'s group, in its order: modules in post-order, not
    entering other ``fully_shard`` modules, each module's own parameters, shared ones once. (FSDP2's
    ``_get_managed_modules`` / ``_get_managed_states``; tests/distributed/test_fsdp.py checks this order
    against FSDP's own list, so a change in torch fails a test instead of silently mislabelling.)"""
    seen_mod: set[int] = set()
    order: list[tuple[str, nn.Module]] = []

    def dfs(prefix: str, m: nn.Module) -> None:
        seen_mod.add(id(m))
        for name, child in m.named_children():
            if id(child) in seen_mod or isinstance(child, fsdp_cls):
                continue
            dfs(f"{prefix}{name}.", child)
        order.append((prefix, m))

    dfs("", module)
    out, seen = [], set()
    for prefix, m in order:
        for name, p in m.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + name, p))
    return out


def _padded_chunk(p: torch.Tensor, k: int) -> int:
    """Values of one rank's padded chunk of ``p`` (sharded on dim 0 over k ranks)."""
    shape = tuple(p.shape)
    if not shape:
        return 1
    return -(-shape[0] // k) * math.prod(shape[1:])


def _check_codec(spec: Codec | str, what: str) -> Codec:
    if not isinstance(spec, (str, Codec)):
        raise ValueError(f"lowbit.fsdp.register: {what} must be a codec spec such as 'qsgd:bits=8' or a Codec, got {spec!r}")
    codec = get_codec(spec) if isinstance(spec, str) else spec
    if codec.per_tensor:
        raise ValueError(f"lowbit.fsdp.register: {what} {codec.spec} keeps one scale per tensor or column, but FSDP "
                         "sends chunks of flattened parameters; use a bucketed codec (e.g. onebit:bucket=512, "
                         "dettmers:bucket=4096)")
    return codec


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDPConfig(AutoOptions):
    """Every option of :func:`register`, validated once (here, at construction; a ``ValueError`` names the
    option at fault) and frozen: the one list of them. ``register(model, codec=...)`` builds one from its
    keywords (``FSDPConfig.of(config, **options)``), or takes one as ``config=``.

    ``codec``: the gradients' codec (any lowbit codec with buckets: QSGD 1-8/16 bits, ``onebit:bucket=N``,
    Dettmers with buckets, ``fp16`` / ``bf16`` on the wire with float32 sums, ``fp32``), or ``"auto"``
    (:mod:`lowbit.auto.fsdp_tuner`). ``param_codec``: the parameters' all-gather codec (None: FSDP's own).
    ``error_feedback``: residuals of the gradient codec's error: ``"auto"`` (default, as DDP's) on for
    biased codecs (``codec.biased``: 1bitSGD*, top-k), True, or False. ``node_size``: ranks per node (None: from
    the environment). ``policy``: a :class:`lowbit.Policy` (or a spec) deciding per parameter which ride
    exactly. ``codec="auto"``'s options (``auto_level``, ``guard_every``, ``allow``, ``error_budget``) are
    :class:`lowbit.auto.options.AutoOptions`', shared with DDP; here the budget multiplies each module's 8-bit
    QSGD error, and FSDP's own reduce-scatter (``"native"``) is always allowed.
    """

    codec: Codec | str = "qsgd:bits=8"
    param_codec: Codec | str | None = None
    error_feedback: bool | str = "auto"
    node_size: int | None = None
    policy: Policy | str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()

    @property
    def auto(self) -> bool:
        """``codec="auto"``: each module's gradient exchange chosen by measurement (:mod:`lowbit.auto.fsdp_tuner`)."""
        return isinstance(self.codec, str) and self.codec == "auto"

    def gradient_codec(self) -> Codec | None:
        """The gradients' codec (None with ``codec="auto"``)."""
        return None if self.auto else _check_codec(self.codec, "codec")

    def parameter_codec(self) -> Codec | None:
        """The parameters' codec (None: FSDP's own all-gather)."""
        return None if self.param_codec is None else _check_codec(self.param_codec, "param_codec")

    def resolved_policy(self) -> Policy | None:
        return None if self.policy is None else Policy.coerce(self.policy)

    def uses_feedback(self) -> bool:
        """Whether the gradient codec keeps error-feedback residuals: ``"auto"`` for a biased codec (with
        ``codec="auto"``: none here; the tuner turns them on for the biased codecs it may choose)."""
        if self.error_feedback == "auto":
            codec = self.gradient_codec()
            return codec is not None and codec.biased
        return bool(self.error_feedback)

    def validate(self) -> None:
        """Raise a ``ValueError`` naming the first option that is out of range or does not fit the others."""
        if not isinstance(self.error_feedback, bool) and self.error_feedback != "auto":
            raise ValueError(f"lowbit.fsdp.register: error_feedback must be True, False or 'auto', got "
                             f"{self.error_feedback!r}")
        try:
            self.check_auto(self.auto, self.codec, **FSDP_WORDS)
        except ValueError as e:
            raise ValueError(f"lowbit.fsdp.register: {e}") from None
        for c in (self.allow or ()) if self.auto else ():
            if c != NATIVE:
                try:
                    _check_codec(c, "allow's codec")  # a spec, known, with its own buckets
                except ValueError as e:
                    msg = str(e) if str(e).startswith("lowbit.fsdp") else f"lowbit.fsdp.register: allow: {e}"
                    raise ValueError(msg) from None
        if self.auto and self.error_feedback is True:
            raise ValueError("lowbit.fsdp.register: codec='auto' turns error feedback on for the biased codecs it "
                             "chooses (1bitSGD* at auto_level='bold'); leave error_feedback off")
        grad_codec = self.gradient_codec()
        self.parameter_codec()
        if self.error_feedback is True and grad_codec is not None and grad_codec.sums_on_wire:
            raise ValueError(f"lowbit.fsdp.register: {grad_codec.spec} is lossless up to a cast; it takes no error feedback")
        if self.node_size is not None and (isinstance(self.node_size, bool) or not isinstance(self.node_size, int)
                                           or self.node_size < 1):
            raise ValueError(f"lowbit.fsdp.register: node_size must be a positive int (ranks per node), "
                             f"got {self.node_size!r}")
        pol = self.resolved_policy()
        if self.auto and pol is not None:
            lossy = {**{f"by_type {k!r}": v for k, v in pol.by_type.items()},
                     **{f"by_name {k!r}": v for k, v in pol.by_name.items()}}
            lossy = {k: v for k, v in lossy.items() if v != "fp32"}
            if pol.default not in (Policy().default, "fp32"):
                lossy["default"] = pol.default
            if lossy:
                raise ValueError(f"lowbit.fsdp.register: with codec='auto' a policy only keeps parameters exact (fp32); "
                                 f"auto chooses the codecs, so this policy's {lossy} would be ignored: name them in "
                                 "allow=, or give a fixed codec")


def register(model: nn.Module, *, replicate_group: dist.ProcessGroup | None = None,
             config: FSDPConfig | None = None, **options: Any) -> FSDPState:
    """Make every ``fully_shard`` module of ``model`` reduce-scatter gradients in ``codec`` and (with
    ``param_codec``) all-gather parameters in ``param_codec``. Call it on every rank, after
    ``fully_shard`` and before the first forward.

    ``param_codec``: a deterministic codec (``qsgd:bits=8,rounding=nearest``) is recommended for weights:
    stochastic rounding adds noise to every forward without anything to average it out. Error feedback
    keeps its residuals per rank on the *unsharded* gradient (4 bytes per parameter value of the whole
    model on every rank; ``state_dict()`` saves them). Parameters the policy keeps in fp32 ride exactly
    (default: the seed's rule, 1-D tensors and tensors below 10,000 values). ``codec="auto"``
    (:mod:`lowbit.auto.fsdp_tuner`): each module's gradient exchange, FSDP's own or a codec, chosen by measured
    error and measured step time on the first steps, its guard fed by ``state.auto.report_loss(loss)``.

    Collective: ranks that disagree on any of this get the same :class:`lowbit.ddp.ConfigMismatchError`,
    and so do options refused on some ranks only (a typo in one rank's codec): on those ranks it is
    chained from their ``ValueError`` (options refused alike on every rank raise that ``ValueError``).

    Args:
        model: the model, after ``fully_shard`` on its blocks and on itself (a 1-D mesh).
        replicate_group: HSDP, the group across which the shards are replicated: their reduced gradients
            are all-reduced across it in ``codec``, and the parameters are broadcast from its first rank
            now. Not with ``codec="auto"``.
        config: an :class:`FSDPConfig`, instead of ``**options``.
        **options: :class:`FSDPConfig`'s options, keyword-only:

            * ``codec``: the gradients' codec (default ``"qsgd:bits=8"``), or ``"auto"``.
            * ``param_codec``: the parameters' codec (default None: FSDP's own all-gather).
            * ``error_feedback``: ``"auto"`` (default: on for biased codecs, as in DDP), True or False (not
              True with ``codec="auto"``, which turns it on for the biased codecs it chooses).
            * ``node_size``: ranks per node (default ``$LOWBIT_NODE_SIZE`` or torchrun's
              ``LOCAL_WORLD_SIZE`` when they split the group into nodes): compress only between nodes.
            * ``policy``: a :class:`lowbit.Policy` (or a spec) deciding per parameter.
            * with ``codec="auto"`` only: ``auto_level`` (``"conservative"``: bf16, 8-bit QSGD; ``"bold"``:
              also 4-bit QSGD and 1bitSGD*), ``guard_every`` (50; 0: no guard), ``allow`` (the codecs to
              choose among; ``"native"`` is always allowed), ``error_budget`` (1.0: a codec is admitted for
              a module when its error is at most this times 8-bit QSGD's there; None: no limit).

    Returns:
        The :class:`FSDPState`: statistics, error-feedback residuals and checkpoints (``state_dict()``),
        the auto tuner (``state.auto``).

    Raises:
        ValueError: an option out of range or that does not fit the others (the message names it), a
            model that is not sharded with ``fully_shard`` on a 1-D mesh.
        lowbit.ddp.ConfigMismatchError: the ranks' settings differ, or some ranks' options were refused.
        TypeError: an option :class:`FSDPConfig` does not have.
    """
    FSDPModule, _ = _fsdp_api()
    try:  # every option checked here; a rank refused still compares (below), so no peer waits for it
        if not isinstance(model, nn.Module):
            raise ValueError(f"lowbit.fsdp.register expects an nn.Module, got {type(model).__name__}")
        cfg = FSDPConfig.of(config, **options)
        refuse_second_register(model, "lowbit.fsdp.register")
        if cfg.auto and replicate_group is not None:
            raise ValueError("lowbit.fsdp.register: codec='auto' does not run under HSDP (replicate_group=); "
                             "give a codec")
        tuner = FSDPAuto(cfg.auto_level, cfg.guard_every, cfg.allow, cfg.error_budget) if cfg.auto else None
        grad_codec, p_codec, pol = cfg.gradient_codec(), cfg.parameter_codec(), cfg.resolved_policy()
        error_feedback, node_size = cfg.uses_feedback(), cfg.node_size
        modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        if not modules and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("lowbit.fsdp.register: the model is a DistributedDataParallel, not sharded with "
                             "fully_shard (Accelerate builds one on CPU even with an FSDP plugin): register it with "
                             "lowbit.ddp.register, or with lowbit.integrations.accelerate.register, which serves both")
        if not modules:
            raise ValueError("lowbit.fsdp.register: the model has no fully_shard module; call "
                             "torch.distributed.fsdp.fully_shard(...) on its blocks and on the model first")
        rule = pol if pol is not None else Policy()  # the seed's size rule decides what stays exact

        for _, m in modules:
            m.reshard()  # after a forward the root keeps its parameters unsharded: back to DTensors
        params = [p for _, m in modules for p in m.parameters()]
        mesh = getattr(params[0], "device_mesh", None) if params else None
        if mesh is None:
            raise ValueError("lowbit.fsdp.register: the model's parameters are not DTensors; call fully_shard first")
        if mesh.ndim != 1:
            raise ValueError("lowbit.fsdp.register: this model was sharded on a 2-D (HSDP) mesh, whose replicate "
                             "all-reduce FSDP2 runs itself with no extension point; shard on the inner (shard) "
                             "mesh with fully_shard and pass replicate_group= (the outer dimension's group) instead")
        group = mesh.get_group()
        rank, k = group.rank(), group.size()
        ns = k  # one node, unless told otherwise (HSDP: the shard group is a node)
        if node_size is not None or replicate_group is None:
            try:
                ns = node_size_for(group, node_size)
            except ValueError:
                if node_size is not None:
                    raise  # (nothing set at all: one node, as above)
        ns_eff = ns if ns < k else None
        local0 = params[0].to_local() if hasattr(params[0], "to_local") else params[0]
        state = FSDPState(grad_codec, p_codec, error_feedback, pol, ns_eff, replicate_group, rank, k, local0.device)
        warm_up_for([grad_codec, p_codec, *map(get_codec, tuner.allow if tuner else ())], params)  # before any step
        if tuner is not None:
            state.auto = tuner
            biased = [spec for spec in tuner.allow if get_codec(spec).biased]  # (1bitSGD* at the bold level)
            state.feedback = ErrorFeedback(biased[0]) if biased else None

        resolved = rule.resolve(model)
        plans = []
        for index, (name, m) in enumerate(modules):
            owned = _managed_params(m, FSDPModule)
            sizes = [_padded_chunk(p, k) for _, p in owned]
            prefix = f"{name}." if name else ""
            exact = []
            for pname, _ in owned:
                c = resolved.get(prefix + pname, grad_codec)
                exact.append(c is not None and c.spec == "fp32")  # the policy keeps it in full precision
                if not exact[-1] and pol is not None and grad_codec is not None and c.spec != grad_codec.spec:
                    raise ValueError(f"lowbit.fsdp.register: the policy gives {prefix + pname} {c.spec}, but an FSDP "
                                     f"module's rows cross in one codec ({grad_codec.spec}) with the parameters the "
                                     "policy keeps in fp32 patched exactly; give the parameter's module its own "
                                     "fully_shard and register it apart, or keep it fp32")
            label = name or "<root>"
            state.modules.append(f"{label}:{sum(sizes)}")
            plans.append((index, label, m, sizes, exact))
    except ValueError as exc:
        peers = _agreement_group(model, replicate_group, FSDPModule)
        if peers is not None:
            _check_same_config(exc, peers)
        raise
    # agree before anything collective is set up: ranks that differ (a node size, a codec) would hang there
    _check_same_config(state, group if replicate_group is None else None)
    remember_register(model, state, f"codec {state.config()['codec']!r}, param_codec {state.config()['param_codec']!r}")
    if k == 1 and (replicate_group is None or replicate_group.size() == 1):
        warn_uncompressed("the FSDP mesh's group has 1 rank, so no gradient or parameter is exchanged (lowbit's "
                          f"reduce-scatter and all-gather are installed but send nothing); {LAUNCH_HINT}", group)
    if p_codec is not None and p_codec.stochastic:
        warn_once(f"lowbit.fsdp: param_codec {p_codec.spec} rounds stochastically: a weight is drawn once per "
                  "forward, so the rounding noise enters every activation with nothing to average it out "
                  "(docs/fsdp.md); use a deterministic codec, rounding=nearest (e.g. "
                  "'qsgd:bits=8,bucket=512,rounding=nearest'), or bf16", group)
    grad_groups = _make_groups(group, ns_eff)
    param_groups = _make_groups(group, ns_eff) if p_codec is not None and ns_eff is not None else None
    # HSDP whose shard group is one node: FSDP's own reduce-scatter runs inside it (NVLink; compressing
    # there costs host time and saves nothing), and only the replicas' all-reduce, which crosses nodes,
    # takes the codec. With node_size splitting the shard group, its reduce-scatter is compressed between
    # those nodes as without HSDP.
    native_inside = replicate_group is not None and ns_eff is None
    exchanges = []
    for index, label, m, sizes, exact in plans:
        if not native_inside:
            rs = LowbitReduceScatter(state, label, index, sizes, exact, grad_codec, grad_groups)
            m.set_custom_reduce_scatter(rs)
            exchanges.append((label, k * sum(sizes), rs))
        if p_codec is not None:
            m.set_custom_all_gather(LowbitAllGather(state, label, index, sizes, exact, p_codec, param_groups))
    if state.feedback is not None:
        _declare_residuals(state, exchanges, plans, grad_groups.cross.size(), fixed=tuner is None,
                           replicate=replicate_group is not None)
    if tuner is not None:
        tuner.attach(model, group, local0.device, exchanges)
    if replicate_group is not None:
        _replicate(model, modules, state, replicate_group, count_calls=native_inside)
    return state


def _declare_residuals(state: FSDPState, exchanges: list[tuple[str, int, LowbitReduceScatter]],
                       plans: list[tuple[int, str, nn.Module, list[int], list[bool]]], n: int, fixed: bool,
                       replicate: bool) -> None:
    """What a checkpoint's residuals are checked against (:meth:`FSDPState.load_state_dict`). A fixed
    codec's residuals are made now (zeros), one per module that keeps error feedback: every checkpoint of
    this state then holds each of them, and one that lacks any is refused (the module would restart from
    zero). ``codec="auto"`` makes them when it chooses a biased codec: any module may hold one."""
    for label, _, rs in exchanges:
        if rs.ef or not fixed:
            state._feedback_ranks[label] = n
        if fixed:
            rs.residual(sum(rs.sizes), n, torch.float32, state.device)
    if replicate:
        state._replicate_numels.update({label: sum(sizes) for _, label, _, sizes, _ in plans})
    if fixed:
        state._required = tuple(state.feedback.residuals)


def _replicate(model: nn.Module, modules: list[tuple[str, nn.Module]], state: FSDPState,
               replicate_group: dist.ProcessGroup, count_calls: bool) -> None:
    """HSDP: every replica starts from the first replica's shards, and each module's reduced gradient
    shard is all-reduced (mean) across the replicas in the gradient codec (scatter_gather, bit-identical
    on every replica) by FSDP's post-reduce-scatter hook. ``count_calls``: FSDP's own reduce-scatter runs
    (it does not count the calls that key the codec's rounding noise), so the hook counts them."""
    src = dist.get_global_rank(replicate_group, 0)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            dist.broadcast(local, src=src, group=replicate_group)
    feedback = state.feedback  # one home for the residuals (keys of their own), saved with the rest

    for index, (name, m) in enumerate(modules):
        key = name or "<root>"

        def hook(grad: torch.Tensor, key: str = key) -> None:
            if count_calls:
                state.iter += 1
            before = CommStats()
            all_reduce(grad, state.codec, group=replicate_group, algorithm="scatter_gather", op="mean",
                       feedback=feedback, key=("replicate", key), seed=state.iter, stats=before)
            state.grad_stats.bytes_sent += before.bytes_sent
            state.grad_stats.bytes_inter += before.bytes_sent
            state.grad_stats.calls += before.calls

        m.set_all_reduce_hook(hook)


def _check_same_config(state: FSDPState | ValueError, group: dist.ProcessGroup | None) -> None:
    """Every rank compares its configuration; all raise the same error on a mismatch (no hang). A rank whose
    options were refused passes its ``ValueError`` instead and takes part all the same, so that every rank
    raises at once (:func:`lowbit.comm.agreement.agree`)."""
    agree(state.config() if isinstance(state, FSDPState) else state, group,
          "lowbit.fsdp: ranks registered different settings:")


def _agreement_group(model: Any, replicate_group: dist.ProcessGroup | None,
                     fsdp_cls: type) -> dist.ProcessGroup | None:
    """The group whose ranks compare their settings (as :func:`register` finds it, checking nothing else),
    for a rank whose options were refused; ``dist.group.WORLD`` under HSDP. None where there is none
    (torch.distributed not initialised, the model not sharded on a 1-D mesh): that rank raises alone."""
    if not (dist.is_available() and dist.is_initialized()) or not isinstance(model, nn.Module):
        return None
    if replicate_group is not None:
        return dist.group.WORLD
    modules = [m for m in model.modules() if isinstance(m, fsdp_cls)]
    for m in modules:
        m.reshard()  # (as register does: the root's parameters back to DTensors)
    params = [p for m in modules for p in m.parameters()]
    mesh = getattr(params[0], "device_mesh", None) if params else None
    return mesh.get_group() if mesh is not None and mesh.ndim == 1 else None
