"""$LOWBIT_PLUGINS runs code: it is imported only where codecs or algorithms are resolved (not by
`lowbit --help` or a parser), and what it imported is said once per process (issue 32 item 8)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lowbit.cli import build_parser, main
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
