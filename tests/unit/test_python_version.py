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


def test_source_syntax_parses_as_the_declared_python() -> None:
    """Fast equivalent of test_source_needs_no_newer_python_than_declared (slow; vermin, ~5 s of CPU):
    every module of the package parses with the declared version's grammar (ast's feature_version:
    newer syntax such as ``except*``, ``type`` aliases, PEP 695 generics fails). Newer stdlib modules
    and functions are vermin's part; tomllib's absence is also checked below."""
    import ast

    major, minor = (int(x) for x in _declared().split(".")[:2])
    files = sorted((ROOT / "src" / "lowbit").rglob("*.py"))
    assert len(files) > 50
    for path in files:
        ast.parse(path.read_text(), filename=str(path), feature_version=(major, minor))


@pytest.mark.slow
def test_source_needs_no_newer_python_than_declared() -> None:
    """Fast equivalent (syntax only): test_source_syntax_parses_as_the_declared_python."""
    vermin = shutil.which("vermin") or str(Path(sys.executable).with_name("vermin"))
    if not Path(vermin).exists():
        pytest.skip("vermin is not installed (pip install lowbit[test])")
    target = _declared()
    out = subprocess.run([vermin, f"-t={target}-", "--no-tips", "--violations", "--eval-annotations",
                          str(ROOT / "src" / "lowbit")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_study_config_loads_tomli_without_tomllib(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Fast equivalent of test_cli_and_study_config_work_without_tomllib (slow; a fresh interpreter): a
    fresh copy of lowbit.lab.study.loading (the study's TOML reader), executed here with tomllib hidden as
    on 3.10, takes tomli and reads a preset; the CLI's --help runs with tomllib hidden."""
    import importlib.util

    monkeypatch.setitem(sys.modules, "tomllib", None)
    path = ROOT / "src" / "lowbit" / "lab" / "study" / "loading.py"
    spec = importlib.util.spec_from_file_location("_loading_without_tomllib", path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # (registered, as an imported module is)
    spec.loader.exec_module(mod)
    assert mod.tomllib.__name__ == "tomli"
    assert mod.load_config(None, "smoke", {}).name == "smoke"
    from lowbit.lab.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "usage" in capsys.readouterr().out.lower()


@pytest.mark.slow
def test_cli_and_study_config_work_without_tomllib() -> None:
    """Fast equivalent: test_study_config_loads_tomli_without_tomllib."""
    # Python 3.10 has no tomllib: hide it, as 3.10 would, and use the study's TOML loader and the CLI
    code = ("import sys; sys.modules['tomllib'] = None\n"
            "from lowbit.lab.study import loading\n"
            "print(loading.tomllib.__name__)\n"
            "from lowbit.lab.cli import main\n"
            "raise SystemExit(main(['--help']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "tomli"
    assert "usage" in out.stdout.lower()
