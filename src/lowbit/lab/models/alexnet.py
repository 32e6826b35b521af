"""AlexNet as CNTK builds it (the network of the seed's Figure 3: 62M parameters).

CNTK's ``AlexNet_ImageNet.cntk`` is the single-tower AlexNet of Krizhevsky et al. (2012) without the
two-GPU grouping: convolutions of 96, 192, 384, 384 and 256 maps, local response normalisation after
the first two, three fully connected layers of 4096, 4096 and 1000 units with dropout 0.5, on
227x227x3 crops. That has 62,003,496 parameters, which is the seed's "62M"; torchvision's AlexNet
(64-192-384-256-256 maps, no LRN) has 61,100,840.

The classifier sees the 6x6x256 map through an adaptive average pool, so 224x224 inputs work too
(at 227x227 the pool is the identity).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["AlexNet"]


class AlexNet(nn.Module):
    """CNTK's AlexNet: five convolutions (two with LRN), three dense layers with dropout."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3, dropout: float = 0.5) -> None:
        super().__init__()
        # LRN {k=1, n=2 (half radius), alpha=1e-4, beta=0.75} in CNTK; torch's size is the full window.
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 96, kernel_size=11, stride=4),
            nn.ReLU(inplace=True),
            nn.LocalResponseNorm(size=5, alpha=1e-4, beta=0.75, k=1.0),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(96, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.LocalResponseNorm(size=5, alpha=1e-4, beta=0.75, k=1.0),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.pool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, C, H, W) images -> (N, num_classes) logits."""
        x = self.pool(self.features(x))  # (N, 256, 6, 6)
        return self.classifier(torch.flatten(x, 1))
