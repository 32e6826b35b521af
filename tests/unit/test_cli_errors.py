"""What a new user hits first on the command line: one-line errors, never a traceback (issue 33 items 4
and 5)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowbit.lab.cli import build_parser, main
from lowbit.extras import MissingExtra, require

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "tests" / "fixtures" / "study_cpu_default" / "results.jsonl"
TINY = ["--quiet", "--samples", "100", "--bench-numel", "1000", "--reps", "1"]


def _one_line(err: str, *want: str) -> None:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in want:
        assert w in lines[0], (w, err)


def _small_results(tmp_path: Path) -> Path:
    rows = [x for x in REAL.read_text().splitlines() if x.strip() and json.loads(x)["kind"] == "run"][:3]
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_an_unknown_kernel_backend_names_the_allowed_ones(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from lowbit.kernels.dispatch import backend_for

    monkeypatch.setenv("LOWBIT_KERNELS", "bogus")
    with pytest.raises(ValueError, match="LOWBIT_KERNELS.*bogus.*reference.*numba.*triton"):
        backend_for(torch.zeros(8), "qsgd_encode")
    assert main(["codecs", "--codec", "qsgd:bits=4", *TINY]) == 2
    _one_line(capsys.readouterr().err, "LOWBIT_KERNELS", "bogus")
    for ok in ("", "reference", "numba", " Numba "):
        monkeypatch.setenv("LOWBIT_KERNELS", ok)
        backend_for(torch.zeros(8), "qsgd_encode")


def test_triton_kernels_forced_without_a_gpu_is_one_line_in_process(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Fast equivalent of test_triton_kernels_forced_without_a_gpu_is_one_line (slow; a fresh interpreter
    importing Triton): the same command here, with LOWBIT_KERNELS=triton, Triton's interpreter off and no
    CUDA: exit 2 with one line naming both variables."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("LOWBIT_KERNELS", "triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["codecs", "--codec", "qsgd:bits=4", *TINY]) == 2
    _one_line(capsys.readouterr().err, "LOWBIT_KERNELS=triton", "TRITON_INTERPRET")


@pytest.mark.slow
def test_triton_kernels_forced_without_a_gpu_is_one_line() -> None:
    """Fast equivalent: test_triton_kernels_forced_without_a_gpu_is_one_line_in_process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["LOWBIT_KERNELS"] = "triton"
    code = ("import sys, torch\n"
            "torch.cuda.is_available = lambda: False\n"
            "from lowbit.lab.cli import main\n"
            f"raise SystemExit(main(['codecs', '--codec', 'qsgd:bits=4', *{TINY!r}]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    _one_line(out.stderr, "LOWBIT_KERNELS=triton", "TRITON_INTERPRET")


def test_report_out_an_existing_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _small_results(tmp_path)
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert main(["report", str(path), "--out", str(taken)]) == 2
    _one_line(capsys.readouterr().err, "--out", str(taken), "not a folder")
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("flag", ["--tensorboard", "--out", "--report-out"])
def test_study_folders_that_are_files_stop_before_any_worker(tmp_path: Path, flag: str,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import lowbit.lab.cli.study as study_cli

    def no_workers(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers started")

    monkeypatch.setattr(study_cli, "run_study", no_workers)
    taken = tmp_path / "taken"
    taken.write_text("mine")
    args = ["study", "--networks", "mlp", "--datasets", "digits", "--codecs", "fp32", "--epochs", "1",
            "--out", str(tmp_path / "out"), flag, str(taken)]
    assert main(args) == 2
    _one_line(capsys.readouterr().err, flag, str(taken), "not a folder")


def test_export_tensorboard_to_an_existing_file_is_one_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tensorboard")
    path = _small_results(tmp_path)
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert main(["export", str(path), "--tensorboard", str(taken)]) == 2
    _one_line(capsys.readouterr().err, "--tensorboard", "not a folder")


def test_a_closed_pipe_is_not_a_traceback_in_process(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Fast equivalent of test_a_closed_pipe_is_not_a_traceback (slow; a fresh interpreter): the same
    command here, its stdout a pipe whose reader is already gone: no traceback, exit 0 or 1, and stdout
    pointed elsewhere so that a last flush (the interpreter's, at exit) no longer fails."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    pipe = os.fdopen(write_fd, "w")
    monkeypatch.setattr(sys, "stdout", pipe)
    try:
        code = main(["predict", "--dettmers"])
        pipe.write("x")
        pipe.flush()  # after lowbit's recipe the fd is /dev/null: this flush would raise on the dead pipe
    finally:
        monkeypatch.undo()
        pipe.close()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert code in (0, 1), (code, err)


@pytest.mark.slow
def test_a_closed_pipe_is_not_a_traceback() -> None:
    """`lowbit ... | head`: the reader goes away before lowbit writes (the Python docs' SIGPIPE recipe).
    Fast equivalent: test_a_closed_pipe_is_not_a_traceback_in_process."""
    proc = subprocess.Popen([sys.executable, "-m", "lowbit", "predict", "--dettmers"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # before Python has even started: every write of lowbit's meets a closed pipe
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert proc.returncode in (0, 1), (proc.returncode, err)


def _options_with_list_syntax() -> dict[tuple[str, ...], str]:
    """Every (command, option) whose help promises the codec-list syntax of every lowbit command."""
    found = {}

    def walk(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif action.help and "as for every lowbit command" in " ".join(action.help.split()):
                found[path] = action.option_strings[-1]

    walk(build_parser(), ())
    return found


def test_every_option_that_promises_the_codec_list_syntax_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from lowbit.lab.cli import codecs as codecs_cli
    from lowbit.codecs.base import parse_codec_list

    found = _options_with_list_syntax()
    assert found == {("study",): "--codecs", ("bench", "allreduce"): "--codecs", ("codecs",): "--codec"}, found
    want = ["qsgd:bits=4", "onebit:bucket=64"]
    parser = build_parser()
    for cmd, option in found.items():
        for values in (["qsgd:bits=4;onebit:bucket=64"], ["qsgd:bits=4", "onebit:bucket=64"],
                       ["qsgd:bits=4,onebit:bucket=64"]):
            argv = [*cmd, *[x for v in values for x in (option, v)]]
            args = parser.parse_args(argv)
            given = getattr(args, option.lstrip("-").replace("-", "_"))
            specs = codecs_cli.specs(args) if cmd == ("codecs",) else parse_codec_list(given)
            assert specs == want, (argv, specs)
    measured = []
    monkeypatch.setattr(codecs_cli, "measure", lambda specs, *a, **k: measured.append(specs) or [])
    monkeypatch.setattr(codecs_cli, "format_table", lambda rows: "")
    assert main(["codecs", "--codec", "qsgd:bits=4;onebit:bucket=64", *TINY]) == 0
    assert measured == [want]


@pytest.mark.parametrize("module,dist", [("sklearn.datasets", "scikit-learn"), ("PIL.Image", "pillow")])
def test_a_missing_extra_names_the_package_pip_installs(module: str, dist: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, module.split(".")[0], None)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingExtra) as exc:
        require(module, "study", "something")
    msg = str(exc.value)
    assert "pip install 'lowbit[study]'" in msg
    top = module.split(".")[0]
    assert f"pip install {top}" not in msg and f"pip install {dist}" in msg, msg


@pytest.mark.parametrize("nest", [("[", "]"), ("{b = ", "}")])
def test_a_deeply_nested_study_config_is_not_valid_toml_in_one_line(tmp_path: Path, nest: tuple[str, str],
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A TOML nested thousands deep overflows the parser's recursion: the same one-line error as any other
    TOML that does not parse, not a RecursionError's traceback (issue 44)."""
    config = tmp_path / "deep.toml"
    config.write_text("a = " + nest[0] * 5000 + "1" + nest[1] * 5000 + "\n")
    assert main(["study", "--config", str(config), "--dry-run", "--out", str(tmp_path / "out")]) == 2
    _one_line(capsys.readouterr().err, "lowbit study: error:", str(config), "not valid TOML", "nested")


def test_lowbit_codecs_is_quick_by_default_and_paper_sized_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default table takes seconds (issue 43: 25M samples a distribution took 5 minutes); --paper
    asks for Table 2's 25M; both at once is one clear error."""
    from lowbit.lab.cli import codecs as codecs_cli

    seen = []
    monkeypatch.setattr(codecs_cli, "measure", lambda specs, samples, *a, **k: seen.append(samples) or [])
    monkeypatch.setattr(codecs_cli, "format_table", lambda rows: "")
    assert main(["codecs", "--quiet"]) == 0
    assert main(["codecs", "--quiet", "--paper"]) == 0
    assert main(["codecs", "--quiet", "--samples", "5000"]) == 0
    assert seen == [codecs_cli.QUICK_SAMPLES, codecs_cli.PAPER_SAMPLES, 5000]
    assert codecs_cli.QUICK_SAMPLES <= 1_000_000 < codecs_cli.PAPER_SAMPLES
    assert main(["codecs", "--quiet", "--paper", "--samples", "5000"]) == 2
