"""The :class:`Dataset` bundle every loader returns: tensors in memory plus what they are."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from lowbit.lab.data.sharding import ShardedLoader

__all__ = ["Dataset"]

_TASKS = ("classify", "sequence")


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A data set held in memory as tensors, with its provenance.

    ``x_*`` has shape ``(N, *in_shape)``; ``y_*`` is ``(N,)`` int64 class ids for ``task ==
    "classify"``, or ``(N, T)`` int64 (one id per time step) for ``task == "sequence"``.
    ``synthetic`` is True for random inputs whose accuracy means nothing (throughput runs only);
    ``label`` is a human-readable one-line description for reports, ``source`` says where the data
    came from, and ``meta`` carries loader-specific extras (e.g. the vocabulary of a text corpus).
    """

    name: str
    label: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    in_shape: tuple[int, ...]
    synthetic: bool
    source: str
    task: str = "classify"
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.task not in _TASKS:
            raise ValueError(f"task must be one of {_TASKS}, got {self.task!r}")
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if tuple(x.shape[1:]) != tuple(self.in_shape):
                raise ValueError(f"x_{split} has sample shape {tuple(x.shape[1:])}, not {self.in_shape}")
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"x_{split} has {x.shape[0]} samples but y_{split} has {y.shape[0]}")

    @property
    def n_train(self) -> int:
        """Number of training samples."""
        return int(self.x_train.shape[0])

    @property
    def n_test(self) -> int:
        """Number of test samples."""
        return int(self.x_test.shape[0])

    def loader(
        self,
        split: str = "train",
        batch_size: int = 64,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool | None = None,
        drop_last: bool = False,
    ) -> ShardedLoader:
        """Mini-batches of this rank's shard of ``split`` (``"train"`` or ``"test"``).

        ``batch_size`` is per rank. ``shuffle`` defaults to True for train and False for test.
        See :class:`~lowbit.lab.data.sharding.ShardedLoader` for the sharding rules.
        """
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        x, y = (self.x_train, self.y_train) if split == "train" else (self.x_test, self.y_test)
        return ShardedLoader(
            x,
            y,
            batch_size=batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
            shuffle=(split == "train") if shuffle is None else shuffle,
            drop_last=drop_last,
        )
