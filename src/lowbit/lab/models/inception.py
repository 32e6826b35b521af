"""BN-Inception (Ioffe & Szegedy 2015, "Inception-v2"): the seed's "11M" network.

The network of the batch-normalisation paper, as CNTK's ``BN-Inception.bs`` builds it: every
convolution is conv (no bias) -> BN -> ReLU; GoogLeNet's 5x5 branches are replaced by two stacked
3x3 convolutions; modules 3c and 4e reduce the resolution with stride-2 branches and a max-pool
pass-through instead of a separate pooling layer. 224x224x3 in, a 7x7 global average pool and one
dense layer out (no auxiliary classifiers).

Stem: 7x7/2 conv 64 -> 3x3/2 max pool -> 1x1 conv 64 -> 3x3 conv 192 -> 3x3/2 max pool.

Each module is written ``(1x1, 3x3 reduce, 3x3, double-3x3 reduce, double-3x3, pool proj, pool)``,
the columns of the paper's Figure 5 table and CNTK's macro arguments.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BNInception", "BN_INCEPTION_MODULES"]

#: name -> (n1x1, n3x3r, n3x3, ndblr, ndbl, npool, pool kind); "pass" = stride-2 module with a
#: max-pool pass-through branch and no 1x1 / pool-projection branches.
BN_INCEPTION_MODULES: tuple[tuple[str, int, int, int, int, int, int, str], ...] = (
    ("3a", 64, 64, 64, 64, 96, 32, "avg"),
    ("3b", 64, 64, 96, 64, 96, 64, "avg"),
    ("3c", 0, 128, 160, 64, 96, 0, "pass"),
    ("4a", 224, 64, 96, 96, 128, 128, "avg"),
    ("4b", 192, 96, 128, 96, 128, 128, "avg"),
    ("4c", 160, 128, 160, 128, 160, 128, "avg"),
    ("4d", 96, 128, 192, 160, 192, 128, "avg"),
    ("4e", 0, 128, 192, 192, 256, 0, "pass"),
    ("5a", 352, 192, 320, 160, 224, 128, "avg"),
    ("5b", 352, 192, 320, 192, 224, 128, "max"),
)


def _cbr(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """conv (no bias) -> BN -> ReLU, 'same' padding."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class InceptionModule(nn.Module):
    """One BN-Inception module; its branches are concatenated along channels."""

    def __init__(
        self, c_in: int, n1x1: int, n3x3r: int, n3x3: int, ndblr: int, ndbl: int, npool: int, pool: str
    ) -> None:
        super().__init__()
        stride = 2 if pool == "pass" else 1
        branches: list[nn.Module] = []
        if n1x1:
            branches.append(_cbr(c_in, n1x1, 1))
        branches.append(nn.Sequential(_cbr(c_in, n3x3r, 1), _cbr(n3x3r, n3x3, 3, stride)))
        branches.append(
            nn.Sequential(_cbr(c_in, ndblr, 1), _cbr(ndblr, ndbl, 3), _cbr(ndbl, ndbl, 3, stride))
        )
        if pool == "pass":
            branches.append(nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True))
            self.out_channels = n3x3 + ndbl + c_in
        else:
            pooling: nn.Module = (
                nn.AvgPool2d(kernel_size=3, stride=1, padding=1, count_include_pad=False)
                if pool == "avg"
                else nn.MaxPool2d(kernel_size=3, stride=1, padding=1)
            )
            branches.append(nn.Sequential(pooling, _cbr(c_in, npool, 1)))
            self.out_channels = n1x1 + n3x3 + ndbl + npool
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


class BNInception(nn.Module):
    """BN-Inception for ImageNet: stem, ten inception modules, global average pool, dense layer."""

    def __init__(self, num_classes: int = 1000, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            _cbr(in_channels, 64, 7, stride=2),  # 112x112
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),  # 56x56
            _cbr(64, 64, 1),
            _cbr(64, 192, 3),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),  # 28x28
        )
        modules: list[nn.Module] = []
        c_in = 192
        for _name, *widths, pool in BN_INCEPTION_MODULES:
            module = InceptionModule(c_in, *widths, pool=pool)  # type: ignore[arg-type]
            modules.append(module)
            c_in = module.out_channels
        self.inception = nn.Sequential(*modules)  # 28 -> 14 (3c) -> 7 (4e); 1024 channels out
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: (N, C, H, W) images -> (N, num_classes) logits."""
        x = self.inception(self.stem(x))  # (N, 1024, 7, 7) at 224x224
        return self.fc(torch.flatten(self.pool(x), 1))
