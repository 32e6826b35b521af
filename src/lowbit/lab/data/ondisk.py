"""The seeds' data sets from copies on disk, in their standard formats (nothing downloads).

========= ================================================================= ============ =======
name      files under ``data_dir``                                          sample       classes
========= ================================================================= ============ =======
mnist     ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,          (1, 28, 28)  10
          ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each may
          end in ``.gz``; LeCun's idx format)
cifar10   ``data_batch_1`` ... ``data_batch_5``, ``test_batch`` (the         (3, 32, 32)  10
          "python version" pickles; ``data_dir`` may be their folder or the
          folder holding ``cifar-10-batches-py``)
========= ================================================================= ============ =======

``data_dir`` comes from the loader's option (``load_dataset("cifar10", data_dir=...)``; in a study,
``[dataset_args.cifar10] data_dir = "..."``), else from ``$LOWBIT_DATA_DIR/<name>``. Images are scaled
to [0, 1] and standardised with the training split's mean and standard deviation (MNIST: one scalar;
CIFAR-10: per channel), as the seeds' recipes do. The official train / test split is kept; ``seed`` is
unused (accepted for the common loader signature). A missing file or a file of the wrong format is a
``ValueError`` that names the layout expected; an idx file is read no further than its header declares
(at most ``IDX_MAX_BYTES``, 1 GiB), so a small crafted ``.gz`` cannot fill memory. ``max_train`` /
``max_test`` keep the first N samples.

CIFAR-10's batches are pickles, and ``pickle.load`` runs whatever code a crafted file names. They are
read with a restricted unpickler that builds only what those files hold: dicts, lists, ints, bytes and
str, and numpy arrays of plain (non-object) dtypes (``numpy.core.multiarray._reconstruct`` or numpy 2's
``numpy._core`` spelling, ``numpy.ndarray``, ``numpy.dtype``, and ``_codecs.encode`` to latin-1, which
protocol-2 pickles written by Python 3 use for bytes). Any other global is refused with a
``ValueError`` naming it, before anything is called. What is built is checked before it grows: an array
starts empty (as numpy's pickles do) and takes only the bytes the file holds, and a batch's ``data`` must
be an (N, 3072) uint8 array with ``labels`` N ints in 0-9 (a list of references to one row, a few bytes
each in the file, would expand to 3072 bytes each).
"""

from __future__ import annotations

import gzip
import math
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowbit.lab.data.bundle import Dataset

__all__ = ["load_mnist", "load_cifar10", "read_idx", "DATA_DIR_ENV"]

DATA_DIR_ENV = "LOWBIT_DATA_DIR"

_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte",
}
_MNIST_LAYOUT = ("an MNIST folder holding " + ", ".join(_MNIST_FILES.values())
                 + " (each optionally .gz), as distributed by LeCun et al.")
_CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
_CIFAR_LAYOUT = ("a CIFAR-10 'python version' folder (cifar-10-batches-py) holding data_batch_1 ... data_batch_5 "
                 "and test_batch, or the folder that contains it")


def _data_dir(name: str, data_dir: str | os.PathLike[str] | None, layout: str) -> Path:
    if data_dir is None:
        root = os.environ.get(DATA_DIR_ENV, "").strip()
        if not root:
            raise ValueError(f"data set {name!r} is read from disk: pass data_dir= (in a study: "
                             f"[dataset_args.{name}] data_dir = \"...\") or set ${DATA_DIR_ENV} to a folder holding "
                             f"{name}/; expected {layout}")
        data_dir = Path(root) / name
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise ValueError(f"data set {name!r}: {str(path)!r} is not a folder; expected {layout}")
    return path


def _open(path: Path) -> Any:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


