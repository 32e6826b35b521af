"""Inputs that used to be taken silently, or crash later, are refused at once with a message naming them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowbit


@pytest.mark.parametrize("spec,msg", [
    ("qsgd:bits=4.0", "must be an integer"),
    ("qsgd:bits=true", "must be an integer"),
    ("qsgd:bits=4,bits=8", "given twice"),
    ("qsgd:bucket=512.5", "bucket"),
    ("dettmers:type=dynamic,type=linear", "given twice"),
])
def test_codec_specs_are_strict(spec: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        lowbit.get_codec(spec)


def test_policy_keys_that_match_nothing_are_errors() -> None:
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 30 * 30, 10))
    with pytest.raises(ValueError, match="Conv2D"):
        lowbit.Policy("qsgd:bits=4", by_type={"Conv2D": "qsgd:bits=8"}).resolve(net)  # typo of Conv2d
    with pytest.raises(ValueError, match=r"head\.\*"):
        lowbit.Policy("qsgd:bits=4", by_name={"head.*": "fp16"}).resolve(net)
    plan = lowbit.Policy("qsgd:bits=4", by_type={"Conv2d": "qsgd:bits=8"}, by_name={"2.*": "fp16"}).resolve(net)
    assert plan["0.weight"].spec.startswith("qsgd:bits=8") and plan["2.weight"].name == "fp16"


@pytest.mark.parametrize("args,msg", [
    (["--samples", "-5"], "--samples must be >= 1"),
    (["--bench-numel", "0"], "--bench-numel must be >= 1"),
    (["--reps", "0"], "--reps must be >= 1"),
    (["--json", "/proc/no/such/x.json"], "cannot write there"),
    (["--codec", "qsgd:bits=4.0"], "must be an integer"),
])
def test_codecs_command_refuses_bad_arguments_in_one_line(args: list[str], msg: str, capsys) -> None:
    from lowbit.lab.cli import main

    assert main(["codecs", "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1, err


def test_a_missing_extra_is_one_line_naming_it() -> None:
    import subprocess
    import sys

    code = ("import sys; sys.modules['sklearn'] = None; sys.modules['sklearn.datasets'] = None\n"
            "from lowbit.lab.cli import main\n"
            "raise SystemExit(main(['codecs', '--quiet', '--samples', '100', '--bench-numel', '1000', '--reps', '1']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr[-2000:]
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and "pip install 'lowbit[study]'" in err and "sklearn" in err, err


def test_one_codec_list_syntax_for_every_command() -> None:
    import argparse

    from lowbit.codecs.base import parse_codec_list
    from lowbit.lab.cli import bench
    from lowbit.lab.cli import study as study_cli

    want = ["fp32", "qsgd:bits=4,bucket=512", "onebit:bucket=64"]
    for values in (["fp32", "qsgd:bits=4,bucket=512", "onebit:bucket=64"],
                   ["fp32;qsgd:bits=4,bucket=512;onebit:bucket=64"],
                   ["fp32,qsgd:bits=4,bucket=512,onebit:bucket=64"],
                   ["fp32 qsgd:bits=4,bucket=512", "onebit:bucket=64"]):
        assert parse_codec_list(values) == want, values
        for register in (bench.register, study_cli.register):
            parser = argparse.ArgumentParser()
            register(parser.add_subparsers(dest="command"))
            cmd = ["bench", "allreduce"] if register is bench.register else ["study"]
            args = parser.parse_args([*cmd, "--codecs", *values])
            assert parse_codec_list(args.codecs) == want, (cmd, values)


def test_onebit_per_column_refuses_sizes_without_a_shape() -> None:
    """onebit:bucket=0 lays its payload out by the tensor's shape: nbytes / head_bytes / decode without
    shape= refuse (issue 14 item 4) instead of answering for a shape they were not told."""
    import lowbit

    c = lowbit.get_codec("onebit:bucket=0")
    x = torch.randn(3, 4)
    p = c.encode(x)
    assert p.numel() == c.nbytes(12, shape=(3, 4)) == 8 * 3 + 2  # 3 columns of 4
    for call in (lambda: c.nbytes(12), lambda: c.head_bytes(12), lambda: c.decode(p, 12)):
        with pytest.raises(ValueError, match="pass shape="):
            call()
    assert c.flat_shape(12) == (12,) and lowbit.get_codec("qsgd:bits=8").flat_shape(12) is None
    assert c.nbytes(12, shape=c.flat_shape(12)) == 8 + 2  # a 1-D tensor is one column


def test_ddp_allreduce_algorithm_refuses_quantised_codecs() -> None:
    """algorithm='allreduce' sums on the wire: with a quantised codec in the plan it would cast, not
    quantise; make_state refuses it by name."""
    with pytest.raises(ValueError, match="sums on the wire"):
        lowbit.ddp.make_state(nn.Linear(200, 200), codec="qsgd:bits=4", algorithm="allreduce")
    lowbit.ddp.make_state(nn.Linear(200, 200), codec="fp16", algorithm="allreduce")  # native: fine
