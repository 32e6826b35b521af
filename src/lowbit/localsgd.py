"""Local steps with a low-bit outer synchronisation (local SGD, DiLoCo, Streaming DiLoCo).

Below roughly a gigabit per rank even 1-bit gradients every step bound the step. Local SGD trades
communication for staleness: every rank (or every group of ranks, running DDP inside) takes ``H`` inner
steps alone, then the groups exchange the weight change they made since the last synchronisation and
an outer optimizer applies its mean. DiLoCo (Douillard et al. 2023) uses AdamW inside and SGD with
Nesterov momentum outside (lr 0.7, momentum 0.9); the exchange here runs in any lowbit codec, with error
feedback per rank for biased and low-bit codecs (4-bit and 2-bit QSGD, 1bitSGD, top-k).

One outer synchronisation of fragment ``f`` (all of the parameters when ``fragments=1``):

1. **pseudo-gradient**: ``delta = anchor - current``, flat float32 (``anchor``: the weights every
   rank agreed on at the fragment's last synchronisation);
2. **exchange**: ``delta`` is averaged across the groups by :func:`lowbit.comm.allreduce.all_reduce` in
   the codec, its residual (error feedback, :mod:`lowbit.feedback`) compensating what earlier rounds
   failed to send. With ``node_size`` (groups of consecutive ranks doing DDP inside), local rank ``l``
   of each group sends only chunk ``l`` of the fragment across groups, among the ranks of the same
   local index, and a native all-gather inside the group puts the chunks together (as HSDP does);
3. **outer step**: ``anchor.grad = mean delta``; the outer optimizer steps the anchor;
4. **reset**: the fragment's parameters become the new anchor.

The mean is bit-identical on every rank (lowbit's collectives decode and sum in rank order), the
anchor and the outer optimizer's state start identical (the anchor is broadcast from the group's
rank 0 at construction), so every rank ends each outer step with bit-identical weights.

Streaming (``fragments=F``, Douillard et al. 2025): the parameters, in model order, are cut into ``F``
fragments of about equal size (whole tensors); fragment ``f`` is synchronised after inner step
``(f + 1) * H // F`` of each period (the last fragment at the period's end), so the peak traffic is
``1/F`` of the model. With ``overlap=τ`` (Streaming DiLoCo's overlapping communication) the fragment's
exchange is only issued there: the next ``τ`` inner steps run while it crosses, and at the ``τ``-th the
outer step is applied to the pseudo-gradient formed ``τ`` steps earlier and the fragment's parameters
become ``mix * local + (1 - mix) * anchor`` (the paper's mixing; ``mix=0``: the anchor, as without
overlap). The anchors stay bit-identical on every rank; with ``mix > 0`` each rank keeps its mixed share
of the ``τ`` local steps.

Memory beyond the model: the anchor (one float32 copy of the parameters), a float32 scratch buffer
of the largest fragment, the outer optimizer's state (SGD with momentum: one more copy) and, with error
feedback, a float32 residual of what this rank sends (the whole model, or ``1/node_size`` of it).

Model buffers (BatchNorm's running statistics) are not synchronised: DDP inside a group keeps them
as it does. Parameters sharded by FSDP2 (DTensors) are not supported yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.agreement import ConfigMismatchError, agree
from lowbit.comm.allreduce import all_reduce
from lowbit.comm.groups import new_subgroup
from lowbit.comm.hierarchical import topology
from lowbit.comm.registry import AUTO, SIMULATED, get_algorithm
from lowbit.comm.stats import CommStats
from lowbit.feedback import ErrorFeedback

__all__ = ["LocalSGD", "LocalSGDConfig", "ConfigMismatchError", "node_groups", "default_outer_optimizer",
           "DEFAULT_OUTER_LR", "DEFAULT_OUTER_MOMENTUM"]

#: DiLoCo's outer optimizer: SGD, Nesterov momentum, lr 0.7, momentum 0.9.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9

#: the checkpoint format of :meth:`LocalSGD.state_dict`
_FORMAT = "lowbit.localsgd/1"

OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def default_outer_optimizer(lr: float = DEFAULT_OUTER_LR, momentum: float = DEFAULT_OUTER_MOMENTUM) -> OuterFactory:
    """DiLoCo's outer optimizer as a factory: ``SGD(params, lr, momentum, nesterov=momentum > 0)``.

    Args:
        lr: the outer learning rate (1 with no momentum is plain model averaging).
        momentum: Nesterov momentum (0: none).

    Returns:
        A callable that builds the optimizer over the anchor tensors.

    Raises:
        ValueError: ``lr`` not > 0 or ``momentum`` outside [0, 1).
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"outer_lr must be a number > 0, got {lr!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum must be a number in [0, 1), got {momentum!r}")

    def build(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=float(lr), momentum=float(momentum), nesterov=momentum > 0)

    return build


