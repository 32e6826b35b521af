"""ImageNet (or any class-per-folder image set) from JPEGs on disk, streamed, with the usual augmentation.

Layout under ``data_dir`` (torchvision's ``ImageFolder``; ILSVRC's validation images sorted into class
folders, as ``valprep.sh`` does)::

    train/<class>/<image>.JPEG ...
    val/<class>/<image>.JPEG ...

Classes are the sorted folder names of ``train/``; every ``val/`` folder must be one of them. Nothing is
decoded when loading: ``x_train`` / ``x_test`` are :class:`ImageFolderTensor`\\ s, which behave like
``(N, 3, size, size)`` float32 tensors to the study and to :class:`~lowbit.lab.data.ShardedLoader` and decode
the images a batch asks for, when it asks:

* training images: a random resized crop (scale 0.08-1, aspect 3/4-4/3, as in the Inception and ResNet
  recipes) to ``size`` x ``size`` and a horizontal flip with probability 1/2;
* test images: the shorter side resized to ``size / 0.875`` (256 for 224) and the centre ``size`` crop;
* both standardised with ImageNet's usual per-channel mean and standard deviation.

The crops and flips draw from a generator keyed by (``seed``, batch number), never the global RNG, so a
run is reproducible. Decoding needs Pillow (``pip install lowbit[imagenet]``). ``max_train`` /
``max_test`` keep the first N images (in class then file-name order: take a few per class with
``per_class``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowbit.lab.data.bundle import Dataset
from lowbit.lab.data.ondisk import _data_dir
from lowbit.extras import require

__all__ = ["load_imagenet", "ImageFolderTensor", "IMAGENET_MEAN", "IMAGENET_STD", "IMAGE_SUFFIXES"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")
#: ``.to(device)`` decodes a test view of at most this many images (an evaluation batch) and a training
#: view of at most ``PROBE_MAX`` (a shape probe); larger views (a split) stay lazy and remember the
#: device, so that training images are cropped afresh every time a batch draws them
MATERIALISE_MAX = 4096
PROBE_MAX = 16
_LAYOUT = ("a class-per-folder image set: train/<class>/*.JPEG and val/<class>/*.JPEG (ImageNet with its "
           "validation images sorted into class folders, as torchvision's ImageFolder reads it)")


class ImageFolderTensor:
    """A lazily decoded ``(N, 3, size, size)`` float32 image batch (module doc)."""

    dtype = torch.float32

    def __init__(self, files: list[str], size: int, train: bool, seed: int, device: Any = "cpu",
                 counter: list[int] | None = None) -> None:
        self.files, self.size, self.train, self.seed = files, size, train, seed
        self.device = torch.device(device)
        self._counter = counter if counter is not None else [0]  # batches drawn (shared by views)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((len(self.files), 3, self.size, self.size))

    def __len__(self) -> int:
        return len(self.files)

    def _view(self, files: list[str], device: Any = None) -> ImageFolderTensor:
        return ImageFolderTensor(files, self.size, self.train, self.seed,
                                 self.device if device is None else device, self._counter)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return self._view(self.files[key])
        if isinstance(key, int):
            return self._decode([self.files[key]])[0]
        idx = key.tolist() if isinstance(key, (torch.Tensor, np.ndarray)) else list(key)
        return self._decode([self.files[i] for i in idx])

    def to(self, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if len(self.files) <= (PROBE_MAX if self.train else MATERIALISE_MAX):
            return self._decode(self.files).to(device, *args, **kwargs)
        return self._view(self.files, device)

    def _decode(self, files: list[str]) -> torch.Tensor:
        gen = np.random.default_rng([self.seed, self._counter[0]])
        self._counter[0] += 1
        out = np.empty((len(files), 3, self.size, self.size), dtype=np.float32)
        for i, f in enumerate(files):
            out[i] = _load(f, self.size, gen if self.train else None)
        mean = np.asarray(IMAGENET_MEAN, dtype=np.float32)[:, None, None]
        std = np.asarray(IMAGENET_STD, dtype=np.float32)[:, None, None]
        x = torch.from_numpy((out - mean) / std)
        return x if self.device.type in ("cpu", "meta") else x.to(self.device)


def _load(path: str, size: int, gen: np.random.Generator | None) -> np.ndarray:
    Image = require("PIL.Image", "imagenet", "decoding ImageNet's JPEGs")  # noqa: N806

    try:
        with Image.open(path) as im:
            img = im.convert("RGB")
    except Exception as exc:  # noqa: BLE001 — any unreadable file names itself
        raise ValueError(f"{path}: not a readable image ({type(exc).__name__}: {exc})") from None
    w, h = img.size
    if gen is not None:  # random resized crop, then a flip
        box = None
        for _ in range(10):
            area = w * h * gen.uniform(0.08, 1.0)
            ratio = math.exp(gen.uniform(math.log(3 / 4), math.log(4 / 3)))
            cw, ch = int(round(math.sqrt(area * ratio))), int(round(math.sqrt(area / ratio)))
            if 0 < cw <= w and 0 < ch <= h:
                x0, y0 = int(gen.integers(0, w - cw + 1)), int(gen.integers(0, h - ch + 1))
                box = (x0, y0, x0 + cw, y0 + ch)
                break
        if box is None:  # (a very elongated image) the centre square
            s = min(w, h)
            box = ((w - s) // 2, (h - s) // 2, (w - s) // 2 + s, (h - s) // 2 + s)
        img = img.resize((size, size), Image.BILINEAR, box=box)
        if gen.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
    else:  # resize the shorter side to size / 0.875, then the centre crop
        short = int(round(size / 0.875))
        scale = short / min(w, h)
        nw, nh = max(size, int(round(w * scale))), max(size, int(round(h * scale)))
        img = img.resize((nw, nh), Image.BILINEAR)
        x0, y0 = (nw - size) // 2, (nh - size) // 2
        img = img.crop((x0, y0, x0 + size, y0 + size))
    return np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0


def _split(folder: Path, classes: list[str] | None, per_class: int) -> tuple[list[str], list[int], list[str]]:
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; expected {_LAYOUT}")
    found = sorted(d.name for d in folder.iterdir() if d.is_dir())
    if not found:
        raise ValueError(f"{folder} holds no class folders; expected {_LAYOUT}")
    classes = classes if classes is not None else found
    unknown = sorted(set(found) - set(classes))
    if unknown:
        raise ValueError(f"{folder}: class folders {unknown[:5]} are not among train/'s classes; expected {_LAYOUT}")
    files, labels = [], []
    for c in found:
        imgs = sorted(str(p) for p in (folder / c).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if per_class:
            imgs = imgs[:per_class]
        files += imgs
        labels += [classes.index(c)] * len(imgs)
    if not files:
        raise ValueError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)}) in its class folders; expected {_LAYOUT}")
    return files, labels, classes


def load_imagenet(seed: int = 0, data_dir: str | os.PathLike[str] | None = None, size: int = 224,
                  max_train: int = 0, max_test: int = 0, per_class: int = 0) -> Dataset:
    """ImageNet (any class-per-folder image set) from ``data_dir`` (module doc)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 8:
        raise ValueError(f"imagenet: size must be an int >= 8 (pixels of the square crop), got {size!r}")
    root = _data_dir("imagenet", data_dir, _LAYOUT)
    train, y_train, classes = _split(root / "train", None, per_class)
    val, y_val, _ = _split(root / "val", classes, per_class)
    if max_train:
        train, y_train = train[:max_train], y_train[:max_train]
    if max_test:
        val, y_val = val[:max_test], y_val[:max_test]
    return Dataset(
        name="imagenet",
        label=f"ImageNet-style {len(classes)} classes, {size}x{size} crops ({len(train)} train / {len(val)} val, "
              f"from {root})",
        x_train=ImageFolderTensor(train, size, True, seed),  # type: ignore[arg-type]
        y_train=torch.tensor(y_train, dtype=torch.int64),
        x_test=ImageFolderTensor(val, size, False, seed),  # type: ignore[arg-type]
        y_test=torch.tensor(y_val, dtype=torch.int64),
        num_classes=len(classes),
        in_shape=(3, size, size),
        synthetic=False,
        source=f"JPEG class folders in {root} (decoded per batch)",
        meta={"classes": classes, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "data_dir": str(root),
              "streamed": True},
    )
