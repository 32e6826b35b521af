"""The package runs on the oldest Python that pyproject.toml declares (3.10): no newer syntax or module."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    line = next(x for x in text.splitlines() if x.startswith("requires-python"))
    return line.split(">=")[1].strip().strip('"')


def test_source_needs_no_newer_python_than_declared() -> None:
    vermin = shutil.which("vermin") or str(Path(sys.executable).with_name("vermin"))
    if not Path(vermin).exists():
        pytest.skip("vermin is not installed (pip install lowbit[test])")
    target = _declared()
    out = subprocess.run([vermin, f"-t={target}-", "--no-tips", "--violations", "--eval-annotations",
                          str(ROOT / "src" / "lowbit")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cli_and_study_config_work_without_tomllib() -> None:
    # Python 3.10 has no tomllib: hide it, as 3.10 would, and use the study's TOML loader and the CLI
    code = ("import sys; sys.modules['tomllib'] = None\n"
            "from lowbit.study import config\n"
            "print(config.tomllib.__name__)\n"
            "from lowbit.cli import main\n"
            "raise SystemExit(main(['--help']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "tomli"
    assert "usage" in out.stdout.lower()
