"""The options of :class:`~lowbit.localsgd.LocalSGD`: the defaults of DiLoCo's outer optimizer, the groups
of ``node_size`` consecutive ranks, and :class:`LocalSGDConfig`, every option validated once (every rank
must agree on them; :mod:`lowbit.localsgd.core` compares them across ranks)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from lowbit.codecs.base import Codec, get_codec
from lowbit.comm import collectives as C
from lowbit.comm.hierarchical import topology
from lowbit.comm.registry import AUTO, SIMULATED, get_algorithm
from lowbit.feedback import feedback_contracts, warn_unless_contracting

__all__ = ["LocalSGDConfig", "OuterFactory", "node_groups", "default_outer_optimizer", "DEFAULT_OUTER_LR",
           "DEFAULT_OUTER_MOMENTUM"]

#: DiLoCo's outer optimizer: SGD, Nesterov momentum, lr 0.7, momentum 0.9.
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9

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


def auto_feedback(codec: Codec) -> bool:
    """Local SGD's ``error_feedback="auto"``: on for biased codecs and for codes of 4 bits or fewer that
    contract (:func:`lowbit.feedback.feedback_contracts`: stochastic 2-bit QSGD does not, its residual
    grows), never for natively summed ones. The study's local SGD rows follow it too."""
    return not codec.sums_on_wire and (codec.biased or (codec.code_bits <= 4 and feedback_contracts(codec)))


def _resolve_feedback(error_feedback: object, codec: Codec) -> bool:
    """``"auto"``: :func:`auto_feedback`. True on a codec that does not contract warns."""
    if error_feedback == "auto":
        return auto_feedback(codec)
    if isinstance(error_feedback, bool):
        if error_feedback and not codec.sums_on_wire:
            warn_unless_contracting(codec, "lowbit.localsgd")
        return error_feedback
    raise ValueError(f"error_feedback must be 'auto', True or False, got {error_feedback!r}")
