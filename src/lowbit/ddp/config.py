"""lowbit.ddp's options: one frozen :class:`DDPConfig`, validated once."""

import dataclasses
from typing import Any, Dict, Optional, Tuple, Union


from lowbit.auto.options import AutoOptions, default_allow
from lowbit.codecs.base import Codec, get_codec
from lowbit.feedback import warn_unless_contracting
from lowbit.comm.allreduce import AUTO, get_algorithm
from lowbit.policy import Policy

_FP32 = get_codec("fp32")


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
    ``hook_thread`` (on for CUDA, unless every message replays a CUDA graph: then inline on a side stream). The module docstring is the tuning guide.

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
        if self.error_feedback:
            warn_unless_contracting(codec, "lowbit.ddp")  # (once per codec)
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
