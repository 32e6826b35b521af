"""Every algorithm, lowbit's own and a plugin's, runs through the one registry, and the speed model keeps
the costs of lowbit's algorithms itself instead of patching comm's registry at import (issue 31 item 4)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import lowbit
from lowbit.comm import registry
from lowbit.comm.allreduce import algorithms, get_algorithm, register_algorithm

BUILTINS = ("scatter_gather", "allgather", "allreduce", "simulated", "hierarchical")


def test_every_entry_brings_its_own_start_and_bytes() -> None:
    for name in BUILTINS:
        entry = get_algorithm(name)
        assert entry.start is not None and entry.bytes_per_rank is not None, name
    with pytest.raises(ValueError, match="needs its start and bytes_per_rank"):
        register_algorithm("half_done", lowbit.comm.AlgorithmPlugin(start=lambda *a: None))


@pytest.mark.parametrize("name,spec", [("scatter_gather", "qsgd:bits=8"), ("allgather", "qsgd:bits=8"),
                                       ("allreduce", "fp32"), ("simulated", "qsgd:bits=4")])
def test_a_built_in_runs_through_its_registry_entry(name: str, spec: str) -> None:
    """Replace a built-in's entry with a spy: lowbit.all_reduce must call it (one process, no group)."""
    entry = get_algorithm(name)
    calls = []

    def spy(*args, **kw):  # noqa: ANN002, ANN003
        calls.append(name)
        return entry.start(*args, **kw)

    register_algorithm(name, dataclasses.replace(entry, start=spy))
    try:
        t = torch.randn(1000)
        lowbit.all_reduce(t, spec, algorithm=name)
        if name != "allreduce":
            t = torch.randn(1000)
            lowbit.all_reduce(t, spec, algorithm="auto" if name != "simulated" else name)
    finally:
        register_algorithm(name, entry)
    assert calls and set(calls) == {name}, calls


def test_importing_the_speed_model_leaves_the_registry_alone() -> None:
    code = ("import lowbit.comm.allreduce as A; before = {n: A.get_algorithm(n) for n in A.algorithms()}; "
            "import lowbit.lab.perfmodel; from lowbit.lab.perfmodel.collectives import model_of, modeled_algorithms; "
            "assert {n: A.get_algorithm(n) for n in A.algorithms()} == before; "
            "assert all(A.get_algorithm(n).cost is None for n in A.algorithms()); "
            "assert modeled_algorithms() == ('scatter_gather', 'allgather', 'allreduce', 'hierarchical'); "
            "assert all(model_of(n).cost is not None for n in modeled_algorithms()); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_registry_order_and_flat_entries() -> None:
    assert algorithms()[: len(BUILTINS)] == BUILTINS
    assert [n for n in BUILTINS if get_algorithm(n).flat] == ["scatter_gather", "allgather", "allreduce", "simulated"]
    assert registry.resolve_entry("hierarchical", lowbit.get_codec("qsgd:bits=8"), 1)[0] == "allgather"
    assert registry.resolve_entry("hierarchical", lowbit.get_codec("qsgd:bits=8"), 4)[0] == "hierarchical"
    assert registry.resolve_entry("scatter_gather", lowbit.get_codec("fp16"), 4)[0] == "allreduce"