#: The most bytes an idx file may declare (1 GiB; MNIST's largest, the training images, is 47 MB): a header
#: is read before its data, and a gzip of a few kB can hold gigabytes, so the header's size bounds the read.
IDX_MAX_BYTES = 1 << 30
_READ_CHUNK = 1 << 20


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """An idx file (``.gz`` or not) as a numpy array of its unsigned bytes, shaped by its header.

    The header comes first and fixes how much is read: at most its declared size plus one byte (to tell a
    file with trailing data), never more than :data:`IDX_MAX_BYTES`. Raises ``ValueError`` for another
    magic number, a header cut short, a declared size over the limit and data of another length."""
    path = Path(path)
    with _open(path) as f:
        head = f.read(4)
        if len(head) != 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08:
            raise ValueError(f"{path}: not an idx file of unsigned bytes (magic {head.hex() or 'missing'}, "
                             "expected 000008xx)")
        ndim = head[3]
        raw = f.read(4 * ndim)
        if len(raw) != 4 * ndim:
            raise ValueError(f"{path}: the idx header is cut short ({ndim} dimensions need {4 * ndim} bytes, "
                             f"the file holds {len(raw)})")
        dims = struct.unpack(f">{ndim}I", raw)
        count = math.prod(dims) if dims else 0  # (Python ints: a crafted header cannot overflow it)
        if count > IDX_MAX_BYTES:
            raise ValueError(f"{path}: the header says {dims}, which declares {count} bytes; an idx file here "
                             f"holds at most {IDX_MAX_BYTES} (lowbit.lab.data.ondisk.IDX_MAX_BYTES)")
        data = bytearray()
        while len(data) <= count:  # in chunks: memory grows with the data there, not with the declared size
            chunk = f.read(min(_READ_CHUNK, count + 1 - len(data)))
            if not chunk:
                break
            data += chunk
    if len(data) != count:
        held = "more" if len(data) > count else str(len(data))
        raise ValueError(f"{path}: the header says {dims} = {count} bytes, the file holds {held}")
    return np.frombuffer(data, dtype=np.uint8).reshape(dims)


