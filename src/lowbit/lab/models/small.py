"""Small networks that train to a real accuracy on CPU in seconds.

* :class:`MLP` — Dettmers' MNIST network (8-bit approximations paper, §MNIST): 784-1024-1024-10,
  ReLU, dropout 0.2 on the input and 0.3 after each hidden layer (trained there with RMSProp, lr
  0.003). 1,863,690 parameters at 784 inputs. The input size follows ``in_shape`` (flattened), so it
  runs on 8x8 digits (64 inputs, 1,126,410 parameters) or MNIST-1D (40 inputs, 1,101,834).
* :class:`SmallCNN` — three convolutions and one dense layer, a few tens of thousands of
  parameters; 2-D for images ``(C, H, W)``, 1-D for signals ``(C, L)`` or ``(L,)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MLP", "SmallCNN"]


class MLP(nn.Module):
    """Fully connected ReLU network with dropout on the input and after each hidden layer."""

    def __init__(
        self,
        in_features: int = 784,
        num_classes: int = 10,
        hidden: Sequence[int] = (1024, 1024),
        dropout: Sequence[float] = (0.2, 0.3, 0.3),
    ) -> None:
        super().__init__()
        if len(dropout) != len(hidden) + 1:
            raise ValueError(
                f"dropout needs one rate for the input and one per hidden layer "
                f"({len(hidden) + 1}), got {len(dropout)}"
            )
        layers: list[nn.Module] = [nn.Flatten(), nn.Dropout(dropout[0])]
        width = in_features
        for h, p in zip(hidden, dropout[1:]):
            layers += [nn.Linear(width, h), nn.ReLU(inplace=True), nn.Dropout(p)]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, ...) with ``in_features`` values per sample -> (N, num_classes) logits."""
        return self.net(x)


class SmallCNN(nn.Module):
    """conv 16 -> conv 32 -> pool -> conv 64 -> pool -> dense, ReLU; 2-D or 1-D by ``in_shape``.

    For 8x8 digits ``(1, 8, 8)``: 3x3 kernels, 25,866 parameters. For MNIST-1D ``(1, 40)``: kernels
    of 5, 19,402 parameters. Inputs of other sizes work: the last pool is adaptive (to 2x2, or to
    10 positions in 1-D), so the dense layer always sees 256 or 640 values.
    """

    def __init__(
        self,
        in_shape: Sequence[int] = (1, 8, 8),
        num_classes: int = 10,
        channels: Sequence[int] = (16, 32, 64),
    ) -> None:
        super().__init__()
        shape = tuple(int(s) for s in in_shape)
        if len(shape) == 1:  # (L,) -> one channel
            shape = (1, shape[0])
        if len(shape) == 3:
            conv, maxpool, kernel = nn.Conv2d, nn.MaxPool2d, 3
            final: nn.Module = nn.AdaptiveAvgPool2d((2, 2))
            final_numel = 4
        elif len(shape) == 2:
            conv, maxpool, kernel = nn.Conv1d, nn.MaxPool1d, 5
            final = nn.AdaptiveAvgPool1d(10)
            final_numel = 10
        else:
            raise ValueError(f"small_cnn wants in_shape (C, H, W), (C, L) or (L,); got {in_shape}")
        self.in_shape = shape
        c1, c2, c3 = channels
        pad = kernel // 2
        self.features = nn.Sequential(
            conv(shape[0], c1, kernel, padding=pad),
            nn.ReLU(inplace=True),
            conv(c1, c2, kernel, padding=pad),
            nn.ReLU(inplace=True),
            maxpool(2),
            conv(c2, c3, kernel, padding=pad),
            nn.ReLU(inplace=True),
            final,
        )
        self.fc = nn.Linear(c3 * final_numel, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, *in_shape) -> (N, num_classes) logits."""
        if x.dim() == len(self.in_shape):  # (N, L) signals without the channel axis
            x = x.unsqueeze(1)
        return self.fc(torch.flatten(self.features(x), 1))


def flat_size(in_shape: Sequence[int]) -> int:
    """Number of values per sample for an ``in_shape``."""
    return int(math.prod(in_shape))
