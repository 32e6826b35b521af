"""lowbit.lab.data.imagenet on small files generated in ImageNet's on-disk layout (class-per-folder JPEGs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lowbit.lab.data import ShardedLoader, load_dataset
from lowbit.lab.data.imagenet import IMAGENET_MEAN, IMAGENET_STD

Image = pytest.importorskip("PIL.Image")

CLASSES = ["n01440764", "n01443537", "n01484850"]


def _make(root: Path, per_class: int = 6, val_per_class: int = 2) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("val", val_per_class)):
        for c, wnid in enumerate(CLASSES):
            d = root / split / wnid
            d.mkdir(parents=True)
            for i in range(n):
                h, w = int(rng.integers(40, 80)), int(rng.integers(40, 80))  # ImageNet's sizes vary
                px = np.full((h, w, 3), 60 * c, dtype=np.uint8)
                px[:, : w // 2, i % 3] = 255  # something to crop and flip
                Image.fromarray(px).save(d / f"{wnid}_{i}.JPEG", quality=95)


def test_reads_the_layout_streams_and_augments(tmp_path: Path) -> None:
    _make(tmp_path)
    ds = load_dataset("imagenet", data_dir=tmp_path, size=32)
    assert ds.num_classes == 3 and ds.in_shape == (3, 32, 32) and ds.meta["classes"] == CLASSES
    assert ds.x_train.shape == (18, 3, 32, 32) and ds.x_test.shape == (6, 3, 32, 32)
    assert ds.y_train.tolist() == [0] * 6 + [1] * 6 + [2] * 6 and ds.y_test.tolist() == [0, 0, 1, 1, 2, 2]
    # a batch decodes on demand, standardised; two draws of one training image differ (random crops / flips)
    a, b = ds.x_train[torch.tensor([0, 1])], ds.x_train[torch.tensor([0, 1])]
    assert a.shape == (2, 3, 32, 32) and a.dtype == torch.float32 and not torch.equal(a, b)
    # the test split is deterministic: resize + centre crop; class 2's grey level comes back
    t1, t2 = ds.x_test[4:6].to("cpu"), ds.x_test[4:6].to("cpu")
    assert torch.equal(t1, t2)
    grey = (120 / 255 - IMAGENET_MEAN[2]) / IMAGENET_STD[2]
    assert t1[:, 2, :, -4:].mean().item() == pytest.approx(grey, abs=0.05)  # the right half: untouched grey
    # reproducible: the same seed draws the same crops in the same order
    again = load_dataset("imagenet", data_dir=tmp_path, size=32)
    assert torch.equal(again.x_train[torch.tensor([0, 1])], a)
    # the study's loader takes it like an in-memory tensor
    xb, yb = next(iter(ShardedLoader(ds.x_train, ds.y_train, batch_size=4, rank=1, world_size=2, seed=0)))
    assert xb.shape == (4, 3, 32, 32) and yb.shape == (4,)
    lazy = ds.x_train.to("cpu")  # a training split stays lazy: crops are drawn afresh per batch
    assert not isinstance(lazy, torch.Tensor) and lazy.shape == (18, 3, 32, 32)
    assert isinstance(ds.x_train[:2].to("meta"), torch.Tensor)  # a shape probe (the study's FLOP count)
    assert isinstance(ds.x_test.to("cpu"), torch.Tensor)  # evaluation batches decode
    assert load_dataset("imagenet", data_dir=tmp_path, size=32, per_class=1).x_train.shape[0] == 3


def test_a_wrong_layout_names_the_expected_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="train/<class>"):
        load_dataset("imagenet", data_dir=tmp_path, size=32)  # no train/
    _make(tmp_path)
    (tmp_path / "val" / "n99999999").mkdir()
    with pytest.raises(ValueError, match="not among train/'s classes"):
        load_dataset("imagenet", data_dir=tmp_path, size=32)
    (tmp_path / "val" / "n99999999").rmdir()
    (tmp_path / "train" / CLASSES[0] / "broken.JPEG").write_bytes(b"not a jpeg")
    ds = load_dataset("imagenet", data_dir=tmp_path, size=32)
    with pytest.raises(ValueError, match="not a readable image"):
        ds.x_train[torch.arange(5)]
    with pytest.raises(ValueError, match="size"):
        load_dataset("imagenet", data_dir=tmp_path, size=4)
