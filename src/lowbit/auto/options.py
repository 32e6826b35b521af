"""``codec="auto"``'s options, shared by DDP and FSDP: the levels, the codecs each allows, their check.

    lowbit.ddp.register(model, codec="auto")                        # conservative: fp32, bf16, 8-bit QSGD
    lowbit.ddp.register(model, codec="auto", auto_level="bold")     # ... and 4-bit QSGD, 1bitSGD*
    lowbit.fsdp.register(model, codec="auto", allow=["bf16"], error_budget=2.0)

:class:`AutoOptions` is the base of :class:`lowbit.ddp.DDPConfig` and :class:`lowbit.fsdp.FSDPConfig`
(each adds its own options and validates all of them once, at construction). The levels are named
recipes: ``"conservative"`` (the default) keeps within uniform 8-bit QSGD's error; ``"bold"`` also
allows 4-bit QSGD and 1bitSGD* with error feedback, up to the gradients' own sampling noise between the
ranks for the unbiased codecs (:mod:`lowbit.auto.decide` has the limits).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["AUTO_LEVELS", "DEFAULT_ALLOW", "BOLD_ALLOW", "BASELINE", "DDP_WORDS", "FSDP_WORDS", "AutoOptions",
           "default_allow", "check_auto_options"]

#: how far ``codec="auto"`` may go (``auto_level``): "conservative" (the default) keeps within uniform 8-bit
#: QSGD's error; "bold" also allows 4-bit QSGD and 1bitSGD* with error feedback, up to the gradients' own
#: sampling noise between the ranks (module doc)
AUTO_LEVELS = ("conservative", "bold")
#: what ``codec="auto"`` chooses among unless told otherwise
DEFAULT_ALLOW = ("fp32", "bf16", "qsgd:bits=8,bucket=512")
#: ... and with ``auto_level="bold"`` (1bitSGD* gets error feedback from ``error_feedback="auto"``)
BOLD_ALLOW = DEFAULT_ALLOW + ("qsgd:bits=4,bucket=512", "onebit:bucket=64")
#: the error budget is relative to this codec everywhere (L-GreCo's uniform baseline)
BASELINE = "qsgd:bits=8,bucket=512"


def default_allow(level: str = "conservative") -> tuple[str, ...]:
    """The codecs ``codec="auto"`` chooses among at ``level`` unless ``allow`` says otherwise."""
    return BOLD_ALLOW if level == "bold" else DEFAULT_ALLOW


def check_auto_options(allow: Any, error_budget: Any, level: Any, guard_every: Any, *, always: str = "fp32",
                       budget_of: str = "uniform 8-bit QSGD's error") -> None:
    """Raise a ``ValueError`` naming the first of ``codec="auto"``'s shared options that is out of range:
    ``level`` (``auto_level``: one of :data:`AUTO_LEVELS`), ``guard_every`` (an int >= 0), ``allow`` (None
    or a list or tuple of codecs, not empty: ``always`` is allowed anyway) and ``error_budget`` (None or
    a number > 0 that multiplies ``budget_of``). The one check of them for DDP (:class:`lowbit.ddp.
    DDPConfig`, :class:`lowbit.auto.ddp_tuner.AutoTuner`; the defaults' wording) and FSDP
    (``lowbit.fsdp.register``, :class:`lowbit.auto.fsdp_tuner.FSDPAuto`: :data:`FSDP_WORDS`). What each codec in
    ``allow`` must be differs between them: their callers check it."""
    if not isinstance(level, str) or level not in AUTO_LEVELS:
        raise ValueError(f"auto_level must be one of {', '.join(map(repr, AUTO_LEVELS))} ('conservative', the "
                         f"default: at most {budget_of}; 'bold': also 4-bit QSGD and 1bitSGD with error feedback, "
                         f"up to the gradients' own sampling noise), got {level!r}")
    if isinstance(guard_every, bool) or not isinstance(guard_every, int) or guard_every < 0:
        raise ValueError(f"guard_every must be an int >= 0 (steps between codec='auto''s guard checks; 0: no "
                         f"guard), got {guard_every!r}")
    if isinstance(allow, str):
        raise ValueError(f"allow must be a list of codec specs, got the string {allow!r}")
    if allow is not None and not isinstance(allow, (list, tuple)):
        raise ValueError(f"allow must be a list of codec specs, got {allow!r}")
    if allow is not None and not allow:
        raise ValueError(f"allow must name at least one codec ({always} is always allowed)")
    eb = error_budget
    if eb is not None and (isinstance(eb, bool) or not isinstance(eb, (int, float)) or not eb > 0):
        raise ValueError(f"error_budget must be a number > 0 (times {budget_of}; with auto_level='bold', the "
                         f"larger of that and the gradients' sampling noise) or None, got {eb!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoOptions:
    """``codec="auto"``'s options that DDP and FSDP share, written once: the base of
    :class:`lowbit.ddp.DDPConfig` and :class:`lowbit.fsdp.FSDPConfig`, which add their own options and
    validate all of them once, at construction (:meth:`check_auto`, in each integration's words).

    ``auto_level``: how far auto may go (:data:`AUTO_LEVELS`); ``guard_every``: steps between the guard's
    checks (0: no guard); ``allow``: the codecs to choose among (None: the level's, :func:`default_allow`;
    a list is kept as a tuple); ``error_budget``: the admission limit's factor (None: no limit)."""

    auto_level: str = "conservative"
    guard_every: int = 50
    allow: Optional[tuple[Any, ...]] = None
    error_budget: Optional[float] = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.allow, (list, tuple)):
            object.__setattr__(self, "allow", tuple(self.allow))  # (a list is fine to pass; frozen keeps a tuple)

    @classmethod
    def auto_names(cls) -> tuple[str, ...]:
        """The options of this class that go with ``codec="auto"`` only (a subclass adds its own)."""
        return tuple(f.name for f in dataclasses.fields(AutoOptions))

    def auto_given(self) -> list[str]:
        """The auto-only options (:meth:`auto_names`) set to something other than their defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [n for n in self.auto_names() if getattr(self, n) != defaults[n]]

    def check_auto(self, auto: bool, codec: Any, *, always: str = "fp32",
                   budget_of: str = "uniform 8-bit QSGD's error") -> None:
        """Raise a ``ValueError`` naming the first auto option out of range (:func:`check_auto_options`,
        with ``always`` and ``budget_of`` in the integration's words), or, when ``auto`` is False, the auto
        options given with another ``codec``."""
        if not auto:
            given = self.auto_given()
            if given:
                names = ", ".join(f"{n}=" for n in self.auto_names())
                raise ValueError(f"{names} go with codec='auto', but codec is {codec!r} and "
                                 f"{', '.join(f'{n}={getattr(self, n)!r}' for n in given)} was given")
            return
        check_auto_options(self.allow, self.error_budget, self.auto_level, self.guard_every, always=always,
                           budget_of=budget_of)

    @classmethod
    def of(cls, config: Any = None, /, **options: Any) -> Any:
        """``config`` as it is, or one built from ``options`` (what ``register(model, config=None,
        **options)`` does with its keywords). An option this class does not have is a ``TypeError``
        naming it; ``config`` together with options is a ``ValueError`` (which would win is not obvious)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"{cls.__name__} has no option {unknown[0]!r} (its options: {', '.join(names)})")
        if config is None:
            return cls(**options)
        if not isinstance(config, cls):
            raise ValueError(f"config must be a {cls.__module__}.{cls.__name__}, got {type(config).__name__}")
        if options:
            raise ValueError(f"pass config= or the options ({', '.join(sorted(options))}), not both")
        return config


#: how :func:`check_auto_options` words its errors for each integration: what is always allowed and
#: what the error budget multiplies
DDP_WORDS = {"always": "fp32", "budget_of": "uniform 8-bit QSGD's error"}
FSDP_WORDS = {"always": "native, FSDP's own reduce-scatter,", "budget_of": "8-bit QSGD's error on each module"}
