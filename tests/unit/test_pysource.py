"""load_dataset("pysource"): the standard library's source as a byte-level LM corpus, split by file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowbit.lab.data import load_dataset
from lowbit.lab.data.pysource import stdlib_files


def test_split_by_file_and_shifted_targets(tmp_path: Path) -> None:
    for i, name in enumerate(["a.py", "b.py", "pkg/c.py", "pkg/d.py", "test/e.py", "site-packages/f.py", "g.txt"]):
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes([65 + i]) * 40)
    d = load_dataset("pysource", seq_len=8, every=2, root=str(tmp_path))
    # files in order a, b, pkg/c, pkg/d (test/, site-packages and .txt left out); b and pkg/d validate
    assert d.meta["files"] == 4 and d.meta["bytes"] == 160
    assert set(d.x_train.unique().tolist()) == {65, 67}
    assert set(d.x_test.unique().tolist()) == {66, 68}
    assert torch.equal(d.y_train[:, :-1], d.x_train[:, 1:])
    assert d.num_classes == 256 and d.in_shape == (8,) and not d.synthetic
    assert len(d.meta["sha256"]) == 64


def test_real_stdlib_package_and_bad_options() -> None:
    """Fast equivalent of test_real_stdlib_slice_and_bad_options (slow: listing the whole standard library
    walks every installed package too, ~5 s): real standard-library source, the email package (root=),
    through the same listing, split and windows; the same bad options."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"]) / "email"
    n = len(stdlib_files(root))
    assert n >= 20  # every 20th file is validation text: at least one
    d = load_dataset("pysource", seq_len=64, root=str(root))
    assert d.meta["files"] == n and d.x_train.shape[1] == 64 and d.x_test.numel() > 0
    assert int(d.x_train.max()) < 256
    with pytest.raises(ValueError, match="seq_len"):
        load_dataset("pysource", seq_len=0)
    with pytest.raises(ValueError, match="every"):
        load_dataset("pysource", every=1)


@pytest.mark.slow
def test_real_stdlib_slice_and_bad_options() -> None:
    """Fast equivalent: test_real_stdlib_package_and_bad_options."""
    d = load_dataset("pysource", seq_len=64, max_files=40)
    assert d.meta["files"] == 40 and d.x_train.shape[1] == 64 and d.x_test.numel() > 0
    assert int(d.x_train.max()) < 256
    with pytest.raises(ValueError, match="seq_len"):
        load_dataset("pysource", seq_len=0)
    with pytest.raises(ValueError, match="every"):
        load_dataset("pysource", every=1)
