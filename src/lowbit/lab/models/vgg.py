"""VGG-19 (Simonyan & Zisserman 2015, configuration E): 143,667,240 parameters, the seed's "143M".

Sixteen 3x3 convolutions in five stages (64, 128, 256, 512, 512 maps) and three dense layers of
4096, 4096 and ``num_classes`` units with dropout 0.5. Without batch normalisation, as in CNTK's
``VGG19_ImageNet`` example and the paper. Most of the parameters (and so of the gradient traffic:
about 102M of the 143M) sit in the first dense layer, which is why VGG gains most from compression.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VGG", "VGG19_CONFIG"]

#: Channels per convolution; "M" is a 2x2 max pool.
VGG19_CONFIG: tuple[int | str, ...] = (
    64, 64, "M",
    128, 128, "M",
    256, 256, 256, 256, "M",
    512, 512, 512, 512, "M",
    512, 512, 512, 512, "M",
)  # fmt: skip


class VGG(nn.Module):
    """Plain VGG: the convolution stack of ``config`` and a three-layer classifier."""

    def __init__(
        self,
        num_classes: int = 1000,
        in_channels: int = 3,
        config: tuple[int | str, ...] = VGG19_CONFIG,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for item in config:
            if item == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                assert isinstance(item, int)
                layers += [nn.Conv2d(channels, item, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                channels = item
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(channels * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, C, H, W) images -> (N, num_classes) logits."""
        x = self.pool(self.features(x))  # (N, 512, 7, 7)
        return self.classifier(torch.flatten(x, 1))
