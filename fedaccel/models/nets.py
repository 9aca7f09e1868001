"""Small fully-connected and convolutional models."""

from __future__ import annotations

import torch
from torch import nn


def batched_linear(x_t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``nn.Linear`` for C models at once, feature-major: ``x_t`` ``[C, in, B]``,
    ``weight`` ``[C, out, in]``, ``bias`` ``[C, out]`` -> ``[C, out, B]`` (one
    ``baddbmm``, ``W x + b`` per client).

    Feature-major because the weight's gradient, ``grad_out @ x_t^T``, then
    comes out in the weight's own layout: with ``x @ W^T`` it is the transpose
    of a contiguous tensor, and the optimizer's elementwise step over such
    strided tensors cost twice as much (60-32-10 MLP, 100 clients: 0.47 ms
    against 0.20 ms per step; bench/overhead.py)."""
    return torch.baddbmm(bias.unsqueeze(2), weight, x_t)


def features_first(x: torch.Tensor) -> torch.Tensor:
    """``[C, B, ...]`` inputs as the ``[C, in, B]`` view :func:`batched_linear` takes."""
    return x.flatten(2).transpose(1, 2)


def mlp_hidden_size(in_features: int) -> int:
    """Hidden width of the ``mlp`` model: 32 when ``in_features <= 100`` else 128.

    32 reproduces the 60-32-10 MLP of FedProx / FedCDR on the synthetic data;
    128 gives the usual 784-128-10 MNIST MLP.
    """
    return 32 if in_features <= 100 else 128


class LogReg(nn.Module):
    """Multinomial logistic regression: Flatten + Linear(d, classes).

    Always ``num_classes`` logits (2 logits for a binary task, not 1).
    """

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(x))

    @staticmethod
    def batched_forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of C models at once (weights ``p`` stacked, ``x`` ``[C, B, ...]``);
        the logits ``[C, B, classes]`` are a view of a feature-major result."""
        return batched_linear(features_first(x), p["fc.weight"], p["fc.bias"]).transpose(1, 2)


class MLP(nn.Module):
    """One-hidden-layer MLP: d - h - classes with ReLU.

    The hidden width follows :func:`mlp_hidden_size`: ``h = 32`` when
    ``d <= 100`` (the FedProx/FedCDR 60-32-10 MLP) and ``h = 128`` otherwise
    (784-128-10).  Pass ``hidden`` to override.
    """

    def __init__(self, in_features: int, num_classes: int, hidden: int | None = None) -> None:
        super().__init__()
        h = mlp_hidden_size(in_features) if hidden is None else hidden
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(in_features, h)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(h, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.relu(self.fc1(self.flatten(x))))

    @staticmethod
    def batched_forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of C models at once (weights ``p`` stacked, ``x`` ``[C, B, ...]``);
        the logits ``[C, B, classes]`` are a view of a feature-major result."""
        h = torch.relu(batched_linear(features_first(x), p["fc1.weight"], p["fc1.bias"]))
        return batched_linear(h, p["fc.weight"], p["fc.bias"]).transpose(1, 2)


class MLP200(nn.Module):
    """The "2NN" of McMahan et al. 2017: d - 200 - 200 - classes with ReLU."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 200) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.flatten(x)))
        x = self.relu(self.fc2(x))
        return self.fc(x)

    @staticmethod
    def batched_forward(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` of C models at once (weights ``p`` stacked, ``x`` ``[C, B, ...]``);
        the logits ``[C, B, classes]`` are a view of a feature-major result."""
        h = torch.relu(batched_linear(features_first(x), p["fc1.weight"], p["fc1.bias"]))
        h = torch.relu(batched_linear(h, p["fc2.weight"], p["fc2.bias"]))
        return batched_linear(h, p["fc.weight"], p["fc.bias"]).transpose(1, 2)


class McMahanCNN(nn.Module):
    """The two-convolution CNN of McMahan et al. 2017 (FedAvg paper).

    conv5x5(32, pad 2) - ReLU - maxpool2 - conv5x5(64, pad 2) - ReLU - maxpool2
    - Linear(-> 512) - ReLU - Linear(512 -> classes).  The flatten size is
    computed from ``input_shape``: 64*7*7 for 1x28x28 (1,663,370 parameters with
    10 classes), 64*8*8 for 3x32x32, 64*2*2 for 1x8x8.

    ``channels``/``hidden`` narrow it: model ``cnn-small`` is the same network
    with (16, 32) channels and 128 hidden units (215,370 parameters on 1x28x28),
    about 8x cheaper per sample on a CPU, for benchmarks that must fit a CPU
    budget.
    """

    MIN_SIDE = 4  # two 2x2 max-pools need H, W >= 4

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int,
                 channels: tuple[int, int] = (32, 64), hidden: int = 512) -> None:
        super().__init__()
        c, h, w = input_shape
        c1, c2 = channels
        self.conv1 = nn.Conv2d(c, c1, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(c1, c2, kernel_size=5, padding=2)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(c2 * (h // 2 // 2) * (w // 2 // 2), hidden)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.relu(self.fc1(self.flatten(x)))
        return self.fc(x)


class CifarCNN(nn.Module):
    """Small CIFAR CNN of FedDyn (Acar et al. 2021), also used by FedACG.

    It is the TensorFlow-tutorial CIFAR model that the FedAvg paper used, with
    unpadded convolutions: conv5x5(64) - ReLU - maxpool2 - conv5x5(64) - ReLU -
    maxpool2 - Linear(-> 384) - ReLU - Linear(384 -> 192) - ReLU -
    Linear(192 -> classes).  On 3x32x32 the flatten size is 64*5*5 = 1600 and
    the model has 797,962 parameters with 10 classes (815,332 with 100).
    """

    MIN_SIDE = 16  # smallest side that leaves >= 1 pixel after conv-pool-conv-pool

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        c, h, w = input_shape

        def out(side: int) -> int:
            return ((side - 4) // 2 - 4) // 2

        self.conv1 = nn.Conv2d(c, 64, kernel_size=5)
        self.conv2 = nn.Conv2d(64, 64, kernel_size=5)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64 * out(h) * out(w), 384)
        self.fc2 = nn.Linear(384, 192)
        self.fc = nn.Linear(192, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.relu(self.fc1(self.flatten(x)))
        x = self.relu(self.fc2(x))
        return self.fc(x)
