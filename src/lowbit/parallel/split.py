"""Where lowbit's networks split for model and hybrid parallelism (the study's ``parallelism`` dimension).

* ``model``: the whole network is a chain of Linear / ReLU / Dropout / Flatten (lowbit.lab.models' ``mlp``,
  Dettmers' MNIST network): every linear layer is split over the ranks (:func:`lowbit.parallel.parallelize`).
* ``hybrid``: the network has convolutional ``features`` and a fully connected classifier (``alexnet``,
  ``vgg*``: ``features``, ``pool``, ``classifier``; ``small_cnn``: ``features``, ``fc``): the features run
  data-parallel, the classifier model-parallel (:class:`lowbit.parallel.Hybrid`).
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.parallel.layers import _ELEMENTWISE

__all__ = ["PARALLELISMS", "model_parallel_chain", "hybrid_parts", "check_splits"]

PARALLELISMS = ("data", "model", "hybrid")


def model_parallel_chain(model: nn.Module) -> nn.Sequential:
    """The Sequential that ``parallelism="model"`` splits; ValueError when the network is not a chain of
    linear layers and elementwise modules."""
    seq = model if isinstance(model, nn.Sequential) else getattr(model, "net", None)
    ok = (nn.Linear, nn.Dropout, nn.Flatten, nn.Identity, *_ELEMENTWISE)
    if not isinstance(seq, nn.Sequential) or not all(isinstance(m, ok) for m in seq) or \
            not any(isinstance(m, nn.Linear) for m in seq):
        raise ValueError(f"parallelism 'model' splits networks made of linear layers only (e.g. 'mlp'); "
                         f"{type(model).__name__} is not one")
    return seq


class _AsImages(nn.Module):
    """small_cnn's input rule: (N, L) signals get their channel axis."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.ndim = ndim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1) if x.dim() == self.ndim else x


def hybrid_parts(model: nn.Module) -> tuple[nn.Module, nn.Sequential]:
    """(features, classifier) of a network with convolutional features and a dense classifier; the
    features end flattened. ValueError for other networks."""
    feats = getattr(model, "features", None)
    if isinstance(feats, nn.Module) and isinstance(getattr(model, "classifier", None), nn.Sequential):
        pool = getattr(model, "pool", None)
        parts = [feats] + ([pool] if isinstance(pool, nn.Module) else []) + [nn.Flatten()]
        return nn.Sequential(*parts), model.classifier  # type: ignore[return-value]
    if isinstance(feats, nn.Module) and isinstance(getattr(model, "fc", None), nn.Linear):
        ndim = len(getattr(model, "in_shape", (1, 1, 1)))
        return nn.Sequential(_AsImages(ndim), feats, nn.Flatten()), nn.Sequential(model.fc)  # type: ignore[arg-type]
    raise ValueError(f"parallelism 'hybrid' needs convolutional features and a dense classifier (alexnet, vgg*, "
                     f"small_cnn); {type(model).__name__} has not")


def check_splits(model: nn.Module, parallelism: str) -> None:
    """ValueError naming the problem when ``model`` cannot run under ``parallelism``."""
    if parallelism not in PARALLELISMS:
        raise ValueError(f"unknown parallelism {parallelism!r}; choose one of {list(PARALLELISMS)}")
    if parallelism == "model":
        model_parallel_chain(model)
    elif parallelism == "hybrid":
        hybrid_parts(model)
