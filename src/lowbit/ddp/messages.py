"""lowbit.ddp's messages: the natively summed units of a bucket, the message groups (each a fixed set of
parameters sent as one message, replayed from a CUDA graph on the hook thread where it can be) and how
a DDP bucket maps onto them."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from lowbit.choose import DDP_BUCKET_BYTES, DDP_FIRST_BUCKET_BYTES, choice
from lowbit.timeline import plan_step
from lowbit.codecs.base import Codec
from lowbit.comm import collectives as C
from lowbit.comm import flat, graphs
from lowbit.comm.allreduce import resolve_algorithm, start
from lowbit.comm.registry import resolve_entry
from lowbit.ddp.config import _FP32
from lowbit.feedback import flat_residual

#: (lowbit.ddp.state.LowbitState: the state holds the messages, so they do not import it)
LowbitState = Any

log = logging.getLogger("lowbit.ddp")


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
        self._algo: Optional[str] = None  # the algorithm its exchange runs, resolved on first use

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
        """Whether this message's exchange replays a CUDA graph (:mod:`lowbit.comm.graphs`): on lowbit's
        side stream (the backward's stream never waits for the exchange), CUDA, a group that
        can be captured (checked once per group), scatter_gather or allgather, rounding seeds read from
        device memory where the codec rounds stochastically, no timing (its syncs), no emulated link."""
        if not getattr(_ON_SIDE_STREAM, "on", False) or not self.graphable(state):
            return False
        ok = state._graph_ok.get(id(group))
        if ok is None:
            ok = state._graph_ok[id(group)] = graphs.capturable(self.device, [group])
        return ok

    def graphable(self, state: "LowbitState") -> bool:
        """Whether this message may replay a CUDA graph once on lowbit's side stream (:meth:`_graphed`'s
        conditions that do not depend on the stream or on the group's capture check)."""
        if not self.stage.is_cuda or C.link_emulated() or not graphs.enabled():
            return False
        if state.stats.timing or (self.codec.stochastic and not self.codec.device_seed) or not self.n:
            return False
        algo = self._algorithm(state)
        return algo in ("scatter_gather", "allgather") and not (algo == "scatter_gather" and (self.exact or self.shape))

    def _algorithm(self, state: "LowbitState") -> str:
        """The algorithm this message's exchange runs (the registry's rule, as ``start`` resolves it)."""
        if self._algo is None:
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

        if state._graphs is None:
            state._graphs = graphs.Graphs("lowbit.ddp")
        key = (self.index, algo, codec.spec, id(group), self.stage.data_ptr(),
               0 if residual is None else residual.data_ptr())
        state._graphs.run(key, fn, [self.stage], [], seeds, keyed=codec.device_seed, static=True)
        state.stats.calls += 1
        state.stats.bytes_sent += flat.bytes_now(codec, algo, self.n, k, rank, self.exact, self.shape)


#: Set while a bucket's work runs on lowbit's side stream of its device (on the hook thread,
#: :class:`_HookThread`, or inline in the hook): only there may a message replay a CUDA graph (on the
#: backward's own stream it would hold the backward's kernels behind the exchange).
_ON_SIDE_STREAM = threading.local()


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
