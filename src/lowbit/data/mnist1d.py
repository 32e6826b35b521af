"""MNIST-1D (Greydanus 2020): ten 1-D templates of the digits, warped, shifted and noised.

Generated on the spot by the ``mnist1d`` package's ``make_dataset`` with its default arguments
(5,000 samples, 4,000 train / 1,000 test, 40 positions, generator seed 42) — the canonical data
set, the same for every ``seed`` we are given (shuffling is the loader's job). We never call
``get_dataset``, which would try to download a pickle. Samples are ``(1, 40)`` float32 signals,
already centred and scaled to unit variance by the package.

``make_dataset`` reseeds NumPy's and Python's global RNGs; we save and restore both around the
call so loading data does not perturb anyone else's random stream. The arrays are generated once
per process (about a second) and cached.
"""

from __future__ import annotations

import functools
import importlib.metadata
import random

import numpy as np
import torch

from lowbit.data.bundle import Dataset
from lowbit.extras import require

__all__ = ["load_mnist1d"]


@functools.lru_cache(maxsize=1)
def _generate() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    m1d = require("mnist1d.data", "study", "the mnist1d data set")
    get_dataset_args, make_dataset = m1d.get_dataset_args, m1d.make_dataset
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(get_dataset_args())  # default args, generated locally
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    try:
        version = importlib.metadata.version("mnist1d")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = ""
    return data["x"], data["y"], data["x_test"], data["y_test"], version


def load_mnist1d(seed: int = 0) -> Dataset:
    """The canonical MNIST-1D data set (``seed`` is accepted for a uniform interface, not used)."""
    del seed  # the package's own generator seed (42) defines the canonical data set
    x_tr, y_tr, x_te, y_te, version = _generate()

    def xs(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).unsqueeze(1)

    def ys(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64))

    return Dataset(
        name="mnist1d",
        label=f"MNIST-1D ({len(y_tr)} train / {len(y_te)} test, 40-point signals, generated offline)",
        x_train=xs(x_tr),
        y_train=ys(y_tr),
        x_test=xs(x_te),
        y_test=ys(y_te),
        num_classes=10,
        in_shape=(1, int(x_tr.shape[1])),
        synthetic=False,
        source="mnist1d.data.make_dataset(get_dataset_args()) — generated locally, no download"
        + (f" (mnist1d {version})" if version else ""),
        meta={"generator_seed": 42},
    )
