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
    import lowbit.cli.study as study_cli
    from lowbit.cli import main

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
    from lowbit.autotune import BOLD_ALLOW

    assert calls == [f"warm {lowbit.get_codec(s).spec} cpu" for s in BOLD_ALLOW] + ["workers"], calls
