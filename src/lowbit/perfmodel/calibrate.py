"""Fit a link's latency and bandwidth to measured timings (least squares on the alpha-beta model).

Point-to-point timings (``world=None``)::

    t = alpha + beta * size

Collective timings on one node of ``world`` ranks use the collective's own step count and bytes,
taken from :mod:`lowbit.perfmodel.collectives` (for the ring allreduce
``t = 2(K-1) alpha + 2(K-1)/K * size * beta``), so the fitted link is the per-step link that
:class:`~lowbit.perfmodel.model.Cluster` expects. The fit minimises squared error in seconds with
``alpha >= 0`` and requires ``beta > 0``; bandwidth = 1 / beta.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lowbit.perfmodel.collectives import Topology, collective
from lowbit.perfmodel.links import Link

__all__ = ["fit_link", "design_row"]

_UNIT = Link(latency_s=1.0, bandwidth_Bps=1.0, name="unit")


def design_row(
    size_bytes: float, world: int | None = None, algorithm: str = "allreduce"
) -> tuple[float, float]:
    """Coefficients ``(a, b)`` of ``t = a * alpha + b * beta`` for one measurement."""
    if world is None:
        return 1.0, float(size_bytes)
    topo = Topology(world, world, _UNIT)
    cost = collective(algorithm, float(size_bytes), topo)
    # With alpha = beta = 1 the cost is steps + bytes; steps is known, so bytes = time - steps.
    return float(cost.steps), cost.time_s - cost.steps


def fit_link(
    sizes_bytes: Sequence[float],
    times_s: Sequence[float],
    *,
    world: int | None = None,
    algorithm: str = "allreduce",
    name: str = "fitted",
) -> Link:
    """Least-squares ``Link`` from measured ``(size, time)`` pairs (see module doc)."""
    sizes = np.asarray(sizes_bytes, dtype=np.float64)
    times = np.asarray(times_s, dtype=np.float64)
    if sizes.shape != times.shape or sizes.ndim != 1:
        raise ValueError(
            f"sizes and times must be 1-D and of equal length, got {sizes.shape} and {times.shape}"
        )
    if len(np.unique(sizes)) < 2:
        raise ValueError("need timings at two or more distinct message sizes to fit latency and bandwidth")
    if not (np.all(np.isfinite(sizes)) and np.all(np.isfinite(times)) and np.all(sizes >= 0)):
        raise ValueError("sizes must be finite and >= 0, times finite")
    if world is not None and world < 2:
        raise ValueError(f"a collective fit needs world >= 2, got {world}")
    rows = np.array([design_row(s, world, algorithm) for s in sizes])
    coef, *_ = np.linalg.lstsq(rows, times, rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0:  # constrained refit through zero latency
        b = rows[:, 1]
        alpha, beta = 0.0, float(b @ times / (b @ b))
    if not (beta > 0 and math.isfinite(beta)):
        raise ValueError("timings do not grow with message size; cannot fit a bandwidth")
    return Link(latency_s=alpha, bandwidth_Bps=1.0 / beta, name=name)
