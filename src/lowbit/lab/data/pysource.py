"""A byte-level language-modelling corpus that needs no download: the running Python's standard library.

Every Python installation carries its standard library's source: tens of megabytes of real text
(code, comments, docstrings). The corpus is the ``.py`` files under ``sysconfig``'s ``stdlib`` path,
in sorted order of their relative paths, leaving out ``site-packages`` (what a user installed differs
between machines) and test suites (``test/``, ``tests/``, ``idle_test/``: large, repetitive). The
vocabulary is the 256 byte values.

Split by file, so no validation window shares a file with a training one: every ``every``-th file
(default 20, by position in the sorted list) is validation text. Each split's files are concatenated
and cut into non-overlapping windows of ``seq_len`` bytes: ``x[i]`` a window, ``y[i]`` the same window
shifted by one byte. The Python version, file count, byte count and a SHA-256 of the corpus are in
``meta``: two machines with the same numbers trained on the same text.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sysconfig
from pathlib import Path

import torch

from lowbit.lab.data.bundle import Dataset

__all__ = ["load_pysource", "stdlib_files"]

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The corpus's files: ``.py`` under the stdlib path (or ``root``), sorted by relative path."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ValueError(f"pysource: the standard library path {base} is not a directory")
    files = [p for p in base.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(base).parts[:-1]))]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


@functools.lru_cache(maxsize=2)
def _corpus(root: str | None, every: int, max_files: int | None) -> tuple[bytes, bytes, int, str]:
    files = stdlib_files(root)[:max_files]
    if len(files) < 2:
        raise ValueError(f"pysource: found {len(files)} source files; need at least 2 to split")
    train, val = bytearray(), bytearray()
    digest = hashlib.sha256()
    for i, f in enumerate(files):
        data = f.read_bytes()
        digest.update(data)
        (val if i % every == every - 1 else train).extend(data)
    return bytes(train), bytes(val), len(files), digest.hexdigest()


def _windows(data: bytes, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)  # (bytes,)
    n = (ids.numel() - 1) // seq_len
    x = ids[: n * seq_len].view(n, seq_len)
    y = ids[1 : n * seq_len + 1].view(n, seq_len)
    return x, y


def load_pysource(seed: int = 0, seq_len: int = 256, every: int = 20, max_files: int | None = None,
                  root: str | None = None) -> Dataset:
    """Byte-level LM windows over the standard library's source (``seed`` is not used: the corpus and
    its split are fixed; shuffling is the loader's job). ``max_files`` keeps the first files only
    (small slices for tests); ``root`` reads another tree of ``.py`` files."""
    del seed
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 2:
        raise ValueError(f"every must be an int >= 2 (every n-th file is validation text), got {every!r}")
    train, val, nfiles, sha = _corpus(root, every, max_files)
    x_tr, y_tr = _windows(train, seq_len)
    x_te, y_te = _windows(val, seq_len)
    if not len(x_tr) or not len(x_te):
        raise ValueError(f"pysource: the corpus ({len(train)} + {len(val)} bytes) is shorter than one window of {seq_len}")
    python = platform.python_version()
    return Dataset(
        name="pysource",
        label=f"Python {python} standard-library source, byte-level LM ({nfiles:,} files, "
              f"{len(train) + len(val):,} bytes, windows of {seq_len})",
        x_train=x_tr, y_train=y_tr, x_test=x_te, y_test=y_te,
        num_classes=256, in_shape=(seq_len,), synthetic=False,
        source=f".py files of this Python's standard library ({python}), tests and site-packages left out; "
               f"every {every}th file is validation text",
        task="sequence",
        meta={"python": python, "files": nfiles, "bytes": len(train) + len(val), "train_bytes": len(train),
              "val_bytes": len(val), "sha256": sha},
    )
