"""MNIST (idx) and CIFAR-10 (python pickles) from files written here in exactly those formats."""

from __future__ import annotations

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from lowbit.lab.data import available_datasets, load_dataset
from lowbit.lab.data.ondisk import read_idx


def _idx(path: Path, a: np.ndarray, gz: bool) -> None:
    head = bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape)
    data = head + a.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_mnist(folder: Path, n_train: int = 120, n_test: int = 40, gz: bool = True) -> tuple:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
              "train-labels-idx1-ubyte": rng.integers(0, 10, n_train),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test)}
    for name, a in arrays.items():
        _idx(folder / name, a, gz)
    return arrays


def write_cifar(folder: Path, per_batch: int = 40, n_test: int = 30) -> tuple:
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    ys = []
    for i in range(1, 6):
        y = rng.integers(0, 10, per_batch).tolist()
        ys += y
        batch = {b"batch_label": f"training batch {i} of 5".encode(), b"labels": y,
                 b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8), b"filenames": []}
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch, f, protocol=2)
    test = {b"labels": rng.integers(0, 10, n_test).tolist(),
            b"data": rng.integers(0, 256, (n_test, 3072), dtype=np.uint8)}
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(test, f, protocol=2)
    return ys, test


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_from_idx_files(tmp_path: Path, gz: bool) -> None:
    arrays = write_mnist(tmp_path / "mnist", gz=gz)
    d = load_dataset("mnist", data_dir=tmp_path / "mnist")
    assert "mnist" in available_datasets()
    assert d.x_train.shape == (120, 1, 28, 28) and d.x_test.shape == (40, 1, 28, 28) and d.num_classes == 10
    assert d.y_train.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    # pixel order kept: standardised values are an increasing function of the raw bytes
    raw = arrays["train-images-idx3-ubyte"][0].astype(np.float64).reshape(-1)
    got = d.x_train[0].reshape(-1).double().numpy()
    assert np.allclose((got - got.min()) / (got.max() - got.min()), (raw - raw.min()) / (raw.max() - raw.min()))
    assert abs(float(d.x_train.mean())) < 1e-4 and abs(float(d.x_train.std()) - 1) < 1e-3
    small = load_dataset("mnist", data_dir=tmp_path / "mnist", max_train=10, max_test=5)
    assert small.n_train == 10 and small.n_test == 5


def test_mnist_wrong_layout_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="train-images-idx3-ubyte"):
        load_dataset("mnist", data_dir=tmp_path)  # empty folder
    with pytest.raises(ValueError, match="not a folder"):
        load_dataset("mnist", data_dir=tmp_path / "nope")
    monkeypatch.delenv("LOWBIT_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match="LOWBIT_DATA_DIR"):
        load_dataset("mnist")
    write_mnist(tmp_path / "m", gz=False)
    (tmp_path / "m" / "t10k-labels-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x05abc")  # 3 of 5 bytes
    with pytest.raises(ValueError, match="holds 3"):
        load_dataset("mnist", data_dir=tmp_path / "m")
    (tmp_path / "x").write_bytes(b"PK\x03\x04zip")
    with pytest.raises(ValueError, match="not an idx file"):
        read_idx(tmp_path / "x")


def test_mnist_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_mnist(tmp_path / "mnist", gz=True)
    monkeypatch.setenv("LOWBIT_DATA_DIR", str(tmp_path))
    assert load_dataset("mnist").n_train == 120


@pytest.mark.parametrize("nested", [False, True])
def test_cifar10_from_python_batches(tmp_path: Path, nested: bool) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    ys, test = write_cifar(folder)
    d = load_dataset("cifar10", data_dir=tmp_path if nested else folder)
    assert d.x_train.shape == (200, 3, 32, 32) and d.x_test.shape == (30, 3, 32, 32)
    assert d.y_train.tolist() == ys and d.y_test.tolist() == test[b"labels"]
    # channel-major layout: the first 1024 bytes of a row are the red plane
    raw_red = test[b"data"][0, :1024].astype(np.float64).reshape(32, 32)
    red = d.x_test[0, 0].double().numpy()
    assert np.corrcoef(raw_red.reshape(-1), red.reshape(-1))[0, 1] > 0.9999
    per_channel = d.x_train.mean(dim=(0, 2, 3))
    assert float(per_channel.abs().max()) < 1e-4


def test_cifar10_wrong_layout_names_it(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    write_cifar(folder)
    (folder / "data_batch_3").unlink()
    with pytest.raises(ValueError, match="missing data_batch_3"):
        load_dataset("cifar10", data_dir=folder)
    (folder / "data_batch_3").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a CIFAR-10 python batch"):
        load_dataset("cifar10", data_dir=folder)
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match="3072"):
        load_dataset("cifar10", data_dir=folder)


class _Payload:
    """Unpickling this runs a shell command: what a crafted batch file would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        import os
        return os.system, (f"touch {self.marker}",)


def _python2_style(obj: object) -> bytes:
    """Protocol 2 as CIFAR-10's own files (written by Python 2 with numpy 1.x) name numpy's reconstructor."""
    return pickle.dumps(obj, protocol=2).replace(b"numpy._core.multiarray", b"numpy.core.multiarray")


def test_cifar10_reads_batches_in_the_original_format(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    ys, test = write_cifar(folder)
    batch = {b"batch_label": b"training batch 2 of 5", b"labels": ys[40:80],
             b"data": np.random.default_rng(3).integers(0, 256, (40, 3072), dtype=np.uint8),
             b"filenames": [b"a_%d.png" % i for i in range(40)]}
    raw = _python2_style(batch)
    assert b"numpy.core.multiarray\n_reconstruct" in raw
    (folder / "data_batch_2").write_bytes(raw)
    d = load_dataset("cifar10", data_dir=folder)
    assert d.y_train.tolist() == ys


@pytest.mark.parametrize("where", ["top", "inside"])
def test_cifar10_refuses_a_batch_that_would_run_code(tmp_path: Path, where: str) -> None:
    folder = tmp_path / "c"
    write_cifar(folder)
    marker = tmp_path / "ran"
    evil = _Payload(marker)
    obj = evil if where == "top" else {b"labels": [0], b"data": np.zeros((1, 3072), np.uint8), b"x": evil}
    (folder / "data_batch_4").write_bytes(pickle.dumps(obj, protocol=2))
    with pytest.raises(ValueError, match=r"data_batch_4.*refused.*(posix|os|nt)\.system"):
        load_dataset("cifar10", data_dir=folder)
    assert not marker.exists()


def test_cifar10_refuses_object_arrays_and_other_globals(tmp_path: Path) -> None:
    folder = tmp_path / "c"
    write_cifar(folder)
    (folder / "test_batch").write_bytes(pickle.dumps(
        {b"labels": [0], b"data": np.array([[1] * 3072], dtype=object)}, protocol=2))
    with pytest.raises(ValueError, match="test_batch.*refused.*dtype holding Python objects"):
        load_dataset("cifar10", data_dir=folder)
    (folder / "test_batch").write_bytes(pickle.dumps({b"labels": [0], b"data": eval}, protocol=2))
    with pytest.raises(ValueError, match=r"test_batch.*refused.*(__builtin__|builtins)\.eval"):
        load_dataset("cifar10", data_dir=folder)


class _Counting:
    """A file that counts the bytes read through it."""

    def __init__(self, f) -> None:  # noqa: ANN001
        self.f, self.read_bytes = f, 0

    def read(self, n: int = -1) -> bytes:
        out = self.f.read(n)
        self.read_bytes += len(out)
        return out

    def __enter__(self) -> "_Counting":
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def test_idx_is_refused_without_reading_past_its_declared_size(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A gzip of a few kB can hold gigabytes: the header's declared size bounds what is read (issue 44)."""
    import tracemalloc

    from lowbit.lab.data import ondisk

    path = tmp_path / "labels.gz"
    with gzip.open(path, "wb") as f:  # 16 labels declared, then 64 MB of zeros (a 60 kB file)
        f.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 16))
        for _ in range(64):
            f.write(bytes(1 << 20))
    assert path.stat().st_size < 1 << 20
    opened: list[_Counting] = []
    real_open = ondisk._open
    monkeypatch.setattr(ondisk, "_open", lambda p: opened.append(_Counting(real_open(p))) or opened[-1])
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            read_idx(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert opened[0].read_bytes <= 4 + 4 + 16 + 1, opened[0].read_bytes  # the header, its 16 bytes, one more
    assert peak < 4 << 20, peak
    assert "(16,) = 16 bytes" in str(refused.value) and "more" in str(refused.value), refused.value
    # a header declaring more than any idx data set is refused before reading on
    huge = tmp_path / "huge"
    huge.write_bytes(bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 1 << 16, 1 << 16, 1 << 16))
    with pytest.raises(ValueError, match="declares 281474976710656 bytes.*at most"):
        read_idx(huge)
    # a header cut short is a layout error too
    (tmp_path / "short").write_bytes(bytes([0, 0, 0x08, 3]) + b"\x00\x00")
    with pytest.raises(ValueError, match="header is cut short"):
        read_idx(tmp_path / "short")


