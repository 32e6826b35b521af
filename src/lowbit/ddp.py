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

import dataclasses
import hashlib
import json
import logging
import math
import os
import threading
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from lowbit.auto.ddp_tuner import AutoTuner
from lowbit.auto.options import AutoOptions, default_allow
from lowbit.choose import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, ddp_bucket_caps, choice, message_limit, split_choice
from lowbit.timeline import plan_step
from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm import flat, graphs
from lowbit.comm.agreement import ConfigMismatchError, agree, fingerprint
from lowbit.comm.allreduce import AUTO, CommStats, get_algorithm, resolve_algorithm, start
from lowbit.comm.registry import resolve_entry
from lowbit.comm.groups import new_subgroup
from lowbit.comm.registration import (LAUNCH_HINT, refuse_second_register, remember_register, warn_once,  # noqa: F401
                                      warn_uncompressed)
from lowbit.comm.threads import Worker
from lowbit.feedback import flat_residual, load_residuals, residuals_state
from lowbit.kernels.dispatch import warm_up_for
from lowbit.policy import Policy

__all__ = ["DDPConfig", "LowbitState", "hook", "make_state", "register", "ConfigMismatchError", "message_limit"]

_FP32 = get_codec("fp32")
log = logging.getLogger(__name__)


def _is_flag(value: Any) -> bool:
    """True, False or "auto" (not 1, 0 or "true": ranks compare their options as written)."""
    return isinstance(value, bool) or value == "auto"


