"""The emulated link's latency (issue 45): parsing ``"100mbit@25ms"``, what ``emulate_link`` accepts, and
that a collective across the link holds it for the latency plus the bytes over the speed (the link
thread's job run here on a stand-in collective: no process group needed)."""

from __future__ import annotations

import time

import pytest
import torch

from lowbit.comm import collectives as C
from lowbit.lab.perfmodel.links import parse_emulated_link


@pytest.mark.parametrize("text, want", [
    ("100mbit", (12.5e6, 0.0)),
    ("100mbit@25ms", (12.5e6, 0.025)),
    ("1gbit@5ms", (125e6, 0.005)),
    ("50MB/s@0.5s", (50e6, 0.5)),
    ("1gbit@ 200us", (125e6, 2e-4)),
])
def test_parse_emulated_link(text: str, want: tuple[float, float]) -> None:
    bw, lat = parse_emulated_link(text)
    assert bw == pytest.approx(want[0]) and lat == pytest.approx(want[1])


@pytest.mark.parametrize("text, match", [
    ("100mbit@", "latency after '@'"),
    ("100mbit@fast", "cannot parse latency"),
    ("@5ms", "cannot parse bandwidth"),
    ("100mbit@-1ms", "cannot parse latency"),
    (5, "string"),
])
def test_parse_emulated_link_refuses(text: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_emulated_link(text)  # type: ignore[arg-type]


def test_emulate_link_checks_the_latency_and_resets_it() -> None:
    for bad in (-0.001, float("inf"), float("nan"), "25ms", True):
        with pytest.raises(ValueError, match="latency"):
            C.emulate_link(1e6, bad)  # type: ignore[arg-type]
    try:
        C.emulate_link(1e6, 0.03)
        assert C._LINK == {"bytes_per_s": 1e6, "latency_s": 0.03}
    finally:
        C.emulate_link(None)
    assert C._LINK == {"bytes_per_s": None, "latency_s": 0.0} and not C.link_emulated()


class _Done:
    def wait(self) -> None:
        return None


def _held(bytes_per_s: float, latency_s: float, nbytes: int) -> float:
    """Seconds the link thread's job takes for one collective of ``nbytes`` (the collective itself free)."""
    fut: torch.futures.Future = torch.futures.Future()
    C.emulate_link(bytes_per_s, latency_s)
    try:
        t0 = time.perf_counter()
        C._link_job((lambda: _Done(), nbytes, fut, "all_reduce", None, ()))
        dt = time.perf_counter() - t0
    finally:
        C.emulate_link(None)
    fut.wait()
    return dt


def test_a_collective_holds_the_link_for_latency_plus_bytes_over_speed() -> None:
    plain = _held(1e6, 0.0, 50_000)     # 50 ms of bytes
    slow = _held(1e6, 0.15, 50_000)     # and 150 ms of latency
    assert plain >= 0.05
    assert slow >= 0.20
    assert slow - plain >= 0.14         # the latency is added once per collective, on top of the bytes
    assert _held(1e9, 0.1, 0) >= 0.1    # an empty message pays the latency too