def _find(folder: Path, stem: str, layout: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    raise ValueError(f"{folder}: no {stem} (or {stem}.gz); expected {layout}")


def _limit(a: np.ndarray, n: int) -> np.ndarray:
    return a[:n] if n and n > 0 else a


def load_mnist(seed: int = 0, data_dir: str | os.PathLike[str] | None = None, max_train: int = 0,
               max_test: int = 0) -> Dataset:
    """MNIST from its idx files (60,000 / 10,000 28x28 images), standardised on the training split."""
    folder = _data_dir("mnist", data_dir, _MNIST_LAYOUT)
    arrays = {k: read_idx(_find(folder, stem, _MNIST_LAYOUT)) for k, stem in _MNIST_FILES.items()}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise ValueError(f"{folder}: {split} images {x.shape} and labels {y.shape} do not match "
                             "(expected (N, rows, cols) and (N,))")
        if y.size and int(y.max()) > 9:
            raise ValueError(f"{folder}: {split} labels go up to {int(y.max())}; MNIST has the classes 0-9")
    x_tr = _limit(arrays["train_x"], max_train).astype(np.float32) / 255.0
    x_te = _limit(arrays["test_x"], max_test).astype(np.float32) / 255.0
    mean, std = float(x_tr.mean()), float(x_tr.std()) or 1.0
    h, w = x_tr.shape[1:]
    return Dataset(
        name="mnist",
        label=f"MNIST {h}x{w} ({len(x_tr)} train / {len(x_te)} test, from {folder})",
        x_train=torch.from_numpy((x_tr - mean) / std).reshape(-1, 1, h, w),
        y_train=torch.from_numpy(_limit(arrays["train_y"], max_train).astype(np.int64)),
        x_test=torch.from_numpy((x_te - mean) / std).reshape(-1, 1, h, w),
        y_test=torch.from_numpy(_limit(arrays["test_y"], max_test).astype(np.int64)),
        num_classes=10,
        in_shape=(1, h, w),
        synthetic=False,
        source=f"idx files in {folder}",
        meta={"mean": mean, "std": std, "data_dir": str(folder)},
    )


class _RefusedGlobal(pickle.UnpicklingError):
    pass


def _latin1_bytes(text: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    # What a protocol-2 pickle written by Python 3 stores for a bytes object: _codecs.encode(text, "latin1").
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise _RefusedGlobal(f"_codecs.encode with encoding {encoding!r} (only latin1 builds bytes)")
    return text.encode("latin1", errors)


def _plain_dtype(*args: Any) -> np.dtype:
    dt = np.dtype(*args)
    if dt.hasobject:
        raise _RefusedGlobal(f"a numpy dtype holding Python objects ({dt})")
    return dt


def _reconstruct(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    if subtype is not np.ndarray:
        raise _RefusedGlobal(f"an array of type {subtype!r}")
    # numpy's pickles start from an empty array and fill it from the file's bytes (BUILD); a larger start
    # would be memory the file never holds
    if not isinstance(shape, tuple) or not all(isinstance(n, int) for n in shape) or math.prod(shape) != 0:
        raise _RefusedGlobal(f"an array reconstructed with shape {shape!r} (numpy's pickles start from (0,))")
    return np.ndarray.__new__(np.ndarray, shape, _plain_dtype(dtype))


class _CifarUnpickler(pickle.Unpickler):
    """Builds only what a CIFAR-10 python batch holds; any other global is refused, never imported."""

    _ALLOWED: dict[tuple[str, str], Any] = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): _plain_dtype,
        ("_codecs", "encode"): _latin1_bytes,
    }

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise _RefusedGlobal(f"{module}.{name}") from None


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            d = _CifarUnpickler(f, encoding="bytes").load()
    except _RefusedGlobal as exc:
        raise ValueError(f"{path}: refused: the pickle asks for {exc}, which a CIFAR-10 python batch never "
                         "holds (only dicts, lists, bytes/str and numpy arrays are built)") from None
    except Exception as exc:  # noqa: BLE001 — any unreadable file is a layout error
        raise ValueError(f"{path}: not a CIFAR-10 python batch ({type(exc).__name__}: {exc})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a CIFAR-10 python batch (a {type(d).__name__}, not a dict)")
    d = {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}
    if "data" not in d or "labels" not in d:
        raise ValueError(f"{path}: a CIFAR-10 batch holds 'data' and 'labels', this one {sorted(d)}")
    return _cifar_arrays(path, d["data"], d["labels"])


def _cifar_arrays(path: Path, data: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """A batch's images and labels, checked for what a CIFAR-10 batch holds before anything is built from
    them: a pickle can hold a list of references to one row, a few bytes each that ``np.asarray`` would
    expand to 3072 each (module doc)."""
    if not isinstance(data, np.ndarray):
        raise ValueError(f"{path}: 'data' is a {type(data).__name__}; a CIFAR-10 batch holds an (N, 3072) "
                         "uint8 array")
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: 'data' is a {data.dtype} array of shape {data.shape}; a CIFAR-10 batch holds "
                         "an (N, 3072) uint8 array")
    if isinstance(labels, np.ndarray):
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise ValueError(f"{path}: 'labels' is a {labels.dtype} array of shape {labels.shape}; expected N ints")
    elif not isinstance(labels, list) or not all(type(v) is int for v in labels):
        kind = type(labels).__name__ if not isinstance(labels, list) else "list holding other things than ints"
        raise ValueError(f"{path}: 'labels' is a {kind}; a CIFAR-10 batch holds a list of N ints")
    if len(labels) != data.shape[0]:
        raise ValueError(f"{path}: 'data' holds {data.shape[0]} rows and 'labels' {len(labels)} labels; a CIFAR-10 "
                         f"batch holds one label per row: data (N, 3072) and labels (N,)")
    y = np.asarray(labels, dtype=np.int64)
    if y.size and (int(y.min()) < 0 or int(y.max()) > 9):
        raise ValueError(f"{path}: labels outside 0-9")
    return data.reshape(-1, 3, 32, 32), y


def load_cifar10(seed: int = 0, data_dir: str | os.PathLike[str] | None = None, max_train: int = 0,
                 max_test: int = 0) -> Dataset:
    """CIFAR-10 from its python batches (50,000 / 10,000 32x32 RGB images), standardised per channel on
    the training split."""
    folder = _data_dir("cifar10", data_dir, _CIFAR_LAYOUT)
    if not (folder / "test_batch").is_file() and (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    missing = [n for n in [*_CIFAR_TRAIN, "test_batch"] if not (folder / n).is_file()]
    if missing:
        raise ValueError(f"{folder}: missing {', '.join(missing)}; expected {_CIFAR_LAYOUT}")
    parts = [_cifar_batch(folder / n) for n in _CIFAR_TRAIN]
    x_tr = _limit(np.concatenate([p[0] for p in parts]), max_train).astype(np.float32) / 255.0
    y_tr = _limit(np.concatenate([p[1] for p in parts]), max_train)
    x_te, y_te = _cifar_batch(folder / "test_batch")
    x_te, y_te = _limit(x_te, max_test).astype(np.float32) / 255.0, _limit(y_te, max_test)
    mean = x_tr.mean(axis=(0, 2, 3), keepdims=True)
    std = x_tr.std(axis=(0, 2, 3), keepdims=True)
    std[std == 0] = 1.0
    return Dataset(
        name="cifar10",
        label=f"CIFAR-10 32x32 ({len(x_tr)} train / {len(x_te)} test, from {folder})",
        x_train=torch.from_numpy(((x_tr - mean) / std).astype(np.float32)),
        y_train=torch.from_numpy(y_tr.astype(np.int64)),
        x_test=torch.from_numpy(((x_te - mean) / std).astype(np.float32)),
        y_test=torch.from_numpy(y_te.astype(np.int64)),
        num_classes=10,
        in_shape=(3, 32, 32),
        synthetic=False,
        source=f"CIFAR-10 python batches in {folder}",
        meta={"mean": mean.reshape(-1).tolist(), "std": std.reshape(-1).tolist(), "data_dir": str(folder)},
    )
