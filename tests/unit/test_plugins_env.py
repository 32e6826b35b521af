"""$LOWBIT_PLUGINS runs code: it is imported only where codecs or algorithms are resolved (not by
`lowbit --help` or a parser), and what it imported is said once per process (issue 32 item 8)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lowbit.lab.cli import build_parser, main
from lowbit.codecs.base import get_codec


def _plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> Path:
    marker = tmp_path / f"{name}.ran"
    (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOWBIT_PLUGINS", name)
    return marker


def test_help_and_parsers_do_not_import_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = _plugin(tmp_path, monkeypatch, "lowbit_test_plugin_help")
    build_parser()
    for argv in (["--help"], ["report", "--help"], ["study", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    assert not marker.exists() and "lowbit_test_plugin_help" not in sys.modules


def test_a_plugin_is_imported_where_codecs_resolve_and_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    marker = _plugin(tmp_path, monkeypatch, "lowbit_test_plugin_resolve")
    get_codec("fp32")
    assert marker.read_text() == "x"
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "lowbit_test_plugin_resolve" in x]
    assert len(lines) == 1 and "LOWBIT_PLUGINS" in lines[0] and str(tmp_path) in lines[0], err
    get_codec("qsgd:bits=4")
    assert capsys.readouterr().err == "" and marker.read_text() == "x"


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "mypkg/my_codec.py", ".relative", "a..b",
                                  "1abc", "my-codec"])
def test_a_name_that_is_not_a_module_is_the_documented_error(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/codecs.md: "A name that does not import is an error naming it" — a ValueError, for a path or a
    relative name too (``../../etc/passwd`` was a TypeError from importlib) (issue 44)."""
    monkeypatch.setenv("LOWBIT_PLUGINS", f"{name}")
    with pytest.raises(ValueError, match=r"\$LOWBIT_PLUGINS: .*not a module name") as info:
        get_codec("fp32")
    assert repr(name) in str(info.value)


def test_a_plugin_that_fails_on_import_is_the_documented_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lowbit_test_plugin_raises.py").write_text("raise RuntimeError('broken plugin')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LOWBIT_PLUGINS", "lowbit_test_plugin_raises")
    with pytest.raises(ValueError, match="cannot import plugin 'lowbit_test_plugin_raises'.*broken plugin"):
        get_codec("fp32")
    monkeypatch.setenv("LOWBIT_PLUGINS", "../../etc/passwd")
    assert main(["codecs"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "LOWBIT_PLUGINS" in err and "not a module name" in err, err
