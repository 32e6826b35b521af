"""Deterministic sharding of a data set across data-parallel ranks.

Every rank computes the same permutation of ``range(n)`` from ``(seed, epoch)`` with a private
NumPy generator seeded by the pair (``SeedSequence([seed, epoch])``: distinct pairs give independent
streams, unlike ``seed + epoch``; torch's CPU generator would keep only 32 bits of a combined seed),
so the global RNGs are never touched. Each rank then takes every ``world_size``-th index
starting at its rank — the rule of ``torch.utils.data.DistributedSampler``. Synchronous training
needs every rank to run the same number of steps, so shards are made equal:

* ``drop_last=False`` pads the permutation by wrapping around to a multiple of ``world_size``
  (shards cover every sample; at most ``world_size - 1`` samples appear twice per epoch);
* ``drop_last=True`` drops the tail instead (shards are disjoint; at most ``world_size - 1``
  samples are skipped this epoch, different ones each epoch when shuffling).

When ``world_size`` divides ``n`` both give disjoint shards that cover the data exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

__all__ = ["shard_indices", "ShardedSampler", "ShardedLoader"]


def _check(n: int, rank: int, world_size: int) -> None:
    if n < 0:
        raise ValueError(f"number of samples must be >= 0, got {n}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def shard_indices(
    n: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> torch.Tensor:
    """Indices (int64, CPU) of ``rank``'s shard of ``range(n)`` for ``epoch``; see the module doc."""
    _check(n, rank, world_size)
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got {seed}, {epoch}")
    if shuffle:
        rng = np.random.default_rng([seed, epoch])
        order = torch.from_numpy(rng.permutation(n).astype(np.int64))
    else:
        order = torch.arange(n)
    if drop_last:
        order = order[: (n // world_size) * world_size]
    elif n > 0:
        total = math.ceil(n / world_size) * world_size
        if total > n:  # wrap around (repeatedly, when world_size > n)
            order = order.repeat(math.ceil(total / n))[:total]
    return order[rank::world_size]


class ShardedSampler(torch.utils.data.Sampler[int]):
    """A ``DistributedSampler``-like sampler usable with ``torch.utils.data.DataLoader``.

    Call :meth:`set_epoch` before each epoch to get a fresh (but reproducible) shuffle.
    """

    def __init__(
        self,
        n: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        _check(n, rank, world_size)
        self.n, self.rank, self.world_size = n, rank, world_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``."""
        self.epoch = int(epoch)

    def indices(self) -> torch.Tensor:
        """This rank's indices for the current epoch."""
        return shard_indices(
            self.n, self.rank, self.world_size, self.seed, self.epoch, self.shuffle, self.drop_last
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        if self.drop_last:
            return self.n // self.world_size
        return math.ceil(self.n / self.world_size)


class ShardedLoader:
    """Mini-batches ``(x, y)`` of one rank's shard of in-memory tensors.

    Faster than a ``DataLoader`` for data that already sits in memory: a batch is one indexing
    operation. ``batch_size`` is per rank (the global batch is ``batch_size * world_size``). With
    ``drop_last=True`` the shard drops the tail (see the module doc) and the last incomplete batch
    is dropped too, so every step has full batches; otherwise the last batch may be smaller (it is
    the same size on every rank, since shards are equal).
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.sampler = ShardedSampler(x.shape[0], rank, world_size, seed, shuffle, drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch`` (call once per epoch when shuffling)."""
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.sampler.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.sampler.indices().to(self.x.device)
        for b in range(len(self)):
            sel = idx[b * self.batch_size : (b + 1) * self.batch_size]
            yield self.x[sel], self.y[sel]
