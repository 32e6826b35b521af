"""MNIST-1D (Greydanus 2020): ten 1-D templates of the digits, warped, shifted and noised.

Generated on the spot by the ``mnist1d`` package's ``make_dataset`` with its default arguments
(5,000 samples, 4,000 train / 1,000 test, 40 positions, generator seed 42) — the canonical data
set, the same for every ``seed`` we are given (shuffling is the loader's job). We never call
``get_dataset``, which would try to download a pickle. Samples are ``(1, 40)`` float32 signals,
already centred and scaled to unit variance by the package.

``make_dataset`` reseeds NumPy's and Python's global RNGs; we save and restore both around the
call so loading data does not perturb anyone else's random stream. Generating takes 7-9 s of CPU on
a 2-core machine, so the arrays are kept twice: in the process (``functools.lru_cache``) and on disk,
in ``$LOWBIT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/lowbit`` or ``~/.cache/lowbit``; ``none`` turns it
off), as ``mnist1d-<package version>-<hash of the generator's arguments>.npz`` with a SHA-256 of its
arrays. A file that is missing, unreadable or whose arrays do not match their hash, or whose shapes,
dtypes or labels are not those the generator's arguments give (float signals, int labels 0-9), is
generated again and replaced (written to a temporary file, then renamed: processes that generate at
once leave one whole file); a cache that cannot be written is skipped (the data are then generated
in every process, as without it).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from lowbit.lab.data.bundle import Dataset
from lowbit.extras import require

__all__ = ["load_mnist1d", "CACHE_DIR_ENV", "cache_dir"]

log = logging.getLogger("lowbit.lab.data")

CACHE_DIR_ENV = "LOWBIT_CACHE_DIR"
_KEYS = ("x", "y", "x_test", "y_test")
_CLASSES = 10  # the package's ten digit templates


def cache_dir() -> Optional[Path]:
    """Where generated data sets are kept between processes (module doc); None when turned off."""
    env = os.environ.get(CACHE_DIR_ENV, "").strip()
    if env.lower() in ("none", "off", "0"):
        return None
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lowbit"


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for k in _KEYS:
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _mismatch(arrays: dict[str, np.ndarray], args: Any) -> Optional[str]:
    """What is wrong with arrays read back for the generator's ``args``, or None: ``make_dataset`` gives
    ``num_samples // 10`` samples of each of the ten digits, the first ``train_split`` of them for training,
    as float signals of ``final_seq_length`` points with int labels 0-9."""
    n = int(args.num_samples) // _CLASSES * _CLASSES
    n_train = int(n * args.train_split)
    want = {"x": (n_train, int(args.final_seq_length)), "x_test": (n - n_train, int(args.final_seq_length)),
            "y": (n_train,), "y_test": (n - n_train,)}
    for k, shape in want.items():
        a, signal = arrays[k], k.startswith("x")
        if a.shape != shape or a.dtype.kind not in ("f" if signal else "iu"):
            return f"{k!r} is {a.dtype} {a.shape}, the arguments give {'float' if signal else 'int'} {shape}"
        if not signal and a.size and (int(a.min()) < 0 or int(a.max()) >= _CLASSES):
            return f"{k!r} holds labels {int(a.min())} to {int(a.max())}, not 0-{_CLASSES - 1}"
    return None


def _read(path: Path, args: Any) -> Optional[dict[str, np.ndarray]]:
    """The cached arrays, or None when the file is missing, not whole or not what ``args`` generate
    (module doc)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in _KEYS}
            digest = str(f["sha256"])
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 — a truncated or foreign file: generated again
        log.info("lowbit: the cached MNIST-1D arrays in %s are unreadable (%s): generating them again", path, exc)
        return None
    if digest != _digest(arrays):
        log.info("lowbit: the cached MNIST-1D arrays in %s do not match their hash: generating them again", path)
        return None
    problem = _mismatch(arrays, args)
    if problem:  # a whole file, but not this data set (written by hand, or by another generator)
        log.info("lowbit: the cached MNIST-1D arrays in %s are not the data set asked for (%s): generating "
                 "them again", path, problem)
        return None
    return arrays


def _write(path: Path, arrays: dict[str, np.ndarray]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, sha256=np.array(_digest(arrays)), **arrays)
            os.chmod(tmp, 0o644)  # (mkstemp's file is the owner's alone)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:  # a read-only or full disk: no cache, the data are still right
        log.info("lowbit: could not cache the MNIST-1D arrays in %s (%s)", path, exc)


@functools.lru_cache(maxsize=1)
def _generate() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, str]:
    m1d = require("mnist1d.data", "study", "the mnist1d data set")
    get_dataset_args, make_dataset = m1d.get_dataset_args, m1d.make_dataset
    args = get_dataset_args()  # the package's defaults: the canonical set
    try:
        version = importlib.metadata.version("mnist1d")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = ""
    where = cache_dir()
    key = hashlib.sha256(json.dumps(vars(args), sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = None if where is None else where / f"mnist1d-{version or 'unknown'}-{key}.npz"
    arrays = None if path is None else _read(path, args)
    if arrays is None:
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            data = make_dataset(args)  # generated locally
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        arrays = {k: np.asarray(data[k]) for k in _KEYS}
        if path is not None:
            _write(path, arrays)
    return arrays["x"], arrays["y"], arrays["x_test"], arrays["y_test"], version


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
        num_classes=_CLASSES,
        in_shape=(1, int(x_tr.shape[1])),
        synthetic=False,
        source="mnist1d.data.make_dataset(get_dataset_args()) — generated locally, no download"
        + (f" (mnist1d {version})" if version else ""),
        meta={"generator_seed": 42},
    )
