""":class:`LocalSGD`: its construction (the options checked, agreed on by every rank, the fragments and
their first anchor broadcast) and the loop (the inner steps counted, each fragment's round run at its
step). The rounds themselves are :mod:`lowbit.localsgd.rounds`'s, the checkpoint
:mod:`lowbit.localsgd.checkpoint`'s; the algorithm is described in :mod:`lowbit.localsgd`."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.agreement import agree
from lowbit.comm.groups import new_subgroup
from lowbit.comm.hierarchical import topology
from lowbit.comm.stats import CommStats
from lowbit.feedback import ErrorFeedback
from lowbit.localsgd.checkpoint import _Checkpoint
from lowbit.localsgd.config import (DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, LocalSGDConfig, OuterFactory,
                                    _check_node_size, _resolve_feedback, default_outer_optimizer)
from lowbit.localsgd.fragments import _Fragment, _reset, _split
from lowbit.localsgd.rounds import _Rounds

__all__ = ["LocalSGD"]


class LocalSGD(_Rounds, _Checkpoint):
    """Local steps with an outer synchronisation every ``local_steps`` inner steps (:mod:`lowbit.localsgd`).

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
            _reset(fr)

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

    @contextlib.contextmanager
    def anchor_weights(self) -> Iterator[None]:
        """Inside the block the model holds the anchor, the weights every rank agreed on at each fragment's
        last synchronisation (to evaluate the model the ranks share); its own weights come back after."""
        saved = [[p.detach().clone() for p in fr.params] for fr in self._frags]
        for fr in self._frags:
            _reset(fr)
        try:
            yield
        finally:
            with torch.no_grad():
                for fr, keep in zip(self._frags, saved):
                    for p, v in zip(fr.params, keep):
                        p.copy_(v)

    # ----------------------------------------------------------------------------- accounting
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
