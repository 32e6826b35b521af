"""`lowbit advise` with a calibration file (the calibrated codec-cost path of the speed model)."""

from __future__ import annotations

from pathlib import Path

from lowbit.lab.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def test_advise_runs_with_a_calibration(tmp_path: Path, capsys) -> None:
    cal = tmp_path / "cal.json"
    assert main(["predict", "--calibrate", str(FIXTURES / "allreduce_nccl_nvlink_2xh200.json"),
                 str(FIXTURES / "study_gpu_2xh200_nvlink"), "--save-calibration", str(cal)]) == 0
    capsys.readouterr()
    assert main(["advise", "--network", "vgg19", "--gpus", "2", "--gpus-per-node", "2", "--calibration", str(cal)]) == 0
    assert "fp32" in capsys.readouterr().out
