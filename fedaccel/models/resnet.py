"""ResNets with GroupNorm (no BatchNorm) and a CIFAR stem.

``GroupNorm(2, C)`` replaces every BatchNorm, following FedACG's reference code
(``nn.GroupNorm(2, planes)``): batch statistics do not federate well under
non-IID data and small local batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

#: number of GroupNorm groups used everywhere
NORM_GROUPS = 2


def norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(NORM_GROUPS, channels)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection.

    The shortcut is the identity when the shape is unchanged, otherwise a
    1x1 convolution (with the block's stride) followed by GroupNorm.
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.norm2 = norm(planes)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                norm(planes),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """BasicBlock ResNet with a CIFAR stem (3x3 conv, stride 1, no max-pool).

    ``widths[i]`` channels and ``num_blocks[i]`` blocks in stage ``i``; every
    stage after the first halves the resolution.  Global average pooling, then
    the classifier ``fc``.
    """

    def __init__(
        self,
        num_blocks: tuple[int, ...],
        widths: tuple[int, ...],
        num_classes: int,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if len(num_blocks) != len(widths):
            raise ValueError("num_blocks and widths must have the same length")
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.norm1 = norm(widths[0])
        in_planes = widths[0]
        stages = []
        for i, (n, w) in enumerate(zip(num_blocks, widths)):
            stride = 1 if i == 0 else 2
            blocks = []
            for j in range(n):
                blocks.append(BasicBlock(in_planes, w, stride if j == 0 else 1))
                in_planes = w
            stages.append(nn.Sequential(*blocks))
        # register as layer1..layerN (torchvision-style names)
        for i, stage in enumerate(stages, start=1):
            self.add_module(f"layer{i}", stage)
        self.num_stages = len(stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_planes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        for i in range(1, self.num_stages + 1):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(self.flatten(self.pool(x)))


def resnet18(num_classes: int, in_channels: int = 3) -> ResNet:
    """ResNet-18 (2-2-2-2 BasicBlocks, widths 64-128-256-512), GroupNorm(2, C)."""
    return ResNet((2, 2, 2, 2), (64, 128, 256, 512), num_classes, in_channels)


def resnet34(num_classes: int, in_channels: int = 3) -> ResNet:
    """ResNet-34 (3-4-6-3 BasicBlocks, widths 64-128-256-512), GroupNorm(2, C)."""
    return ResNet((3, 4, 6, 3), (64, 128, 256, 512), num_classes, in_channels)


def resnet20(num_classes: int, in_channels: int = 3) -> ResNet:
    """CIFAR ResNet-20 of He et al. 2016 (3 stages x 3 BasicBlocks, widths 16-32-64).

    GroupNorm(2, C) instead of BatchNorm (as in FedCDR's table 9); projection
    shortcuts (1x1 conv + norm) where the shape changes, i.e. He et al.'s
    option B rather than the zero-padding option A.
    """
    return ResNet((3, 3, 3), (16, 32, 64), num_classes, in_channels)
