"""Model zoo for fedaccel.

Every model maps a float tensor of shape ``(B, *input_shape)`` to logits of shape
``(B, num_classes)``.  Conventions shared by all models:

* The final classifier layer is always called ``fc``, so ``fc.weight`` and
  ``fc.bias`` are the last two tensors of ``named_parameters()``; feature layers
  come first, in their natural definition order.
* Parameters use PyTorch's default initialisation; seed with
  ``torch.manual_seed`` before calling :func:`build_model` for reproducibility.
* No BatchNorm anywhere (running statistics do not federate well); the ResNets
  use ``GroupNorm(2, C)`` as in FedACG's reference code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from torch import nn

from .nets import CifarCNN, LogReg, McMahanCNN, MLP, MLP200, mlp_hidden_size
from .resnet import BasicBlock, ResNet, resnet18, resnet20, resnet34

__all__ = [
    "MODELS",
    "DEFAULT_MODELS",
    "ModelError",
    "build_model",
    "count_parameters",
    "default_model",
    "mlp_hidden_size",
    "LogReg",
    "MLP",
    "MLP200",
    "McMahanCNN",
    "CifarCNN",
    "BasicBlock",
    "ResNet",
]

MODELS: tuple[str, ...] = (
    "logreg",
    "mlp",
    "mlp200",
    "cnn",
    "cnn-small",
    "cifar-cnn",
    "resnet18",
    "resnet34",
    "resnet20",
)

#: dataset name -> default model name
DEFAULT_MODELS: dict[str, str] = {
    "synthetic": "mlp",
    "digits": "mlp",
    "breast-cancer": "logreg",
    "mnist": "cnn",
    "fashion-mnist": "cnn",
    "cifar10": "cifar-cnn",
    "cifar100": "resnet18",
}


class ModelError(ValueError):
    """Bad model configuration (unknown name, incompatible input shape, ...)."""


def _image_shape(name: str, shape: tuple[int, ...], min_side: int) -> None:
    if len(shape) != 3 or min(shape[1:]) < min_side:
        raise ModelError(
            f"model: {name!r} cannot take input_shape {shape}; "
            f"it needs an image shape (C, H, W) with H, W >= {min_side}"
        )


def _flat(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


_BUILDERS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "logreg": lambda s, k: LogReg(_flat(s), k),
    "mlp": lambda s, k: MLP(_flat(s), k),
    "mlp200": lambda s, k: MLP200(_flat(s), k),
    "cnn": lambda s, k: McMahanCNN(s, k),
    "cnn-small": lambda s, k: McMahanCNN(s, k, channels=(16, 32), hidden=128),
    "cifar-cnn": lambda s, k: CifarCNN(s, k),
    "resnet18": lambda s, k: resnet18(k, in_channels=s[0]),
    "resnet34": lambda s, k: resnet34(k, in_channels=s[0]),
    "resnet20": lambda s, k: resnet20(k, in_channels=s[0]),
}

# smallest spatial side each image model accepts
_MIN_SIDE: dict[str, int] = {
    "cnn": McMahanCNN.MIN_SIDE,
    "cnn-small": McMahanCNN.MIN_SIDE,
    "cifar-cnn": CifarCNN.MIN_SIDE,
    "resnet18": 1,
    "resnet34": 1,
    "resnet20": 1,
}


def build_model(name: str, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """Build model ``name`` for inputs of shape ``(B, *input_shape)``.

    Raises :class:`ModelError` for an unknown name, an input shape the model
    cannot take (e.g. a ResNet on a flat ``(60,)`` vector), or a bad class count.
    """
    if name not in _BUILDERS:
        raise ModelError(
            f"model: unknown model {name!r}; expected one of: {', '.join(MODELS)}"
        )
    try:
        shape = tuple(int(d) for d in input_shape)
    except (TypeError, ValueError):
        raise ModelError(
            f"model: {name!r} got input_shape {input_shape!r}; expected a tuple of ints"
        ) from None
    if not shape or min(shape) < 1:
        raise ModelError(
            f"model: {name!r} cannot take input_shape {shape}; dimensions must be >= 1"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ModelError(f"model: {name!r} got num_classes={num_classes!r}; expected an int >= 1")
    if name in _MIN_SIDE:
        _image_shape(name, shape, _MIN_SIDE[name])
    return _BUILDERS[name](shape, num_classes)


def default_model(dataset: str) -> str:
    """Default model name for a dataset (see :data:`DEFAULT_MODELS`)."""
    try:
        return DEFAULT_MODELS[dataset]
    except (KeyError, TypeError):
        raise ModelError(
            f"dataset: unknown dataset {dataset!r}; expected one of: "
            f"{', '.join(DEFAULT_MODELS)}"
        ) from None


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars in ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

