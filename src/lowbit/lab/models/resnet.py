"""Residual networks (He et al. 2016): ImageNet ResNet-50/152 and CIFAR ResNet-110.

* ImageNet ResNets use bottleneck blocks (1x1 reduce, 3x3, 1x1 expand by 4) in four stages of
  64/128/256/512 inner channels, with a 1x1-convolution + BN projection shortcut where the shape
  changes. Blocks per stage: [3, 4, 6, 3] for ResNet-50 (25,557,032 parameters, the seed's "25M") and
  [3, 8, 36, 3] for ResNet-152 (60,192,808, the seed's "60M"). The stride sits on the 3x3
  convolution (the "v1.5" placement CNTK's examples also offer); it does not change the count.
* CIFAR ResNet-110 uses basic blocks (two 3x3 convolutions) in three stages of 16/32/64 channels,
  18 blocks each, on 32x32 inputs. Like CNTK's ``ResNet110_CIFAR10.cntk`` (the seed's build) the
  first block of stages 2 and 3 has a 1x1-convolution + BN projection shortcut; that gives 1,730,714
  parameters (He et al. quote 1.7M). The seed's table prints "1M": its counts are whole millions
  rounded down (13.6M prints as 13M for the LSTM too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Bottleneck", "BasicBlock", "ImageNetResNet", "CifarResNet"]


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Convolution without bias followed by batch normalisation (CNTK's ``ConvBNLayer``)."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 (x4) residual block; a projection shortcut when the shape changes."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int = 1) -> None:
        super().__init__()
        c_out = width * self.expansion
        self.body = nn.Sequential(
            _conv_bn(c_in, width, 1),
            nn.ReLU(inplace=True),
            _conv_bn(width, width, 3, stride),
            nn.ReLU(inplace=True),
            _conv_bn(width, c_out, 1),
        )
        self.shortcut: nn.Module = (
            _conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class BasicBlock(nn.Module):
    """3x3 -> 3x3 residual block; a projection shortcut when the shape changes (as in CNTK)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv_bn(c_in, c_out, 3, stride),
            nn.ReLU(inplace=True),
            _conv_bn(c_out, c_out, 3),
        )
        self.shortcut: nn.Module = (
            _conv_bn(c_in, c_out, 1, stride) if stride != 1 or c_in != c_out else nn.Identity()
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


def _init_weights(model: nn.Module) -> None:
    """He-normal convolutions, unit BN scale, zero BN shift (the papers' and CNTK's choice)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class ImageNetResNet(nn.Module):
    """Bottleneck ResNet for 224x224 images: 7x7 stem, four stages, global pool, one dense layer."""

    def __init__(
        self, blocks: Sequence[int], num_classes: int = 1000, in_channels: int = 3
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _conv_bn(in_channels, 64, 7, stride=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        c_in = 64
        for i, (n, width) in enumerate(zip(blocks, (64, 128, 256, 512))):
            layers: list[nn.Module] = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(Bottleneck(c_in, width, stride))
                c_in = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, C, H, W) images -> (N, num_classes) logits."""
        x = self.stages(self.stem(x))  # (N, 2048, H/32, W/32)
        return self.fc(torch.flatten(self.pool(x), 1))


class CifarResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 images: 3x3 stem, three stages of ``n`` basic blocks, pool, dense."""

    def __init__(
        self,
        blocks_per_stage: int = 18,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: Sequence[int] = (16, 32, 64),
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(in_channels, widths[0], 3), nn.ReLU(inplace=True))
        stages: list[nn.Module] = []
        c_in = widths[0]
        for i, width in enumerate(widths):
            layers: list[nn.Module] = []
            for j in range(blocks_per_stage):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(BasicBlock(c_in, width, stride))
                c_in = width
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        _init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, C, H, W) images -> (N, num_classes) logits."""
        x = self.stages(self.stem(x))  # (N, 64, H/4, W/4)
        return self.fc(torch.flatten(self.pool(x), 1))