def _is_int(value: Any, least: Optional[int] = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (least is None or value >= least)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPConfig(AutoOptions):
    """Every option of lowbit's DDP hook, validated once (here, at construction; a ``ValueError`` names
    the option at fault) and frozen: the one list of them. :func:`register` and :func:`make_state` build
    one from their keyword arguments (``DDPConfig.of(config, **options)``), or take one as ``config=``;
    the study and the Lightning / Accelerate integrations build one too. Five options take ``"auto"``: ``codec`` (measure, then choose per tensor among ``allow``),
    ``algorithm`` (per codec and world size: :func:`lowbit.comm.allreduce.resolve_algorithm`),
    ``error_feedback`` (on for biased codecs), ``message_mb`` (groups end where DDP's buckets end) and
    ``hook_thread`` (on for CUDA). The module docstring is the tuning guide.

    ``codec="auto"``'s options (:mod:`lowbit.auto`): ``allow``, ``error_budget``, ``auto_level`` and
    ``guard_every``, shared with FSDP (:class:`lowbit.auto.options.AutoOptions`), and DDP's own
    ``measure_steps`` and ``remeasure_every``; ``one_node_native`` goes with :func:`register` only.
    """

    codec: Union[str, Codec, None] = None
    policy: Union[Policy, str, None] = None
    algorithm: str = AUTO
    error_feedback: Union[bool, str] = "auto"
    start_iter: int = 2
    seed: int = 0
    message_mb: Union[float, str] = "auto"
    node_size: Optional[int] = None
    hook_thread: Union[bool, str] = "auto"
    one_node_native: bool = True
    measure_steps: int = 3
    remeasure_every: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate()

    @classmethod
    def auto_names(cls) -> Tuple[str, ...]:
        return (*super().auto_names(), "measure_steps", "remeasure_every")

    @property
    def auto(self) -> bool:
        """``codec="auto"``: the hook measures the job, then chooses per tensor (:mod:`lowbit.auto`)."""
        return isinstance(self.codec, str) and self.codec.strip().lower() == "auto"

    def resolved_policy(self) -> Policy:
        """The policy that assigns codecs to tensors (``codec="auto"``: fp32 everywhere until it decides)."""
        return Policy.coerce(self.policy, "fp32" if self.auto else self.codec)

    def policy_fingerprint(self) -> str:
        return "auto" if self.auto else self.resolved_policy().fingerprint()

    def uses_feedback(self, codec: Codec) -> bool:
        """Whether ``codec``'s tensors keep an error-feedback residual ("auto": biased codecs)."""
        if codec.sums_on_wire:
            return False
        if self.error_feedback == "auto":
            return codec.biased
        return bool(self.error_feedback)

    def validate(self) -> None:
        """Raise a ``ValueError`` naming the first option that is out of range or does not fit the others."""
        if self.codec is not None and self.policy is not None:
            raise ValueError("pass codec= or policy=, not both (a Policy carries its default codec)")
        if not isinstance(self.codec, (str, Codec, type(None))):
            raise ValueError(f"codec must be a codec spec (str), a Codec, 'auto' or None, got {self.codec!r}")
        if not isinstance(self.policy, (str, Codec, Policy, type(None))):
            raise ValueError(f"policy must be a lowbit.Policy, a codec spec or None, got {self.policy!r}")
        self.resolved_policy()  # an unknown codec: a ValueError with the list of known ones
        if not isinstance(self.algorithm, str):
            raise ValueError(f"algorithm must be a name (str), got {self.algorithm!r}")
        if self.algorithm != AUTO:
            get_algorithm(self.algorithm)  # a ValueError naming the known ones
        if not _is_flag(self.error_feedback):
            raise ValueError(f"error_feedback must be True, False or 'auto', got {self.error_feedback!r}")
        if not _is_flag(self.hook_thread):
            raise ValueError(f"hook_thread must be True, False or 'auto', got {self.hook_thread!r}")
        if not _is_int(self.start_iter, 0):
            raise ValueError(f"start_iter must be an int >= 0, got {self.start_iter!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.message_mb != "auto" and (isinstance(self.message_mb, bool) or
                                          not isinstance(self.message_mb, (int, float)) or not self.message_mb >= 0):
            raise ValueError("message_mb must be 'auto' or a number >= 0 (0: one message per parameter tensor, "
                             f"inf: one message), got {self.message_mb!r}")
        if self.node_size is not None and not _is_int(self.node_size, 1):
            raise ValueError(f"node_size must be a positive int (ranks per node), got {self.node_size!r}")
        if not isinstance(self.one_node_native, bool):
            raise ValueError(f"one_node_native must be True or False, got {self.one_node_native!r}")
        self.check_auto(self.auto, self.codec)  # (DDP's wording)
        if not self.auto:
            return
        allowed = [get_codec(s) for s in (self.allow if self.allow is not None else default_allow(self.auto_level))]
        if not _is_int(self.measure_steps, 1):
            raise ValueError(f"measure_steps must be an int >= 1, got {self.measure_steps!r}")
        if not _is_int(self.remeasure_every, 0):
            raise ValueError(f"remeasure_every must be an int >= 0 (0: never), got {self.remeasure_every!r}")
        quantised = [c.spec for c in allowed if not c.sums_on_wire]
        if self.algorithm != AUTO and not get_algorithm(self.algorithm).quantised and quantised:
            raise ValueError(f"algorithm {self.algorithm!r} sums on the wire, but codec='auto' may choose "
                             f"{quantised[0]}: allow only fp32/fp16/bf16, or use 'auto', 'scatter_gather', "
                             "'allgather' or 'hierarchical'")

    def check_plan(self, plan: Dict[str, Codec]) -> None:
        """The one check that needs the model: an algorithm that sums on the wire takes no quantised codec."""
        quantised = sorted({c.spec for c in plan.values() if not c.sums_on_wire})
        if self.algorithm != AUTO and not get_algorithm(self.algorithm).quantised and quantised:
            raise ValueError(f"algorithm {self.algorithm!r} sums on the wire (fp32/fp16/bf16 only), but the plan "
                             f"quantises with {quantised[0]}: use 'auto', 'scatter_gather', 'allgather' or "
                             "'hierarchical'")


class _Unit:
    """One native collective of a bucket's tensors summed on the wire (fp32 that does not ride in a
    message group, fp16, bf16): reduced in place where the bucket holds them together, else through a
    staging buffer. Natively summed codecs take no error feedback and no rounding seed."""

    def __init__(self, codec: Codec, views: List[torch.Tensor], inplace: Optional[torch.Tensor]) -> None:
        self.codec = codec
        if inplace is not None:
            # The bucket already holds these values in this order: work on it directly, no copies.
            self.stage = inplace
            self.src: List[torch.Tensor] = []
            self.dst: List[torch.Tensor] = []
        else:
            # staged in the wire's dtype (fp16/bf16: the copy in is the cast, the copy out the cast back;
            # the collective then reduces the staging buffer itself, as it already holds the wire's dtype)
            self.stage = torch.empty(sum(v.numel() for v in views), dtype=codec.wire_dtype, device=views[0].device)
            self.src = views
            pos, self.dst = 0, []
            for v in views:
                self.dst.append(self.stage[pos : pos + v.numel()])
                pos += v.numel()

    def gather(self) -> None:
        if self.src:
            _copy_all(self.dst, self.src)

    def finisher(self, buf: torch.Tensor):
        """The completion step: copy the reduced values back into the bucket (unless reduced in place)
        and hand DDP the bucket."""
        if not self.src:
            return lambda: buf

        def post() -> torch.Tensor:
            _copy_all(self.src, self.dst)
            return buf

        return post


def _copy_all(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
    if len(dst) == 1:
        dst[0].copy_(src[0])
    else:
        torch._foreach_copy_(dst, src)  # one fused launch (a few for big buckets) on CUDA; casts if need be


class _Group:
    """A fixed set of parameters sent as one message: one quantised codec's tensors, consecutive in
    reverse model order (the order their gradients become ready) up to ``message_mb``, plus (allgather)
    fp32 tensors riding raw. Groups depend on the model only, never on DDP's bucket layout, so the
    payloads, and so the results, are the same before and after DDP rebuilds its buckets and after a
    resume (bit-identical). Its staging buffer and flat residual persist; each step it records which
    bucket views its gradients came from, and is sent once the last of them has arrived."""

    def __init__(self, state: "LowbitState", index: int, codec: Codec, members: List[Tuple[str, int]],
                 exact: List[Tuple[str, int]], algorithm: str, device: torch.device) -> None:
        self.index, self.codec, self.algorithm, self.device = index, codec, algorithm, device
        self.n = sum(n for _, n in members)
        self.exact = sum(n for _, n in exact)
        self.size = len(members) + len(exact)
        self.seed_base = state.order[(members or exact)[0][0]] * 7
        self.stage = torch.empty(self.n + self.exact, dtype=torch.float32, device=device)
        self.slot: Dict[str, torch.Tensor] = {}
        pos = 0
        for name, n in members + exact:
            self.slot[name] = self.stage[pos : pos + n]
            pos += n
        # per-tensor codecs (per column, one scale per tensor) encode their one tensor with its shape
        self.shape = state._shapes.get(members[0][0]) if codec.per_tensor and len(members) == 1 else None
        self.residual: Optional[torch.Tensor] = None
        if state.uses_feedback(codec) and self.n:
            self.residual = flat_residual(state.residuals, members, device)
        self.arrived = 0
        self.src: List[torch.Tensor] = []
        self.dst: List[torch.Tensor] = []
        self.fut: Optional[torch.futures.Future] = None

    def arrive(self, name: str, view: torch.Tensor) -> None:
        if self.arrived == 0:
            self.src, self.dst = [], []
            self.fut = torch.futures.Future(devices=[self.device] if self.device.type == "cuda" else None)
        self.src.append(view)
        self.dst.append(self.slot[name])
        self.arrived += 1

    def send(self, state: "LowbitState", group: Optional[dist.ProcessGroup], step_seed: int) -> None:
        """Issue the message (all gradients have arrived and are staged); completes ``self.fut``."""
        self.arrived = 0
        done, src, dst = self.fut, self.src, self.dst

        stage = self.stage
        if self._graphed(state, group):
            self._replay(state, group, step_seed + self.seed_base)
            _copy_all(src, dst)
            done.set_result(stage)  # type: ignore[union-attr]  # (its events: after the replay, on this stream)
            return

        def post() -> None:
            _copy_all(src, dst)
            # A tensor as the value, so that the future records CUDA events after the copies (a None
            # value records none, and whoever waited on it would not wait for this work).
            done.set_result(stage)  # type: ignore[union-attr]

        fut = start(self.stage, self.codec, group, self.algorithm, "mean", self.residual,
                    step_seed + self.seed_base, state.stats, exact=self.exact, post=post, world=state._world,
                    node_size=state.node_size, shape=self.shape)

        held = weakref.ref(state)  # (not the state: a finished message's callback keeps nothing of the step)

        def fail(f: torch.futures.Future) -> None:
            try:
                f.value()
            except Exception as exc:  # noqa: BLE001 — the buckets waiting for this message fail with it
                st = held()
                if st is not None:
                    _remember(st, exc)
                if not done.done():  # type: ignore[union-attr]
                    done.set_exception(exc)  # type: ignore[union-attr]

        fut.add_done_callback(fail)


    def _graphed(self, state: "LowbitState", group: Optional[dist.ProcessGroup]) -> bool:
        """Whether this message's exchange replays a CUDA graph (:mod:`lowbit.comm.graphs`): on the hook
        thread (its side stream: the backward's stream never waits for the exchange), CUDA, a group that
        can be captured (checked once per group), scatter_gather or allgather, rounding seeds read from
        device memory where the codec rounds stochastically, no timing (its syncs), no emulated link."""
        if not self.stage.is_cuda or not getattr(_ON_HOOK_THREAD, "on", False) or C.link_emulated():
            return False
        if state.stats.timing or (self.codec.stochastic and not self.codec.device_seed) or not self.n:
            return False
        algo = self._algorithm(state)
        if algo not in ("scatter_gather", "allgather") or (algo == "scatter_gather" and (self.exact or self.shape)):
            return False
        ok = state._graph_ok.get(id(group)) if hasattr(state, "_graph_ok") else None
        if ok is None:
            if not hasattr(state, "_graph_ok"):
                state._graph_ok = {}
            ok = state._graph_ok[id(group)] = graphs.capturable(self.device, [group])
        return ok

    def _algorithm(self, state: "LowbitState") -> str:
        """The algorithm this message's exchange runs (the registry's rule, as ``start`` resolves it)."""
        if getattr(self, "_algo", None) is None:
            self._algo = resolve_entry(self.algorithm, self.codec, state._world[1],  # type: ignore[index]
                                       None if self.exact else self.stage.numel(), self.device)[0]
        return self._algo

    def _replay(self, state: "LowbitState", group: Optional[dist.ProcessGroup], seed: int) -> None:
        """The exchange (:func:`lowbit.comm.flat.exchange_now`) on the staging buffer, in place, as a replay
        of its CUDA graph (captured once, after one eager call); the statistics as ``start`` counts them."""
        world = state._world
        algo, codec, residual = self._algorithm(state), self.codec, self.residual
        rank, k = world  # type: ignore[misc]
        seeds = flat.call_seeds(algo, seed, rank, k) if codec.stochastic else []

        def fn(ins: List[torch.Tensor], outs: List[torch.Tensor], keys: List[Any]) -> None:
            flat.exchange_now(ins[0], codec, group, algo, "mean", residual, keys, world,  # type: ignore[arg-type]
                              exact=self.exact, shape=self.shape)

        if getattr(state, "_graphs", None) is None:
            state._graphs = graphs.Graphs("lowbit.ddp")
        key = (self.index, algo, codec.spec, id(group), self.stage.data_ptr(),
               0 if residual is None else residual.data_ptr())
        state._graphs.run(key, fn, [self.stage], [], seeds, keyed=codec.device_seed, static=True)
        state.stats.calls += 1
        state.stats.bytes_sent += flat.bytes_now(codec, algo, self.n, k, rank, self.exact, self.shape)


#: Set on the hook thread while it runs a job (:class:`_HookThread`): only there may a message replay a
#: CUDA graph (on the thread's side stream; inline, it would run on the backward's own stream).
_ON_HOOK_THREAD = threading.local()


def _plan_groups(state: "LowbitState", k: int, device: torch.device) -> Dict[str, _Group]:
    """Parameter name -> its message group, for every parameter that is sent quantised (or rides along)."""
    trainable = set(state.params.values())
    names = [n for n in reversed(list(state.plan)) if n in trainable]
    unknown = [n for n in names if n not in state._numels]
    if unknown:
        raise ValueError("lowbit: the state does not know the sizes of its parameters (e.g. "
                         f"{unknown[0]}); build it with lowbit.ddp.make_state or register")
    quantised = [state.plan[n] for n in names if not state.plan[n].sums_on_wire]
    if not quantised:
        return {}
    ride = resolve_algorithm(state.algorithm, quantised[0], k) == "allgather"
    codecs = [state.plan[n] for n in names]
    # per tensor: its algorithm (codec="auto" on several nodes may send some tensors hierarchically) and the
    # key its messages are planned by (tensors of one codec but different algorithms go in different messages)
    own = getattr(state, "algorithms", {})
    algos = [resolve_algorithm(own.get(n, state.algorithm), c, k) for n, c in zip(names, codecs)]
    keys = [c.spec if c.sums_on_wire else choice(c.spec, own.get(n)) for n, c in zip(names, codecs)]
    # the one plan of a step's messages (lowbit.timeline), which auto's replay and the speed model price
    plan = plan_step([state._numels[n] for n in names], keys,
                     native={key for key, c in zip(keys, codecs) if c.sums_on_wire},
                     per_tensor={key for key, c in zip(keys, codecs) if c.per_tensor},
                     rider=_FP32.spec if ride else None, message_mb=state.message_mb,
                     bucket_bytes=getattr(state, "bucket_bytes", DDP_BUCKET_BYTES),
                     first_bucket_bytes=getattr(state, "first_bucket_bytes", DDP_FIRST_BUCKET_BYTES),
                     riderless={key for key, c, a in zip(keys, codecs, algos) if not c.sums_on_wire and a != "allgather"})
    out: Dict[str, _Group] = {}
    for i, m in enumerate(plan.messages):
        codec = codecs[m.members[0]]
        members = [(names[j], state._numels[names[j]]) for j in m.members]
        exact = [(names[j], state._numels[names[j]]) for j in m.riders]
        g = _Group(state, i, codec, members, exact, algos[m.members[0]], device)
        for name, _ in members + exact:
            out[name] = g
    return out


class _Layout:
    """How one DDP bucket maps onto lowbit's messages; built once per (rebuilt) bucket: its gradients
    that go into message groups (with their views), and its natively summed tensors (fp32 that does not
    ride, fp16/bf16) as collectives of their own, reduced in place where the bucket holds them together."""

    def __init__(self, state: "LowbitState", bucket: dist.GradBucket, flat: torch.Tensor) -> None:
        native: Dict[str, Tuple[Codec, List[Tuple[str, int, int]]]] = {}
        self.grouped: List[Tuple[_Group, str, torch.Tensor]] = []
        offset = 0
        for p in bucket.parameters():
            name = state.params.get(id(p))
            if name is None:
                raise ValueError("lowbit: a DDP bucket holds a parameter the state does not know; "
                                 "register lowbit on the same model DDP wraps")
            n = p.numel()
            g = state._group_of.get(name)
            if g is not None:
                self.grouped.append((g, name, flat[offset : offset + n]))
            else:
                codec = state.plan[name]
                native.setdefault(codec.spec, (codec, []))[1].append((name, offset, n))
            offset += n
        self.groups = sorted({id(g): g for g, _, _ in self.grouped}.values(), key=lambda g: g.index)
        self.units: List[_Unit] = []
        for _, (c, m) in sorted(native.items()):
            offsets = [o for _, o, _ in m]
            inplace = None
            if flat.dtype == torch.float32 and all(offsets[i] + m[i][2] == offsets[i + 1] for i in range(len(m) - 1)):
                inplace = flat[offsets[0] : offsets[0] + sum(n for _, _, n in m)]
            self.units.append(_Unit(c, [flat[o : o + n] for _, o, n in m], inplace))


class _Option:
    """A knob of :class:`LowbitState` that reads ``state.options`` (the one :class:`DDPConfig`); setting
    it replaces the options with a copy that is validated again (the message plan is rebuilt)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, state: Any, owner: Optional[type] = None) -> Any:
        return self if state is None else getattr(state.options, self.name)

    def __set__(self, state: "LowbitState", value: Any) -> None:
        state.reconfigure(**{self.name: value})


class LowbitState:
    """Knobs and memory of the lowbit DDP comm hook. Pickles without its process group.

    Built by :func:`make_state` / :func:`register` from a :class:`DDPConfig` (``state.options``, whose
    fields ``algorithm``, ``error_feedback``, ``start_iter``, ``seed``, ``message_mb``, ``node_size`` and
    ``hook_thread`` read as attributes here) and the model's parameters: ``plan`` (name -> codec),
    ``params`` (id(parameter) -> name), ``shapes`` and ``devices`` (name -> shape / device), DDP's bucket
    caps (message groups end where DDP's buckets end) and, for ``codec="auto"``, its tuner."""

    algorithm = _Option()
    error_feedback = _Option()
    start_iter = _Option()
    seed = _Option()
    message_mb = _Option()
    node_size = _Option()
    hook_thread = _Option()  # not part of config(): where the host work runs, not what is sent

    def __init__(
        self,
        options: DDPConfig,
        plan: Dict[str, Codec],
        params: Dict[int, str],
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        shapes: Optional[Dict[str, Tuple[int, ...]]] = None,
        devices: Optional[Dict[str, torch.device]] = None,
        bucket_bytes: float = DDP_BUCKET_BYTES,
        first_bucket_bytes: float = DDP_FIRST_BUCKET_BYTES,
        auto: Optional[AutoTuner] = None,
    ) -> None:
        options.check_plan(plan)
        self.process_group = process_group
        self.options = self._resolved(options)
        self.plan = plan                      # parameter name -> codec
        self.algorithms: Dict[str, str] = {}  # parameter name -> its algorithm, where not self.algorithm (auto)
        self.auto = auto                      # codec="auto": its measurements and decision
        self.params = params                  # id(parameter) -> name
        self.order = {name: i for i, name in enumerate(plan)}  # model order of the parameters
        self.policy_fingerprint = options.policy_fingerprint()
        self.iter = 0
        self.residuals: Dict[str, torch.Tensor] = {}
        self.stats = CommStats()
        self._shapes: Dict[str, Tuple[int, ...]] = dict(shapes or {})
        self._numels: Dict[str, int] = {name: math.prod(s) for name, s in self._shapes.items()}
        self._devices: Dict[str, torch.device] = dict(devices or {})
        self._layouts: Dict[Tuple[int, int, int], _Layout] = {}
        self._group_of: Optional[Dict[str, _Group]] = None  # parameter name -> its message group
        self._world: Optional[Tuple[int, int]] = None  # (rank, size), read once
        self._native = False  # set with _world (_refresh_native): the hook runs the fp32 allreduce only
        # DDP's bucket caps, for message_mb="auto" (groups end where DDP's buckets end); register reads
        # them from the DDP model
        self.bucket_bytes = bucket_bytes
        self.first_bucket_bytes = first_bucket_bytes
        # the hook thread's own process group (the same ranks as process_group), made by make_state when
        # the thread may run (open_thread_group): collectives issued during the backward pass on the
        # user's group (by SyncBatchNorm, torch.distributed.nn, DDP itself) cannot interleave with lowbit's
        # differently on different ranks. Not pickled (a restored state falls back to process_group).
        self._thread_group: Optional[dist.ProcessGroup] = None
        self.error: Optional[BaseException] = None  # the first failed collective's error (check())

    # ------------------------------------------------------------------------------ changes
    def reconfigure(self, **changes: Any) -> None:
        """Replace options (validated again, as :class:`DDPConfig` validates); the message groups are
        planned again at the next compressed bucket."""
        options = dataclasses.replace(self.options, **changes)
        options.check_plan(self.plan)
        self.options = self._resolved(options)
        self._forget_messages()
        self._world = None  # read again (with _native) on the next step

    def _resolved(self, options: DDPConfig) -> DDPConfig:
        """``options`` with what the algorithm needs filled in: ``hierarchical``'s ranks per node, from the
        environment when not given (now: a clear error if unknown)."""
        entry = None if options.algorithm == AUTO else get_algorithm(options.algorithm)
        if entry is not None and entry.prepare is not None and options.node_size is None:
            options = dataclasses.replace(options, node_size=entry.prepare(self.process_group, None))
        return options

    def set_plan(self, assignment: Dict[str, str]) -> None:
        """Make ``assignment`` the plan, as ``codec="auto"`` decides, tries or steps up: parameter name ->
        codec spec, or a spec and the algorithm that tensor goes by (:func:`lowbit.choose.choice`,
        ``"qsgd:bits=8,bucket=512@hierarchical"``); fp32 where absent. Message groups are rebuilt on the
        next bucket; residuals of tensors that keep an error-feedback codec and algorithm are kept, the
        others dropped (a tensor whose codec changes starts empty)."""
        split = {name: split_choice(assignment.get(name, _FP32.spec)) for name in self.plan}
        plan = {name: get_codec(spec) for name, (spec, _) in split.items()}
        algorithms = {name: algo for name, (_, algo) in split.items() if algo}
        for algo in set(algorithms.values()):
            get_algorithm(algo)  # an unknown name: a ValueError naming the known ones
        old = getattr(self, "algorithms", {})
        keep = {n for n, c in plan.items() if self.uses_feedback(c) and self.plan[n].spec == c.spec
                and old.get(n) == algorithms.get(n)}
        self.residuals = {n: v.detach().clone() for n, v in self.residuals.items() if n in keep}
        self.plan = plan
        self.algorithms = algorithms
        self._forget_messages()
        self._refresh_native()

    def count_step(self, step: int) -> None:
        """The step about to run, while lowbit's hook is not installed and so does not count them
        (``codec="auto"`` measuring with DDP's own allreduce)."""
        self.iter = step

    def hook_starts(self, step: int) -> None:
        """lowbit's hook is installed at ``step``: it counts steps from there (compressing from
        ``start_iter`` at the earliest)."""
        self.iter = max(self.iter, step, self.start_iter)

    def open_thread_group(self, module: nn.Module) -> None:
        """Create the hook thread's own process group (a collective ``new_group``: every rank of
        ``process_group`` calls it) where the thread may run and torch.distributed is initialised."""
        if self.wants_thread_group(module) and dist.is_available() and dist.is_initialized():
            base = self.process_group if self.process_group is not None else dist.group.WORLD
            self._thread_group = new_subgroup(base, dist.get_process_group_ranks(base))  # (base's timeout)

    def wants_thread_group(self, module: nn.Module) -> bool:
        """Whether :meth:`open_thread_group` creates a group: the hook thread may run (``hook_thread`` True,
        or "auto" with ``module`` on CUDA)."""
        cuda = any(p.is_cuda for p in module.parameters())
        return self.hook_thread is True or (self.hook_thread == "auto" and cuda)

    def _forget_messages(self) -> None:
        self._group_of = None
        self._layouts.clear()
        if getattr(self, "_graphs", None) is not None:
            self._graphs.clear()  # (they read the old groups' buffers)

    # ------------------------------------------------------------------------------ helpers
    @property
    def numels(self) -> Dict[str, int]:
        """Parameter name -> number of values (read-only use)."""
        return self._numels

    def world(self) -> Tuple[int, int]:
        """(rank, size) in ``process_group``."""
        return self._world if self._world is not None else C.world(self.process_group)

    @property
    def one_node(self) -> bool:
        """A multi-node algorithm (``hierarchical``: the registry's ``multi_node``) with the whole group
        inside one node: nothing crosses a slow link, so nothing is compressed and the reduction is DDP's
        own fp32 allreduce."""
        if self.algorithm == AUTO or not get_algorithm(self.algorithm).multi_node or self.node_size is None:
            return False
        return self.world()[1] <= self.node_size

    def _refresh_native(self) -> None:
        """Whether the hook runs DDP's plain fp32 allreduce only: hierarchical inside one node, or
        codec="auto" with fp32 everywhere (while it measures, and when that is its plan)."""
        self._native = self.one_node or (self.auto is not None and
                                         all(c.spec == _FP32.spec for c in self.plan.values()))

    def uses_feedback(self, codec: Codec) -> bool:
        return self.options.uses_feedback(codec)

    def config(self) -> Dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "error_feedback": self.error_feedback,
            "start_iter": self.start_iter,
            "message_mb": self.message_mb,
            "node_size": self.node_size,
            "policy": self.policy_fingerprint,
            "plan": ({name: "auto" for name in sorted(self.plan)} if self.auto is not None
                     else {name: c.spec for name, c in sorted(self.plan.items())}),
            **({"auto": self.auto.config()} if self.auto is not None else {}),
        }

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.config(), sort_keys=True).encode()).hexdigest()[:16]

    def _advance(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def _layout(self, bucket: dist.GradBucket, flat: torch.Tensor) -> _Layout:
        key = (bucket.index(), flat.data_ptr(), flat.numel())
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = _Layout(self, bucket, flat)
        return lay

    def check(self) -> None:
        """Raise the first error of a lowbit collective of this state with its own type (a
        :class:`lowbit.comm.CollectiveError`), if one failed: DDP re-raises it from ``backward()`` as a
        ``RuntimeError`` whose message holds it, so ``except CollectiveError`` around ``backward()`` does not
        catch it there; call this in the ``except RuntimeError`` handler (or let the next step's hook raise
        it)."""
        error = getattr(self, "error", None)
        if error is not None:
            raise error

    # ------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> Dict[str, Any]:
        """Iteration counter, configuration, this rank's error-feedback residuals (per parameter), and the
        rank and world size they belong to: save one per rank."""
        rank, size = self.world()
        return {
            "iter": self.iter,
            "config": self.config(),
            "rank": rank,
            "world_size": size,
            "residuals": residuals_state(self.residuals),
            **({"auto": self.auto.state_dict()} if self.auto is not None else {}),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, after checking it: same configuration, same rank and world size
        (residuals are per rank), a non-negative integer ``iter``, and one finite float tensor of the
        right size per known parameter. Anything else is a ``ValueError`` naming the problem."""
        if not isinstance(state, dict) or not {"iter", "config", "residuals"} <= set(state):
            raise ValueError("lowbit checkpoint must be a dict with 'iter', 'config' and 'residuals' "
                             f"(from LowbitState.state_dict()), got {type(state).__name__}"
                             + (f" with keys {sorted(state)}" if isinstance(state, dict) else ""))
        if state.get("config") != self.config():
            raise ValueError(
                "lowbit checkpoint was saved with a different codec/policy/algorithm configuration: "
                f"saved {state.get('config')}, current {self.config()}"
            )
        it = state["iter"]
        if isinstance(it, bool) or not isinstance(it, int) or it < 0:
            raise ValueError(f"lowbit checkpoint: 'iter' must be a non-negative int, got {it!r}")
        if it >= 2**53:  # the rounding seed (seed * 1_000_003 + iter * 1_009) must stay a 64-bit integer
            raise ValueError(f"lowbit checkpoint: 'iter' {it} is not a plausible step count (must be < 2**53)")
        missing = [k for k in ("rank", "world_size") if k not in state]
        if missing:
            raise ValueError(f"lowbit checkpoint has no {' or '.join(repr(k) for k in missing)}: residuals belong to "
                             "one rank of one world size, and a checkpoint that does not say whose they are cannot "
                             "be checked (save LowbitState.state_dict() as it is)")
        rank, size = self.world()
        if (state["rank"], state["world_size"]) != (rank, size):
            raise ValueError(
                f"lowbit checkpoint was saved by rank {state['rank']} of {state['world_size']}, this is rank "
                f"{rank} of {size}: error-feedback residuals belong to one rank of one world size; save "
                "state_dict() on every rank and load each rank's own (or start a new lowbit state)")
        # every residual checked (lowbit.feedback's one check) before anything is applied, the auto
        # decision included: residuals are keyed by parameter, whatever the plan
        required: List[str] = []
        if it > self.start_iter and self.auto is None:  # compressed steps have run: every error-feedback
            trained = set(self.params.values())          # parameter has its residual
            required = sorted(n for n, c in self.plan.items() if self.uses_feedback(c) and n in trained)
        loaded = load_residuals(state["residuals"], "lowbit checkpoint",
                                {n: self._numels.get(n) for n in self.plan}, self._devices, required)
        if self.auto is not None:  # then the decision (checked whole before it changes anything): it sets the
            # plan the residuals belong to
            self.auto.load_state_dict(self, state.get("auto", {"config": self.auto.config(), "decision": None}))
        self.iter = it
        if self.auto is not None:
            self.auto.forwards = it
        self.residuals = loaded
        self._forget_messages()  # rebuilt on the next step, from these residuals
        self._world = None  # read again (with _native) on the next step

    def __getstate__(self) -> Dict[str, Any]:
        d = dict(self.__dict__)
        d["process_group"] = None
        d["_layouts"] = {}
        d["_group_of"] = None
        d["_world"] = None
        d["_native"] = False
        d["_thread_group"] = None
        d["error"] = None
        d.pop("_graphs", None)  # (CUDA graphs and their memory: captured again after a restore)
        d.pop("_graph_ok", None)
        return d


def _bucket_capturing(bucket: dist.GradBucket) -> bool:
    """Whether the bucket's CUDA stream is being captured into a graph (never on CPU)."""
    return bucket.buffer().is_cuda and C.capturing()


def _remember(state: LowbitState, exc: BaseException) -> None:
    """Keep the first error of a lowbit collective: DDP re-raises a failed future's error as a
    RuntimeError ("Unable to cast ... CollectiveError"), so lowbit raises the original at the next hook
    call and from :meth:`LowbitState.check` (docs/ddp.md, "Errors")."""
    if getattr(state, "error", None) is None:
        while isinstance(exc, RuntimeError) and not isinstance(exc, C.CollectiveError) and "lowbit:" in str(exc) \
                and exc.__cause__ is not None:
            exc = exc.__cause__
        if not isinstance(exc, C.CollectiveError) and "lowbit:" in str(exc):
            msg = str(exc)
            exc = C.CollectiveError(msg[msg.index("lowbit:"):].strip())
        state.error = exc


def hook(state: LowbitState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: low-precision mean of the bucket's gradients across the group."""
    error = getattr(state, "error", None)
    if error is not None:  # an earlier collective failed: raised with its own type (DDP disguised it)
        raise error
    if _bucket_capturing(bucket):
        raise RuntimeError("lowbit's DDP hook cannot run inside a CUDA graph capture (it returns futures "
                           "that DDP chains; capture the model without lowbit.ddp, or run DDP eagerly)")
    group = state.process_group
    if state._world is None:
        state._world = C.world(group)
        state._refresh_native()
    world = state._world[1]
    buf = bucket.buffer()
    if state.iter < state.start_iter or state._native:
        # Before DDP's bucket rebuild (or hierarchical inside one node, or codec="auto" measuring or with
        # fp32 everywhere): the plain fp32 allreduce, as torch's own hook does it.
        warm, st = state.iter < state.start_iter, state.stats
        calls, sent = st.calls, st.bytes_sent
        state._advance(bucket)
        fut = start(buf, _FP32, group, "allreduce", "mean", stats=st, world=state._world)
        if warm:  # counted apart too: stats.warmup_calls / warmup_bytes (CommStats)
            st.warmup_calls, st.warmup_bytes = st.warmup_calls + st.calls - calls, st.warmup_bytes + st.bytes_sent - sent
        return fut
    flat = buf.reshape(-1)
    if state._group_of is None:
        state._group_of = _plan_groups(state, world, flat.device)
    lay = state._layout(bucket, flat)
    step_seed = state.seed * 1_000_003 + state.iter * 1_009
    last = bucket.is_last()
    state._advance(bucket)
    mode = state.hook_thread
    if mode is True or (mode == "auto" and flat.is_cuda):
        own = getattr(state, "_thread_group", None)
        return _HOOK_THREAD.submit(state, lay, buf, own if own is not None else group, step_seed, last)
    return _issue(state, lay, buf, group, step_seed, last)


def _issue(state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup], step_seed: int,
           last: bool) -> torch.futures.Future:
    """The bucket's work: copy its gradients into their messages, send the complete messages and the
    natively summed units; a future of the bucket holding the mean."""
    if torch.autograd.profiler._is_profiler_enabled:  # a range for torch.profiler, free otherwise
        with torch.autograd.profiler.record_function("lowbit.ddp.hook"):
            return _issue_bucket(state, lay, buf, group, step_seed, last)
    return _issue_bucket(state, lay, buf, group, step_seed, last)


def _issue_bucket(state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup],
                  step_seed: int, last: bool) -> torch.futures.Future:
    futs = []
    if lay.grouped:
        dst, src = [], []
        for g, name, view in lay.grouped:
            g.arrive(name, view)
            dst.append(g.slot[name])
            src.append(view)
        _copy_all(dst, src)  # this bucket's gradients into their messages' staging buffers: one fused copy
        for g in lay.groups:
            futs.append(g.fut)
            if g.arrived == g.size:
                g.send(state, group, step_seed)
    for u in lay.units:
        u.gather()
        futs.append(start(u.stage, u.codec, group, "allreduce", "mean", stats=state.stats, post=u.finisher(buf),
                          world=state._world))
    if last and state._group_of and any(g.arrived for g in state._group_of.values()):
        missing = sorted({g.index for g in state._group_of.values() if g.arrived})
        raise RuntimeError(f"lowbit: the step ended with message groups {missing} incomplete: a parameter the "
                           "state expects never reached a DDP bucket (was it frozen after register?)")
    if len(futs) == 1 and not lay.grouped:
        return futs[0]  # its value is the whole bucket, reduced in place
    return C.join(futs, lambda: buf, buf.device)  # (not collect_all: it loses the CUDA stream order)


class _HookThread:
    """One thread per process that does the compressed hook's work (:func:`_issue`) for every lowbit
    state, in the order DDP called the hook (one FIFO queue: collectives keep the same order on every
    rank, as on the calling thread). The hook returns a future at once; the job completes it with the
    bucket once the bucket's own future has (or with its error). On CUDA a job runs on a side stream of
    the bucket's device that first waits for an event recorded on the caller's stream when the hook
    was called (the gradients are in the bucket by then), and the future it completes records its
    events after that stream's work, so DDP's stream waits for everything the job did.

    The step's last bucket waits until every queued job has issued its collectives: right after it
    DDP issues a collective of its own from the autograd thread (``find_unused_parameters``: the
    used-parameter map), which must come after lowbit's on every rank. The backward pass has been
    launched by then, so the wait costs it nothing."""

    def __init__(self) -> None:
        # (lowbit.comm.threads: holds no job once done, stopped before the process group goes)
        self._worker = Worker("lowbit-ddp-hook", lambda job: self._job(*job), self._finished)
        self._idle = threading.Condition()
        self._pending = 0
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}

    def _reset(self) -> None:  # in a forked child: the parent's thread does not exist there
        self.__init__()  # type: ignore[misc]

    def submit(self, state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup],
               step_seed: int, last: bool) -> torch.futures.Future:
        cuda = buf.is_cuda
        out: torch.futures.Future = torch.futures.Future(devices=[buf.device] if cuda else None)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(buf.device))
        with self._idle:
            self._pending += 1
        self._worker.put((state, lay, buf, group, step_seed, last, ready, out))
        if last:
            with self._idle:
                self._idle.wait_for(lambda: self._pending == 0)
        return out

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device)
        return s

    def _finished(self) -> None:  # a job has run, and its objects are free
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def _job(self, state: LowbitState, lay: _Layout, buf: torch.Tensor, group: Optional[dist.ProcessGroup],
             step_seed: int, last: bool, ready: Optional[torch.cuda.Event], out: torch.futures.Future) -> None:
        try:
            if ready is not None:
                stream = self._stream(buf.device)
                with torch.cuda.device(buf.device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    _ON_HOOK_THREAD.on = True
                    try:
                        inner = _issue(state, lay, buf, group, step_seed, last)
                    finally:
                        _ON_HOOK_THREAD.on = False
            else:
                inner = _issue(state, lay, buf, group, step_seed, last)
        except BaseException as exc:  # noqa: BLE001 — DDP's wait on the bucket raises it
            _remember(state, exc)
            out.set_exception(exc)
            # and so does its wait on any bucket with gradients in a message this failure left unsent
            for g in (state._group_of or {}).values():
                if g.fut is not None and not g.fut.done():
                    g.fut.set_exception(exc)
            return
        inner.then(_forward_to(out, buf))


def _forward_to(out: torch.futures.Future, buf: torch.Tensor):
    def done(f: torch.futures.Future) -> None:
        # A ``then`` callback runs on a stream that waited for ``f``'s work (the futures' contract on
        # CUDA): completing ``out`` there records its events after it.
        try:
            f.wait()
        except BaseException as exc:  # noqa: BLE001
            out.set_exception(exc)
            return
        out.set_result(buf)

    return done


_HOOK_THREAD = _HookThread()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HOOK_THREAD._reset)


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
