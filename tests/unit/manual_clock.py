"""A clock for codec="auto"'s tests (lowbit.auto.clock.Clock, injected through the tuners' ``clock=``)."""

from __future__ import annotations

from typing import Any, Callable


class ManualClock:
    """A clock (lowbit.auto.clock.Clock) that moves only when the test moves it."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now

    def elapsed(self, a: float, b: float) -> float:
        return b - a

    def best_of(self, fn: Callable[[], Any], reps: int = 5) -> float:
        fn()
        return 0.0
