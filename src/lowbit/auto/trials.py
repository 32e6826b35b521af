"""``codec="auto"``'s trials: the finalists run on the job's own steps and are timed, one rule for DDP
and FSDP.

    trials = Trials(len(finalists), clock)
    # at the start of every step (a training forward pass), on every rank:
    got = trials.step(group)
    if got is None:              # over: trials.times[i] is finalist i's agreed step time
        ...decide...
    elif got.begins:             # finalist got.finalist runs from this step on
        apply(finalists[got.finalist])

The procedure:

1. **Blocks.** Each finalist in turn runs one warm-up step, then ``steps`` (default 2) timed steps, each
   from one forward start to the next (the whole step). The warm-up keeps a switch's one-time costs out
   of the timed steps: the first step of a new plan rebuilds DDP's message groups, and a tensor whose
   codec changes starts with an empty error-feedback residual.
2. **Per rank**, a finalist's time is the median of its timed steps (with two, their mean).
3. **Agree**: when a pass ends, the ranks' times are gathered and averaged in rank order
   (:func:`lowbit.auto.estimates.agree`), so every rank holds the same numbers. A synchronous step
   lasts as long on every rank (each waits at its collectives), so the ranks read the same quantity
   with their own noise, which the mean reduces.
4. **Second pass.** When two or more finalists measured within ``retry_within`` (10 %) of the fastest
   (:func:`close_finalists`, on the agreed times: every rank alike), those run again, in reverse order
   (a drift over the trials weighs on both ends alike), one warm-up and ``steps`` timed steps each, and
   count with the mean of their two passes (:func:`mean_of_passes`; :attr:`Trials.retried`).

Why this rule (the evidence, docs/ddp.md "codec=auto", docs/fsdp.md "codec=auto"): two timed steps
cannot separate finalists within about 10 % (2x H200 over sockets, ResNet-50, one job: one level's
trials measured 8-bit QSGD at 39.8 ms a step and bf16 at 42.6 ms, the other level's 42.9 and 39.1 ms;
``benchmarks/results/ddp_2xNVIDIA_H200_sockets_auto29_resnet50_gpt2_small.json``; FSDP's bold trials
over NVLink put 4-bit QSGD at 171 ms and 8-bit at 182 ms where the fixed codecs ran 169 and 147 ms,
``fsdp_auto_2xNVIDIA_H200_nvlink_gpt_350m.json``), so the close ones get twice the steps, and only
they. FSDP used to time rounds (every finalist one step in turn, a rank's fastest step, the slowest
rank's): every timed step then followed a switch, so 1bitSGD* was timed with an empty residual on each,
and the slowest of the ranks' readings adds the upper tail of their noise instead of reducing it. The
blocks' drift is what the reverse second pass balances where it matters.

A pass of ``n`` finalists takes ``n * (1 + steps)`` steps; all of them, at most twice that
(:func:`most_steps`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch.distributed as dist

from lowbit.auto.clock import Clock
from lowbit.auto.estimates import agree

__all__ = ["TRIAL_STEPS", "RETRY_WITHIN", "TrialStep", "Trials", "close_finalists", "mean_of_passes", "most_steps"]

#: timed steps per finalist and pass (after one warm-up step)
TRIAL_STEPS = 2
#: finalists whose first-pass times are within this share of the fastest run a second pass
RETRY_WITHIN = 0.10


class TrialStep(NamedTuple):
    """What the step that starts now runs: ``finalist`` (an index), and whether it ``begins`` there (its
    warm-up step: apply its plan now)."""

    finalist: int
    begins: bool


def close_finalists(times: Sequence[float], within: float) -> list[int]:
    """The finalists (indices into ``times``, their first pass's agreed step times) measured within
    ``within`` of the fastest (time <= fastest * (1 + within)), when at least two are: those run a second
    pass; else none. Non-finite times are never close."""
    finite = [t for t in times if math.isfinite(t)]
    if not finite:
        return []
    limit = min(finite) * (1 + within)
    close = [i for i, t in enumerate(times) if math.isfinite(t) and t <= limit]
    return close if len(close) > 1 else []


def mean_of_passes(first: Sequence[float], retried: Sequence[int], second: Sequence[float]) -> list[float]:
    """Every finalist's trial time: its first pass's (``first``), or for those run again (``retried``,
    indices in the order the second pass ran them; ``second``, their times in that order) the mean of
    its two passes.

    Raises:
        ValueError: ``retried`` and ``second`` differ in length."""
    out = list(first)
    for i, t in zip(retried, second, strict=True):
        out[i] = (first[i] + t) / 2
    return out


def most_steps(n: int, steps: int = TRIAL_STEPS) -> int:
    """The steps the trials of ``n`` finalists take at most (every one of them in the second pass)."""
    return 2 * (1 + steps) * n


class Trials:
    """The trials of ``n`` finalists (module doc), timed on ``clock``; drive it with :meth:`step` at the
    start of every step, on every rank.

    Args:
        n: the number of finalists (at least 1).
        clock: where time is read (:class:`lowbit.auto.clock.DeviceClock`, or a test's).
        steps: timed steps per finalist and pass (at least 1).
        retry_within: the share of the fastest within which finalists run a second pass.

    Raises:
        ValueError: ``n`` or ``steps`` below 1."""

    def __init__(self, n: int, clock: Clock, *, steps: int = TRIAL_STEPS, retry_within: float = RETRY_WITHIN) -> None:
        if n < 1 or steps < 1:
            raise ValueError(f"lowbit codec='auto' trials need at least one finalist and one timed step, got "
                             f"{n} finalists and steps={steps}")
        self.n, self.clock, self.steps, self.retry_within = n, clock, steps, retry_within
        self.order = list(range(n))  # the finalists this pass runs, in order
        self.first: Optional[list[float]] = None  # the first pass's agreed times (once it is over)
        self.times: Optional[list[float]] = None  # every finalist's agreed time (once the trials are over)
        self.retried: tuple[int, ...] = ()  # the finalists that ran a second pass (indices, ascending)
        self._at = 0  # position in order
        self._marks: list[Any] = []  # the running finalist's step starts
        self._mine: list[float] = []  # this rank's times of this pass, in order

    @property
    def done(self) -> bool:
        return self.times is not None

    @property
    def second_pass(self) -> bool:
        """Whether the second pass is running (or ran)."""
        return self.first is not None

    def step(self, group: Optional[dist.ProcessGroup]) -> Optional[TrialStep]:
        """At the start of a step (a training forward pass): what this step runs, or None once the trials
        are over (:attr:`times`, :attr:`retried`). The step that ends a pass agrees on its times over
        ``group`` (a collective: every rank calls it at the same step)."""
        if self.done:
            return None
        now = self.clock.mark()
        if self._marks:
            self._marks.append(now)
            if len(self._marks) < self.steps + 2:  # its warm-up and timed steps are not over
                return TrialStep(self.order[self._at], False)
            periods = [self.clock.elapsed(a, b) for a, b in zip(self._marks[1:], self._marks[2:])]
            self._mine.append(statistics.median(periods))
            self._at, self._marks = self._at + 1, []
            if self._at == len(self.order) and self._end_pass(group):
                return None
        self._marks = [now]  # this step starts the next finalist's warm-up
        return TrialStep(self.order[self._at], True)

    def _end_pass(self, group: Optional[dist.ProcessGroup]) -> bool:
        """Agree on the pass's times; start the second pass where it is due. True when the trials are over."""
        got = [float(t) for t in agree(self._mine, group)]
        self._at, self._mine = 0, []
        if self.first is None:
            close = close_finalists(got, self.retry_within)
            if close:
                self.first, self.order = got, close[::-1]
                return False
            self.times = got
            return True
        self.times = mean_of_passes(self.first, self.order, got)
        self.retried = tuple(sorted(self.order))
        return True
