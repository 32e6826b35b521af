"""scikit-learn's 8x8 handwritten digits (UCI optdigits test set), shipped with scikit-learn.

1,797 grey-level 8x8 images (values 0-16) of the digits 0-9, read from the copy inside the
``sklearn`` package: no download. Split 80/20, stratified by class, with ``seed`` choosing the
split (1,437 train / 360 test), then standardised with the training set's mean and standard
deviation (one scalar each, so the image structure a CNN sees is kept). Samples are ``(1, 8, 8)``
float32; the MLP flattens them to 64 inputs.
"""

from __future__ import annotations

import numpy as np
import torch

from lowbit.lab.data.bundle import Dataset
from lowbit.extras import require

__all__ = ["load_digits"]


def load_digits(seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """The digits data set, split by ``seed`` (stratified) and standardised on the training split."""
    _sk_load_digits = require("sklearn.datasets", "study", "the digits data set").load_digits
    train_test_split = require("sklearn.model_selection", "study", "the digits data set").train_test_split

    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    x, y = _sk_load_digits(return_X_y=True)  # (1797, 64) float64 in [0, 16], (1797,) int
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=test_fraction, stratify=y, random_state=seed
    )
    mean, std = float(x_tr.mean()), float(x_tr.std())

    def prep(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((a - mean) / std).astype(np.float32)).reshape(-1, 1, 8, 8)

    return Dataset(
        name="digits",
        label=f"digits 8x8 (scikit-learn; {len(y_tr)} train / {len(y_te)} test, split seed {seed})",
        x_train=prep(x_tr),
        y_train=torch.from_numpy(y_tr.astype(np.int64)),
        x_test=prep(x_te),
        y_test=torch.from_numpy(y_te.astype(np.int64)),
        num_classes=10,
        in_shape=(1, 8, 8),
        synthetic=False,
        source="sklearn.datasets.load_digits (UCI optdigits, bundled with scikit-learn)",
        meta={"mean": mean, "std": std, "split_seed": seed},
    )