def test_cifar10_refuses_data_that_expands_on_reading(tmp_path: Path) -> None:
    """A pickled list of references to one row is a few bytes per row and expands to 3072 bytes each:
    ``data`` must be the (N, 3072) uint8 array a batch holds, checked before anything is built from it
    (issue 44)."""
    import tracemalloc

    folder = tmp_path / "c"
    write_cifar(folder)
    row = np.zeros(3072, np.uint8)
    (folder / "test_batch").write_bytes(pickle.dumps({b"labels": [0] * 3000, b"data": [row] * 3000}, protocol=2))
    assert (folder / "test_batch").stat().st_size < 20_000  # against 9 MB of rows once expanded
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"test_batch: 'data' is a list; a CIFAR-10 batch holds .*uint8 array"):
            load_dataset("cifar10", data_dir=folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # (the five small training batches are read first: ~1 MB)
    # labels are that many ints in 0-9, checked before they become an array
    data = np.zeros((4, 3072), np.uint8)
    for labels, why in (([row] * 4, "labels.*int"), ([0, 1, 2], "4 rows and 'labels' 3 labels"), ([0, 1, 2, 10], "0-9"),
                        ({0: 1}, "labels.*list")):
        (folder / "test_batch").write_bytes(pickle.dumps({b"labels": labels, b"data": data}, protocol=2))
        with pytest.raises(ValueError, match=why):
            load_dataset("cifar10", data_dir=folder)
    (folder / "test_batch").write_bytes(pickle.dumps({b"labels": [0], b"data": np.zeros((1, 3072), np.int64)},
                                                     protocol=2))
    with pytest.raises(ValueError, match="int64.*uint8"):
        load_dataset("cifar10", data_dir=folder)
    # an array's pickle starts from an empty one; a crafted start of 2**31 bytes is refused, not allocated
    raw = pickle.dumps({b"labels": [0], b"data": np.zeros((1, 3072), np.uint8)}, protocol=2)
    assert raw.count(b"K\x00\x85") == 1  # BININT1 0, TUPLE1: _reconstruct's shape (0,)
    (folder / "test_batch").write_bytes(raw.replace(b"K\x00\x85", b"J\xff\xff\xff\x7f\x85"))
    with pytest.raises(ValueError, match=r"refused.*shape \(2147483647,\)"):
        load_dataset("cifar10", data_dir=folder)