def node_groups(node_size: int, group: dist.ProcessGroup | None = None
                ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """The process groups of ``node_size`` consecutive ranks of ``group`` (``inner``: this rank's group,
    for DDP inside it) and of the ranks of this rank's local index across groups (``outer``), the same
    objects :class:`LocalSGD` uses with that ``node_size`` (made once, cached with ``group``).

    Args:
        node_size: ranks per group; must divide ``group``'s size.
        group: the whole job's group (default: the world).

    Returns:
        ``(inner, outer)``; None for a group of one rank (``node_size == 1``: no inner group; one group:
        no outer group).

    Raises:
        ValueError: ``node_size`` not a positive int dividing the group's size.
    """
    _, k = C.world(group)
    _check_node_size(node_size, k)
    topo = topology(group, node_size)
    return topo.intra, topo.cross


def _check_node_size(node_size: object, k: int) -> int:
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be a positive int (ranks per group), got {node_size!r}")
    if k % node_size:
        raise ValueError(f"node_size={node_size}: the group's {k} ranks do not split into groups of {node_size}")
    return node_size


@dataclasses.dataclass(frozen=True)
class LocalSGDConfig:
    """The validated options of :class:`LocalSGD` (every rank must agree on them).

    ``local_steps``: H, inner steps per period; ``fragments``: F, the streaming fragments (1: all at
    once); ``codec``: the canonical spec of the outer exchange's codec; ``error_feedback``: resolved to a
    bool; ``algorithm``: the all-reduce's algorithm; ``node_size``: ranks per group (None: every rank
    is its own group, or the groups come from ``replicate_group``)."""

    local_steps: int
    fragments: int = 1
    codec: str = "fp32"
    error_feedback: bool = False
    algorithm: str = "auto"
    node_size: int | None = None
    overlap: int = 0
    mix: float = 0.0

    def __post_init__(self) -> None:
        for name in ("local_steps", "fragments"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.fragments > self.local_steps:
            raise ValueError(f"fragments ({self.fragments}) must be at most local_steps ({self.local_steps}): each "
                             "fragment is synchronised at its own inner step of the period")
        gap = self.local_steps // self.fragments
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) or not 0 <= self.overlap < gap:
            raise ValueError(f"overlap must be an int in [0, {gap}) (inner steps a fragment's exchange may take, less "
                             f"than local_steps // fragments, so one fragment's lands before the next one's starts), "
                             f"got {self.overlap!r}")
        if isinstance(self.mix, bool) or not isinstance(self.mix, (int, float)) or not 0.0 <= self.mix < 1.0:
            raise ValueError(f"mix must be a number in [0, 1) (the local parameters' share at the merge), got "
                             f"{self.mix!r}")
        if self.mix and not self.overlap:
            raise ValueError("mix goes with overlap > 0 (without overlap the parameters are the anchor at once)")
        codec = get_codec(self.codec)
        if self.algorithm != AUTO:
            plugin = get_algorithm(self.algorithm)  # (a ValueError naming the algorithms for an unknown one)
            if self.algorithm == SIMULATED:
                raise ValueError("algorithm='simulated' leaves the tensor unreduced (a speed benchmark only)")
            if not plugin.quantised and not codec.sums_on_wire:
                raise ValueError(f"algorithm {self.algorithm!r} sums on the wire, so it only takes fp32/fp16/bf16, "
                                 f"not {codec.spec}")
        if self.error_feedback and codec.sums_on_wire:
            raise ValueError(f"error_feedback=True: {codec.spec} is summed natively (lossless up to the cast) and takes "
                             "no error feedback; use a quantised codec or error_feedback=False")


def _resolve_feedback(error_feedback: object, codec: Codec) -> bool:
    """``"auto"``: on for biased codecs and for codes of 4 bits or fewer, never for natively summed ones."""
    if error_feedback == "auto":
        return not codec.sums_on_wire and (codec.biased or codec.code_bits <= 4)
    if isinstance(error_feedback, bool):
        return error_feedback
    raise ValueError(f"error_feedback must be 'auto', True or False, got {error_feedback!r}")


@dataclasses.dataclass
class _Fragment:
    """Consecutive parameters synchronised together: their anchor, flat; ``offset``: the inner step of
    the period (mod H) after which they are synchronised."""

    params: list[nn.Parameter]
    anchor: torch.Tensor        # (n,) float32, the outer optimizer's parameter
    offset: int
    padded: int                 # n rounded up to a multiple of the ranks per group (chunks)

    @property
    def numel(self) -> int:
        return self.anchor.numel()


def _split(params: Sequence[nn.Parameter], fragments: int) -> list[list[nn.Parameter]]:
    """``params`` cut, in order, into ``fragments`` non-empty runs of whole tensors of about equal numel:
    tensor ``i`` goes to the fragment its middle falls in (``floor((numel before it + its numel / 2) * F /
    total)``), kept between the previous
    tensor's fragment and the next one, and late enough that every fragment gets a tensor."""
    if fragments > len(params):
        raise ValueError(f"fragments={fragments}: the model has only {len(params)} trainable parameter tensors "
                         "(a fragment holds whole tensors)")
    total = max(sum(p.numel() for p in params), 1)
    out: list[list[nn.Parameter]] = [[] for _ in range(fragments)]
    seen, prev = 0, 0
    for i, p in enumerate(params):
        f = 0 if i == 0 else min(max((2 * seen + p.numel()) * fragments // (2 * total), prev, fragments - (len(params) - i)), prev + 1)
        out[f].append(p)
        seen += p.numel()
        prev = f
    return out


class LocalSGD:
    """Local steps with an outer synchronisation every ``local_steps`` inner steps (module doc).

    Wraps a model and its inner optimizer: call :meth:`step` where the training loop called the inner
    optimizer's ``step`` (or call the inner step yourself, e.g. through ``GradScaler.step``, then
    :meth:`after_step`)::

        model = DDP(model, process_group=inner)         # optional: DDP inside each group
        inner_opt = torch.optim.AdamW(model.parameters(), lr=4e-4)
        opt = lowbit.localsgd.LocalSGD(model, inner_opt, local_steps=100, codec="qsgd:bits=4,bucket=512")
        for batch in data:
            loss_fn(model(batch)).backward()
            opt.step()
            opt.zero_grad()

    Constructing it is collective over ``group``: every rank validates its options, the ranks compare
    them (:func:`lowbit.comm.agreement.agree`), and rank 0's weights are broadcast as the first anchor.

    Tuning: ``local_steps`` trades communication for staleness (DiLoCo: 500 inner steps; at a few
    hundred steps a run at most a few ten-thousandths of its tokens are spent waiting); at small H the
    outer lr 0.7 / momentum 0.9 is still right. ``fragments`` lowers the peak bandwidth, not the total.
    4-bit QSGD with error feedback is the usual codec; 2-bit works with error feedback too.

    Attributes:
        stats: :class:`~lowbit.comm.stats.CommStats` of the outer exchanges: ``bytes_sent`` everything
            this rank put on the wire for them, ``bytes_inter`` the part sent between groups.
        outer: the outer optimizer (its parameters are the fragments' anchors).
        config: the validated :class:`LocalSGDConfig`.
        synced: the fragments synchronised by the last :meth:`step`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        local_steps: int,
        codec: str | Codec = "fp32",
        fragments: int = 1,
        outer_optimizer: OuterFactory | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        error_feedback: bool | str = "auto",
        algorithm: str = "auto",
        group: dist.ProcessGroup | None = None,
        node_size: int | None = None,
        replicate_group: dist.ProcessGroup | None = None,
        overlap: int = 0,
        mix: float | None = None,
    ) -> None:
        """Args:
            model: the module whose trainable parameters are synchronised (a DDP module is fine).
            optimizer: the inner optimizer, stepped by :meth:`step` (None: only :meth:`after_step` is used).
            local_steps: H, inner steps between two synchronisations of a fragment.
            codec: the codec of the exchanged weight changes (a spec or a :class:`~lowbit.Codec`).
            fragments: F, streaming fragments (1: the whole model at once).
            outer_optimizer: a factory ``params -> torch.optim.Optimizer`` (default: SGD with Nesterov
                momentum, :func:`default_outer_optimizer`).
            outer_lr, outer_momentum: the default outer optimizer's lr and momentum (0.7 and 0.9).
            error_feedback: ``"auto"`` (on for biased codecs and 4 bits or fewer), True or False.
            algorithm: the all-reduce's algorithm (:func:`lowbit.comm.allreduce.all_reduce`).
            group: the job's process group (default: the world): agreement and the first anchor.
            node_size: ranks per group: groups of that many consecutive ranks run DDP inside
                (:func:`node_groups` gives the inner group); only the outer exchange crosses groups.
            replicate_group: the group the outer exchange runs over (every rank sends its whole weight
                change), when the groups come from elsewhere (a device mesh's replicate dimension).
            overlap: τ, inner steps a fragment's exchange runs behind (0: synchronous; less than
                ``local_steps // fragments``).
            mix: with ``overlap``, the local parameters' share when a fragment lands (default 0.5, Streaming
                DiLoCo's mixing; 0: replaced by the anchor).

        Raises:
            ValueError: an option out of range (named), an unknown codec, ``node_size`` and
                ``replicate_group`` together, a model without trainable parameters; on every rank.
            ConfigMismatchError: the ranks disagree on H, F, codec, error feedback, algorithm, the outer
                optimizer or the parameters' sizes (every rank raises it, naming each rank's settings).
        """
        self._group = group
        self._model = model
        self.optimizer = optimizer
        try:
            settings = self._configure(model, optimizer, local_steps, codec, fragments, outer_optimizer, outer_lr,
                                       outer_momentum, error_feedback, algorithm, group, node_size, replicate_group,
                                       overlap, (0.5 if overlap else 0.0) if mix is None else mix)
        except ValueError as exc:
            settings = exc
        agree(settings, group, "lowbit.localsgd: the ranks disagree on their local SGD settings",
              lambda s: ", ".join(f"{k}={v}" for k, v in s.items()))
        if self.config.overlap and not self._solo and dist.is_available() and dist.is_initialized():
            # an exchange in flight must not meet the job's other collectives on one communicator (an
            # emulated link's thread, or gloo's, issues it later than the caller's next ones, in another
            # order on another rank): its own group, with the same ranks (made once the ranks agree)
            self._cross = new_subgroup(self._cross, dist.get_process_group_ranks(
                self._cross if self._cross is not None else dist.group.WORLD))
        self._broadcast_anchor()

    # ----------------------------------------------------------------------------- construction
    def _configure(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, local_steps: int,
                   codec: str | Codec, fragments: int, outer_optimizer: OuterFactory | None,
                   outer_lr: float | None, outer_momentum: float | None, error_feedback: bool | str,
                   algorithm: str, group: dist.ProcessGroup | None, node_size: int | None,
                   replicate_group: dist.ProcessGroup | None, overlap: int = 0, mix: float = 0.0) -> dict[str, Any]:
        """Validate the options and build the state; returns the settings the ranks compare."""
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer (the inner optimizer) or None, got "
                             f"{type(optimizer).__name__}")
        if not isinstance(codec, (str, Codec)):
            raise ValueError(f"codec must be a codec spec such as 'qsgd:bits=4,bucket=512' or a Codec, got {codec!r}")
        codec = get_codec(codec) if isinstance(codec, str) else codec
        if node_size is not None and replicate_group is not None:
            raise ValueError("pass node_size (groups of consecutive ranks) or replicate_group (the outer exchange's "
                             "own group), not both")
        _, k = C.world(group)
        if node_size is not None:
            _check_node_size(node_size, k)
        config = LocalSGDConfig(local_steps=local_steps, fragments=fragments, codec=codec.spec,
                                error_feedback=_resolve_feedback(error_feedback, codec), algorithm=algorithm,
                                node_size=node_size, overlap=overlap, mix=float(mix))
        if outer_optimizer is not None and (outer_lr is not None or outer_momentum is not None):
            raise ValueError("outer_lr / outer_momentum set the default outer optimizer; with outer_optimizer= set "
                             "the lr and momentum in the factory")
        if outer_optimizer is None:
            outer_optimizer = default_outer_optimizer(DEFAULT_OUTER_LR if outer_lr is None else outer_lr,
                                                      DEFAULT_OUTER_MOMENTUM if outer_momentum is None else outer_momentum)
        elif not callable(outer_optimizer):
            raise ValueError(f"outer_optimizer must be a callable params -> torch.optim.Optimizer, got "
                             f"{type(outer_optimizer).__name__}")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters to synchronise")
        for p in params:
            if type(p.data).__name__ == "DTensor" or hasattr(p, "device_mesh"):
                raise ValueError("lowbit.localsgd does not support sharded (FSDP2 / DTensor) parameters yet; "
                                 "run DDP inside each group")
            if not p.is_floating_point():
                raise ValueError(f"parameter of dtype {p.dtype} is not floating point")
        device = params[0].device
        if any(p.device != device for p in params):
            raise ValueError("the model's parameters lie on several devices; lowbit.localsgd keeps one flat anchor "
                             "per fragment on one device")

        # the exchange's groups: ``cross`` for the compressed exchange, ``intra`` for the chunk gather
        self._intra: dist.ProcessGroup | None = None
        self._cross: dist.ProcessGroup | None = replicate_group if replicate_group is not None else group
        self._chunks, self._local = 1, 0
        if node_size is not None:
            topo = topology(group, node_size)
            self._intra, self._cross = topo.intra, topo.cross
            self._chunks, self._local = node_size, topo.local
        self._solo = node_size is not None and node_size == k  # one group: nothing crosses

        self.config = config
        self.codec = codec
        self._H, self._F = config.local_steps, config.fragments
        self.feedback = ErrorFeedback(codec) if config.error_feedback else None
        self._frags: list[_Fragment] = []
        with torch.no_grad():
            for f, members in enumerate(_split(params, config.fragments)):
                anchor = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in members])
                n = anchor.numel()
                self._frags.append(_Fragment(members, anchor, ((f + 1) * self._H // self._F) % self._H,
                                             -(-n // self._chunks) * self._chunks))
        self._scratch = torch.zeros(max(fr.padded for fr in self._frags), dtype=torch.float32, device=device)
        # with overlap: per fragment, its exchange in flight (handle or None once landed, its delta, the step due)
        self._pending: dict[int, list[Any]] = {}
        self.outer = outer_optimizer([fr.anchor for fr in self._frags])
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ValueError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.outer).__name__}")
        self.stats = CommStats()
        self.synced: list[int] = []
        self._step = 0
        self.skipped = 0
        defaults = {k: v for k, v in self.outer.defaults.items() if k not in ("foreach", "fused", "maximize",
                                                                                "capturable", "differentiable")}
        return {**dataclasses.asdict(config), "outer": f"{type(self.outer).__name__}({defaults})",
                "fragment_sizes": [fr.numel for fr in self._frags]}

    def _broadcast_anchor(self) -> None:
        """Every rank starts from the group's rank 0's weights (as DDP does)."""
        if C.world(self._group)[1] > 1:
            src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
            for fr in self._frags:
                try:
                    dist.broadcast(fr.anchor, src=src, group=self._group)
                except Exception as exc:  # noqa: BLE001 — re-raised with context
                    raise C.CollectiveError(f"lowbit.localsgd: broadcasting the first anchor failed ({exc})") from exc
        for fr in self._frags:
            self._reset(fr)

    # ----------------------------------------------------------------------------- the loop
    @property
    def local_steps(self) -> int:
        return self._H

    @property
    def fragments(self) -> int:
        return self._F

    @property
    def inner_steps(self) -> int:
        """Inner steps taken so far (:meth:`step` / :meth:`after_step` calls)."""
        return self._step

    @property
    def outer_steps(self) -> int:
        """Completed periods: outer steps of every fragment."""
        return self._step // self._H

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One inner step (the inner optimizer's ``step(closure)``), then :meth:`after_step`.

        Returns:
            What the inner optimizer's ``step`` returned.

        Raises:
            ValueError: no inner optimizer was given.
            lowbit.comm.CollectiveError: an exchange failed.
        """
        if self.optimizer is None:
            raise ValueError("LocalSGD was built without an inner optimizer: step it yourself and call after_step()")
        loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        self.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def after_step(self) -> list[int]:
        """Count one inner step taken elsewhere and synchronise the fragments now due.

        Returns:
            The fragments synchronised (also in :attr:`synced`).

        Raises:
            lowbit.comm.CollectiveError: an exchange failed.
        """
        self._step += 1
        phase = self._step % self._H
        for f in [f for f, (_, _, due) in sorted(self._pending.items()) if due == self._step]:
            self._land(f)  # exchanges issued overlap steps ago (before any new one: one order on every rank)
        self.synced = [f for f, fr in enumerate(self._frags) if fr.offset == phase]
        for f in self.synced:
            if self.config.overlap:
                self._issue(f)
            else:
                self._sync(f)
        return self.synced

    def sync(self) -> None:
        """Synchronise every fragment now (e.g. before evaluating or saving a final model); every rank must
        call it at the same step. Exchanges in flight land first. Does not change the period's schedule."""
        for f in sorted(self._pending):
            self._land(f)
        for f in range(self._F):
            self._sync(f)

    def _issue(self, f: int) -> None:
        """Overlap: form fragment ``f``'s pseudo-gradient now and issue its exchange; it lands
        ``overlap`` inner steps later (:meth:`_land`)."""
        fr = self._frags[f]
        delta = torch.empty(fr.padded, dtype=torch.float32, device=fr.anchor.device)
        with torch.no_grad():
            self._pseudo_gradient(fr, delta)
            handle = self._exchange(f, delta, async_op=True)
        self._pending[f] = [handle, delta, self._step + self.config.overlap]

    def _exchange(self, f: int, delta: torch.Tensor, async_op: bool = False) -> Any:
        """This rank's chunk of ``delta`` averaged across groups, in place (its bytes in the stats, those
        between groups in ``bytes_inter``); the handle with ``async_op``, else None (also with one group)."""
        if self._solo:
            return None
        c = self._frags[f].padded // self._chunks
        before = self.stats.bytes_sent
        handle = all_reduce(delta[self._local * c : (self._local + 1) * c], self.codec, group=self._cross,
                            algorithm=self.config.algorithm, op="mean", feedback=self.feedback, key=f,
                            seed=self._step, stats=self.stats, async_op=async_op)
        self.stats.bytes_inter += self.stats.bytes_sent - before
        return handle

    def _land(self, f: int) -> None:
        """Overlap: fragment ``f``'s exchange has had its ``overlap`` steps: wait for it, gather the chunks
        inside the group, step the anchor and mix the parameters with it."""
        handle, delta, _ = self._pending.pop(f)
        if handle is not None:
            handle.wait()
        fr = self._frags[f]
        with torch.no_grad():
            self._gather_chunks(fr, delta)
            self._outer_step(fr, delta)
            self._merge(fr, self.config.mix)

    def _pseudo_gradient(self, fr: _Fragment, delta: torch.Tensor) -> None:
        """``delta[:n] = anchor - current`` (the padding zero)."""
        n = fr.numel
        torch.cat([p.detach().reshape(-1).to(torch.float32) for p in fr.params], out=delta[:n])
        torch.sub(fr.anchor, delta[:n], out=delta[:n])
        delta[n:].zero_()

    def _gather_chunks(self, fr: _Fragment, delta: torch.Tensor) -> None:
        """The chunks of the mean that the ranks of a group reduced across groups, put together."""
        if not self._solo and self._chunks > 1:
            c = fr.padded // self._chunks
            send = delta[self._local * c : (self._local + 1) * c].clone()
            C.all_gather(delta[: fr.padded], send, self._intra, link=False)
            self.stats.bytes_sent += (self._chunks - 1) * send.numel() * send.element_size()

    def _outer_step(self, fr: _Fragment, delta: torch.Tensor) -> None:
        """The outer optimizer's step on the fragment's anchor; a mean with an Inf or NaN (the same on every
        rank) is skipped."""
        n = fr.numel
        if not bool(torch.isfinite(delta[:n]).all()):
            self.skipped += 1
            return
        fr.anchor.grad = delta[:n]
        for other in self._frags:
            if other is not fr:
                other.anchor.grad = None
        self.outer.step()
        fr.anchor.grad = None

    @staticmethod
    def _merge(fr: _Fragment, mix: float) -> None:
        """The fragment's parameters become ``mix * local + (1 - mix) * anchor`` (``mix=0``: the anchor)."""
        if not mix:
            LocalSGD._reset(fr)
            return
        with torch.no_grad():
            pos = 0
            for p in fr.params:
                a = fr.anchor[pos : pos + p.numel()].view_as(p)
                p.copy_(torch.lerp(a, p.detach().to(torch.float32), mix))
                pos += p.numel()

    def _sync(self, f: int) -> None:
        fr = self._frags[f]
        delta = self._scratch[: fr.padded]  # (padded,) float32
        with torch.no_grad():
            self._pseudo_gradient(fr, delta)  # 1. anchor - current
            self._exchange(f, delta)  # 2. the mean across groups, this rank's chunk
            self._gather_chunks(fr, delta)  # ... and the chunks put together inside the group
            self._outer_step(fr, delta)  # 3. the outer step (skipped for a non-finite mean)
            self._reset(fr)  # 4. the parameters become the new anchor

    @staticmethod
    def _reset(fr: _Fragment) -> None:
        with torch.no_grad():
            pos = 0
            for p in fr.params:
                p.copy_(fr.anchor[pos : pos + p.numel()].view_as(p))
                pos += p.numel()

    @contextlib.contextmanager
    def anchor_weights(self) -> Iterator[None]:
        """Inside the block the model holds the anchor, the weights every rank agreed on at each fragment's
        last synchronisation (to evaluate the model the ranks share); its own weights come back after."""
        saved = [[p.detach().clone() for p in fr.params] for fr in self._frags]
        for fr in self._frags:
            self._reset(fr)
        try:
            yield
        finally:
            with torch.no_grad():
                for fr, keep in zip(self._frags, saved):
                    for p, v in zip(fr.params, keep):
                        p.copy_(v)

    # ----------------------------------------------------------------------------- checkpoints
    def bytes_per_outer_step(self) -> float:
        """Mean bytes this rank put on the wire per completed period (0 before the first)."""
        return self.stats.bytes_sent / self.outer_steps if self.outer_steps else 0.0

    def memory_bytes(self) -> int:
        """Bytes this object holds beyond the model: anchors, scratch, outer state, residuals."""
        total = sum(fr.anchor.numel() * 4 for fr in self._frags) + self._scratch.numel() * 4
        for st in self.outer.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
        if self.feedback is not None:
            total += sum(e.numel() * 4 for e in self.feedback.residuals.values())
        return total

    def _settings(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.config), "fragment_sizes": [fr.numel for fr in self._frags],
                "outer": type(self.outer).__name__}

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (residuals differ between ranks: save every rank's): the step within the
        schedule, the anchors, the outer optimizer's state, the error-feedback residuals. The model's
        weights and the inner optimizer's state are saved by their own ``state_dict``.

        Returns:
            A dict of CPU tensors and plain values (``torch.save``-able).
        """
        return {
            "format": _FORMAT,
            "settings": self._settings(),
            "step": self._step,
            "skipped": self.skipped,
            "anchors": [fr.anchor.detach().to("cpu").clone() for fr in self._frags],
            # overlap: the exchanges in flight, landed locally (each its reduced chunk and the step it is due)
            "pending": {f: (self._landed(f).to("cpu").clone(), due)
                        for f, (_, _, due) in sorted(self._pending.items())},
            "outer": self.outer.state_dict(),
            "feedback": self.feedback.state_dict() if self.feedback is not None else None,
            "stats": self.stats.as_dict(),
        }

    def _landed(self, f: int) -> torch.Tensor:
        """Fragment ``f``'s delta in flight, its exchange waited for (it lands at its step as planned)."""
        entry = self._pending[f]
        if entry[0] is not None:
            entry[0].wait()
            entry[0] = None
        return entry[1]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` (all checked before anything changes). With the model's and the inner
        optimizer's states loaded too, training continues bit-identically.

        Args:
            state: what :meth:`state_dict` returned (on this rank).

        Raises:
            ValueError: not a local SGD checkpoint, saved with other settings (named), anchors of the wrong
                size or dtype, residuals refused by :func:`lowbit.feedback.load_residuals`.
        """
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"not a lowbit.localsgd checkpoint (format {_FORMAT!r}): got "
                             f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r}")
        saved, mine = state.get("settings"), self._settings()
        if saved != mine:
            diff = {k: (saved.get(k) if isinstance(saved, dict) else None, v) for k, v in mine.items()
                    if not isinstance(saved, dict) or saved.get(k) != v}
            raise ValueError("lowbit.localsgd checkpoint was saved with other settings: "
                             + ", ".join(f"{k} saved {a!r}, now {b!r}" for k, (a, b) in diff.items()))
        anchors = state.get("anchors")
        if not isinstance(anchors, list) or len(anchors) != len(self._frags):
            raise ValueError(f"lowbit.localsgd checkpoint: expected {len(self._frags)} anchors")
        for i, (a, fr) in enumerate(zip(anchors, self._frags)):
            if not isinstance(a, torch.Tensor) or a.dtype != torch.float32 or a.numel() != fr.numel:
                raise ValueError(f"lowbit.localsgd checkpoint: anchor {i} must be a float32 tensor of {fr.numel} values")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"lowbit.localsgd checkpoint: 'step' must be an int >= 0, got {step!r}")
        pending = state.get("pending", {})

        def bad(f: Any, v: Any) -> bool:
            return (not (isinstance(f, int) and 0 <= f < len(self._frags)) or not isinstance(v, (tuple, list))
                    or len(v) != 2 or not isinstance(v[0], torch.Tensor) or v[0].dtype != torch.float32
                    or v[0].numel() != self._frags[f].padded or not isinstance(v[1], int)
                    or not step < v[1] <= step + self.config.overlap)

        if not isinstance(pending, dict) or any(bad(f, v) for f, v in pending.items()):
            raise ValueError("lowbit.localsgd checkpoint: 'pending' must map fragments to (their padded float32 delta, "
                             "a due step within overlap of 'step')")
        fb = state.get("feedback")
        if (fb is None) != (self.feedback is None):
            raise ValueError("lowbit.localsgd checkpoint: error feedback was "
                             f"{'off' if fb is None else 'on'} when saved, {'off' if self.feedback is None else 'on'} now")
        if self.feedback is not None:
            c = {f: fr.padded // self._chunks for f, fr in enumerate(self._frags)}
            trial = ErrorFeedback(self.codec)
            trial.load_state_dict(fb, device=self._scratch.device, numels=c)  # checked whole first
        # everything checked: apply
        with torch.no_grad():
            for a, fr in zip(anchors, self._frags):
                fr.anchor.copy_(a)
        self.outer.load_state_dict(state["outer"])
        if self.feedback is not None:
            self.feedback.residuals = trial.residuals
        self._step = step
        self._pending = {f: [None, v[0].to(self._scratch.device).clone(), v[1]] for f, v in pending.items()}
        self.skipped = int(state.get("skipped", 0))
        stats = state.get("stats")
        if isinstance(stats, dict):
            self.stats = CommStats(**{k: v for k, v in stats.items() if k in CommStats.__dataclass_fields__})
