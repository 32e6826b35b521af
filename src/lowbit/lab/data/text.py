"""A character-level language-modelling corpus that needs no download: Python's own docstrings.

The seed's LSTM was trained on AN4 speech, which we cannot fetch. The stand-in task for the same
network (:func:`lowbit.lab.models.build_model` ``("lstm", in_shape=(T,))``) is next-character
prediction over English prose that every Python installation carries: the docstrings of a fixed
list of standard-library modules (:data:`DOC_MODULES`), their public classes and functions, and the
public methods of those classes, in sorted order. About 260,000 characters and 100 distinct
characters on CPython 3.11. Docstrings differ a little between Python versions, so the bundle
records the Python version, the corpus length and its SHA-256 in ``meta``.

Layout: the text is encoded with a sorted character vocabulary of the whole corpus; the first
90% (by position) is training text and the rest test text, so no test window overlaps a training
one. Each split is cut into non-overlapping windows of ``seq_len`` characters: ``x[i]`` is a window
and ``y[i]`` the same window shifted by one character (the next-character targets).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import platform
import types
import warnings

import torch

from lowbit.lab.data.bundle import Dataset

__all__ = ["DOC_MODULES", "stdlib_docstrings", "load_text"]

#: Standard-library modules whose docstrings make up the corpus (present in CPython >= 3.10).
DOC_MODULES: tuple[str, ...] = (
    "argparse", "collections", "csv", "datetime", "decimal", "difflib", "email.message",
    "fractions", "functools", "heapq", "http.client", "inspect", "itertools", "json", "logging",
    "pathlib", "pickle", "random", "re", "shutil", "statistics", "string", "subprocess", "tarfile",
    "textwrap", "threading", "typing", "unittest.case", "urllib.parse", "zipfile",
)  # fmt: skip

#: Fewer characters than this means docstrings were stripped (python -OO).
_MIN_CHARS = 50_000


def _docs_of(module_name: str) -> list[str]:
    with warnings.catch_warnings():
        # typing.io / typing.re warn on attribute access (deprecated aliases, gone in 3.12)
        warnings.simplefilter("ignore", DeprecationWarning)
        return _collect(importlib.import_module(module_name))


def _collect(mod: types.ModuleType) -> list[str]:
    parts = [inspect.getdoc(mod) or ""]
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        parts.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for meth_name, meth in sorted(vars(obj).items()):
                if not meth_name.startswith("_") and inspect.isfunction(meth):
                    parts.append(inspect.getdoc(meth) or "")
    return [p for p in parts if p]


@functools.lru_cache(maxsize=4)
def stdlib_docstrings(modules: tuple[str, ...] = DOC_MODULES) -> str:
    """The corpus: docstrings of ``modules`` and their public members, joined by blank lines."""
    text = "\n\n".join(doc for name in modules for doc in _docs_of(name))
    if len(text) < _MIN_CHARS:
        raise RuntimeError(
            f"the docstring corpus has only {len(text)} characters: is Python running with -OO "
            "(which strips docstrings)?"
        )
    return text


def _windows(ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = (ids.numel() - 1) // seq_len
    x = ids[: n * seq_len].reshape(n, seq_len)
    y = ids[1 : n * seq_len + 1].reshape(n, seq_len)
    return x.clone(), y.clone()


def load_text(seed: int = 0, seq_len: int = 64, test_fraction: float = 0.1) -> Dataset:
    """Character-level LM windows over :func:`stdlib_docstrings` (``seed`` is not used)."""
    del seed  # the corpus and its split are fixed; shuffling is the loader's job
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    text = stdlib_docstrings()
    vocab = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.int64)  # (chars,)
    cut = int(len(text) * (1.0 - test_fraction))
    x_tr, y_tr = _windows(ids[:cut], seq_len)
    x_te, y_te = _windows(ids[cut:], seq_len)
    python = platform.python_version()
    return Dataset(
        name="text",
        label=(
            f"Python {python} stdlib docstrings, char-level LM ({len(text):,} chars, "
            f"{len(vocab)} symbols, windows of {seq_len})"
        ),
        x_train=x_tr,
        y_train=y_tr,
        x_test=x_te,
        y_test=y_te,
        num_classes=len(vocab),
        in_shape=(seq_len,),
        synthetic=False,
        source=f"docstrings of {len(DOC_MODULES)} standard-library modules of this Python "
        f"({python}); see lowbit.lab.data.text.DOC_MODULES",
        task="sequence",
        meta={
            "vocab": vocab,
            "chars": len(text),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "python": python,
        },
    )
