"""Data sets that work offline, synthetic inputs, and loaders that shard across ranks.

    data = load_dataset("digits", seed=0)      # a Dataset bundle of in-memory tensors
    data.x_train.shape, data.num_classes, data.in_shape, data.synthetic, data.label
    loader = data.loader("train", batch_size=32, rank=r, world_size=w, seed=0)  # this rank's shard
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            ...

========= ======================================================= ========== =======
name      what                                                    sample     classes
========= ======================================================= ========== =======
digits    scikit-learn's bundled 8x8 digits, split by ``seed``    (1, 8, 8)  10
mnist1d   MNIST-1D, generated locally by the ``mnist1d`` package  (1, 40)    10
text      char-level LM over Python's stdlib docstrings           (seq_len,) ~100
pysource  byte-level LM over Python's stdlib source (tens of MB)  (seq_len,) 256
synthetic random inputs of any model's shape, flagged synthetic   model's    model's
mnist     MNIST from its idx files on disk (``data_dir=``)        (1, 28, 28) 10
cifar10   CIFAR-10 from its python batches on disk (``data_dir=``) (3, 32, 32) 10
imagenet  class-per-folder JPEGs on disk, decoded per batch      (3, S, S)  folders
an4       AN4 WAVs + transcripts on disk: log-mel frames          (16, 363)  chars
========= ======================================================= ========== =======

Nothing here downloads: ``mnist``, ``cifar10``, ``imagenet`` and ``an4`` read a copy you have
(:mod:`lowbit.lab.data.ondisk`, :mod:`lowbit.lab.data.imagenet`, :mod:`lowbit.lab.data.speech`). Options beyond ``seed`` go to the loader (``load_dataset("text",
seq_len=16)``, ``load_dataset("synthetic", model="resnet50", n_train=256)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowbit.lab.data.bundle import Dataset
from lowbit.lab.data.digits import load_digits
from lowbit.lab.data.mnist1d import load_mnist1d
from lowbit.lab.data.imagenet import load_imagenet
from lowbit.lab.data.ondisk import load_cifar10, load_mnist
from lowbit.lab.data.pysource import load_pysource
from lowbit.lab.data.sharding import ShardedLoader, ShardedSampler, shard_indices
from lowbit.lab.data.speech import load_an4
from lowbit.lab.data.synthetic import load_synthetic
from lowbit.lab.data.text import load_text

__all__ = [
    "Dataset",
    "ShardedLoader",
    "ShardedSampler",
    "available_datasets",
    "load_dataset",
    "shard_indices",
]

_LOADERS: dict[str, Callable[..., Dataset]] = {
    "digits": load_digits,
    "mnist1d": load_mnist1d,
    "text": load_text,
    "pysource": load_pysource,
    "synthetic": load_synthetic,
    "mnist": load_mnist,
    "cifar10": load_cifar10,
    "imagenet": load_imagenet,
    "an4": load_an4,
}


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`, sorted."""
    return sorted(_LOADERS)


def load_dataset(name: str, seed: int = 0, **options: Any) -> Dataset:
    """Load data set ``name`` into memory; ``options`` go to its loader (see the module doc)."""
    try:
        loader = _LOADERS[name]
    except KeyError:
        raise ValueError(
            f"unknown data set {name!r}; known data sets: {', '.join(available_datasets())}"
        ) from None
    return loader(seed=seed, **options)
