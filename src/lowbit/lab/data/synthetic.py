"""Synthetic inputs of any network's shape, for throughput runs only (accuracy means nothing).

Inputs are N(0, 1) floats of the model's sample shape — or uniform token ids for token models
(``task == "sequence"`` with a 1-D ``in_shape``) — and labels are uniform class ids, one per sample
or one per time step. Everything is drawn from a private ``torch.Generator`` seeded with ``seed``,
so two calls agree and the global RNG is untouched. The bundle is flagged ``synthetic=True`` and its
label starts with "SYNTHETIC" so no report can mistake it for real data.

Sizes are small by default (64 train / 16 test samples): an ImageNet-shaped set of 64 samples is
38 MB. Throughput runs cycle over it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowbit.lab.data.bundle import Dataset
from lowbit.lab.models import model_info

__all__ = ["load_synthetic"]


def load_synthetic(
    seed: int = 0,
    model: str | None = None,
    in_shape: Sequence[int] | None = None,
    num_classes: int | None = None,
    task: str | None = None,
    n_train: int = 64,
    n_test: int = 16,
) -> Dataset:
    """Random data shaped for ``model`` (a :mod:`lowbit.lab.models` name) or for explicit shapes.

    Explicit ``in_shape`` / ``num_classes`` / ``task`` override the model's defaults; without a
    model they default to ``(3, 224, 224)``, 1000 and ``"classify"``.
    """
    if model is not None:
        info = model_info(model)
        in_shape = info.in_shape if in_shape is None else in_shape
        num_classes = info.num_classes if num_classes is None else num_classes
        task = info.task if task is None else task
    shape = tuple(int(s) for s in (in_shape if in_shape is not None else (3, 224, 224)))
    classes = int(num_classes if num_classes is not None else 1000)
    task = task or "classify"
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"in_shape must be non-empty positive sizes, got {in_shape}")
    if classes < 1 or n_train < 0 or n_test < 0:
        raise ValueError(
            f"need num_classes >= 1 and n_train, n_test >= 0; got {classes}, {n_train}, {n_test}"
        )
    if task not in ("classify", "sequence"):
        raise ValueError(f"task must be 'classify' or 'sequence', got {task!r}")
    tokens = task == "sequence" and len(shape) == 1
    target_shape = shape[:1] if task == "sequence" else ()

    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens:
            x = torch.randint(0, classes, (n, *shape), generator=g)
        else:
            x = torch.randn((n, *shape), generator=g)
        y = torch.randint(0, classes, (n, *target_shape), generator=g)
        return x, y

    x_tr, y_tr = draw(n_train)
    x_te, y_te = draw(n_test)
    what = "token ids" if tokens else "N(0,1) inputs"
    shape_txt = "x".join(str(s) for s in shape)
    return Dataset(
        name="synthetic",
        label=f"SYNTHETIC random {what} {shape_txt}, {classes} classes (throughput only)"
        + (f" for {model}" if model else ""),
        x_train=x_tr,
        y_train=y_tr,
        x_test=x_te,
        y_test=y_te,
        num_classes=classes,
        in_shape=shape,
        synthetic=True,
        source=f"torch.Generator(seed={seed}); random, not real data",
        task=task,
        meta={"model": model, "seed": seed},
    )
