"""Several tests' bodies in one spawn: a module fixture runs ``spawn(run_parts, world, parts)`` once, and
each test reads its own part with :func:`part`. A process's first DDP, first codec calls and process
group cost seconds on the 2-core machine; sharing one spawn per world size pays them once per module.

``parts``: ``(name, fn, args)`` triples, run in order on every rank as ``fn(rank, world, *args)``. A part
that raises does not stop the others: its traceback is kept and fails the test that reads it."""

from __future__ import annotations

import traceback

import pytest


class Failed:
    """A part that raised in a shared spawn: its traceback, reported by the test that reads the part."""

    def __init__(self, tb: str) -> None:
        self.tb = tb


def run_parts(rank: int, world: int, parts: tuple) -> dict:
    """Every part on this rank (module doc): name -> its result, or :class:`Failed`."""
    out = {}
    for name, fn, args in parts:
        try:
            out[name] = fn(rank, world, *args)
        except Exception:  # noqa: BLE001 — kept for the test that reads this part
            out[name] = Failed(traceback.format_exc())
    return out


def part(ranks: list, name: str) -> list:
    """Every rank's result of part ``name``; the test fails with a rank's traceback if it raised there."""
    for r in ranks:
        if isinstance(r[name], Failed):
            pytest.fail(r[name].tb)
    return [r[name] for r in ranks]
