"""A codec's kernels compile (or load from numba's cache) before the first collective, not inside it,
where a cold compile outlasted a short process-group timeout (issue 32 item 12)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

_COUNT = """
import json, sys, numba, torch
import lowbit
import lowbit.kernels.numba as nb
from lowbit.kernels.dispatch import warm_up

def compiled():
    mods = [m for name, m in sys.modules.items() if name.startswith("lowbit.kernels.numba")]
    return sum(len(v.signatures) for m in mods for v in vars(m).values()
               if isinstance(v, numba.core.dispatcher.Dispatcher))

codec = lowbit.get_codec("onebit:bucket=64")
before = compiled()
warm_up(codec)
warmed = compiled()
n = 1 << 20  # what a collective would send: another size, the same kernels
x = torch.randn(n)
p = codec.encode(x, seed=3)
codec.decode(p, n)
codec.decode_sum([p, p, p], n, divide_by=3)
print(json.dumps({"before": before, "warmed": warmed, "used": compiled()}))
"""


def test_warm_up_leaves_nothing_to_compile_for_the_first_exchange() -> None:
    out = subprocess.run([sys.executable, "-c", _COUNT], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "LOWBIT_KERNELS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["warmed"] > got["before"], got  # the count sees compiles (and cache loads)
    assert got["used"] == got["warmed"], got  # encode, decode, decode-and-sum: nothing new to compile


def test_the_study_warms_its_codecs_up_before_any_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lowbit.lab.cli.study as study_cli
    from lowbit.lab.cli import main

    calls: list[str] = []
    monkeypatch.setattr(study_cli, "warm_up", lambda codec, device="cpu": calls.append(f"warm {codec.spec} {device}"))

    def run_study(*args: object, **kwargs: object) -> None:
        calls.append("workers")
        raise study_cli.StudyInterrupted("stop here")

    monkeypatch.setattr(study_cli, "run_study", run_study)
    main(["study", "--networks", "mlp", "--datasets", "digits", "--codecs", "fp32", "onebit:bucket=64",
          "--world-sizes", "2", "--epochs", "1", "--device", "cpu", "--out", str(tmp_path / "out")])
    assert calls == ["warm fp32 cpu", "warm onebit:bucket=64 cpu", "workers"], calls
    calls.clear()  # codec="auto" at the bold level: the codecs it may probe
    main(["study", "--networks", "mlp", "--datasets", "digits", "--codecs", "auto:bold", "--world-sizes", "2",
          "--epochs", "1", "--device", "cpu", "--out", str(tmp_path / "bold")])
    import lowbit
    from lowbit.auto.options import BOLD_ALLOW

    assert calls == [f"warm {lowbit.get_codec(s).spec} cpu" for s in BOLD_ALLOW] + ["workers"], calls


_REGISTER = _COUNT.split("codec = ")[0] + """
import os, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = DDP(torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 10)))
codec = lowbit.get_codec("onebit:bucket=64")
before = compiled()
import warnings; warnings.simplefilter("ignore")
lowbit.ddp.register(model, codec=codec)
warmed = compiled()
n = 1 << 20
x = torch.randn(n)
p = codec.encode(x, seed=3)
codec.decode(p, n)
codec.decode_sum([p, p, p], n, divide_by=3)
dist.destroy_process_group()
print(json.dumps({"before": before, "warmed": warmed, "used": compiled()}))
"""


@pytest.mark.slow  # a fresh interpreter importing torch and numba: ~10-20 s
def test_ddp_register_compiles_the_kernels_before_the_first_step() -> None:
    """A first training run measures true step times: register warms its codecs' kernels up (issue 43:
    examples/train_ddp.py took 412 ms a step for 90 s, numba compiling inside the steps, then 26 ms)."""
    out = subprocess.run([sys.executable, "-c", _REGISTER], capture_output=True, text=True, timeout=600,
                         env={**__import__("os").environ, "LOWBIT_KERNELS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["warmed"] > got["before"], got  # register compiled (or loaded) them
    assert got["used"] == got["warmed"], got  # nothing left for the steps to compile


def test_warm_up_says_when_it_compiles(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import time

    import torch

    import lowbit
    from lowbit.kernels import dispatch

    slow = []
    monkeypatch.setattr(dispatch, "SAY_COMPILING_AFTER_S", 0.05)
    monkeypatch.setattr(dispatch, "warm_up", lambda codec, device="cpu": slow.append(codec.spec) or time.sleep(0.3))
    big, small = torch.zeros(dispatch.NUMBA_MIN_NUMEL), torch.zeros(8)
    dispatch.warm_up_for([lowbit.get_codec("qsgd:bits=3"), None], [small])  # too small for numba: nothing
    assert slow == [] and capsys.readouterr().err == ""
    dispatch.warm_up_for([lowbit.get_codec("qsgd:bits=3"), lowbit.get_codec("qsgd:bits=3")], [big, small])
    assert slow == ["qsgd:bits=3,bucket=512,norm=max,rounding=stochastic"] or len(slow) == 1
    assert "compiling lowbit's cpu kernels once (qsgd:bits=3" in capsys.readouterr().err


def test_stats_count_the_fp32_warm_up_steps_apart() -> None:
    """state.stats says which calls were the uncompressed steps before start_iter (issue 43: its bytes per
    call mixed them in without saying so)."""
    import warnings

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lowbit

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(torch.nn.Linear(16, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (one rank: nothing is exchanged, said once)
            state = lowbit.ddp.register(model, codec="qsgd:bits=8", start_iter=2)
        calls = []
        for _ in range(4):
            model(torch.randn(8, 16)).sum().backward()
            calls.append((state.stats.calls, state.stats.warmup_calls))
        assert calls[1][1] == calls[1][0] > 0  # the first two steps: fp32, all warm-up
        assert calls[3][1] == calls[1][1] and calls[3][0] > calls[1][0]  # then compressed calls, not warm-up
    finally:
        dist.destroy_process_group()


def test_warm_up_runs_under_another_default_device() -> None:
    """A model built under ``with torch.device(...)`` (FSDP2's usual meta or cuda init) calls register,
    and so warm_up, with that default device set: the warm-up's sample must still be made on the CPU
    (it raised "Expected a 'cuda' device type for generator" on the H200)."""
    import torch

    import lowbit
    from lowbit.kernels import dispatch

    for spec in ("qsgd:bits=3,bucket=96", "dettmers:type=linear,bucket=96"):  # specs no other test warms up
        codec = lowbit.get_codec(spec)
        dispatch._WARMED.discard(f"{codec.spec}@cpu")
        with torch.device("meta"):
            dispatch.warm_up(codec, "cpu")
        assert f"{codec.spec}@cpu" in dispatch._WARMED
