"""Tests for the models package."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedaccel.models import MODELS, ModelError, build_model, count_parameters, default_model

# one compatible default input shape (and class count) per model
DEFAULT_INPUT: dict[str, tuple[tuple[int, ...], int]] = {
    "logreg": ((60,), 10),
    "mlp": ((60,), 10),
    "mlp200": ((1, 28, 28), 10),
    "cnn": ((1, 28, 28), 10),
    "cnn-small": ((1, 28, 28), 10),
    "cifar-cnn": ((3, 32, 32), 10),
    "resnet18": ((3, 32, 32), 100),
    "resnet34": ((3, 32, 32), 100),
    "resnet20": ((3, 32, 32), 10),
}

# further shapes the small models must accept
EXTRA_CASES = [
    ("logreg", (1, 8, 8), 2),
    ("logreg", (1, 28, 28), 10),
    ("mlp", (1, 8, 8), 10),
    ("mlp", (1, 28, 28), 10),
    ("mlp200", (60,), 10),
    ("cnn", (1, 8, 8), 10),
    ("cnn", (3, 32, 32), 10),
    ("cifar-cnn", (1, 28, 28), 10),
    ("resnet20", (1, 28, 28), 10),
]

CASES = [(n, *DEFAULT_INPUT[n]) for n in MODELS] + EXTRA_CASES


def test_registry_covers_all_models() -> None:
    assert MODELS == (
        "logreg", "mlp", "mlp200", "cnn", "cnn-small", "cifar-cnn", "resnet18", "resnet34", "resnet20",
    )
    assert set(DEFAULT_INPUT) == set(MODELS)


@pytest.mark.parametrize(("name", "shape", "classes"), CASES)
def test_forward_backward(name: str, shape: tuple[int, ...], classes: int) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, classes)
    x = torch.randn(2, *shape)
    y = model(x)
    assert y.shape == (2, classes)
    assert torch.isfinite(y).all()
    loss = nn.functional.cross_entropy(y, torch.tensor([0, 1]))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("name", "shape", "classes", "expected"),
    [
        ("logreg", (60,), 10, 60 * 10 + 10),
        ("logreg", (60,), 2, 60 * 2 + 2),
        ("mlp", (60,), 10, 60 * 32 + 32 + 32 * 10 + 10),  # 2282
        ("mlp", (1, 28, 28), 10, 784 * 128 + 128 + 128 * 10 + 10),  # 101770
        ("mlp", (1, 8, 8), 10, 64 * 32 + 32 + 32 * 10 + 10),  # d <= 100 -> h = 32
        ("mlp200", (1, 28, 28), 10, 784 * 200 + 200 + 200 * 200 + 200 + 200 * 10 + 10),
        ("cnn", (1, 28, 28), 10, 1_663_370),
        (
            "cnn-small", (1, 28, 28), 10,
            (5 * 5 * 1 * 16 + 16) + (5 * 5 * 16 * 32 + 32)
            + (7 * 7 * 32 * 128 + 128) + (128 * 10 + 10),
        ),
        (
            "cnn", (1, 28, 28), 10,
            (5 * 5 * 1 * 32 + 32) + (5 * 5 * 32 * 64 + 64)
            + (7 * 7 * 64 * 512 + 512) + (512 * 10 + 10),
        ),
        (
            "cnn", (3, 32, 32), 10,
            (5 * 5 * 3 * 32 + 32) + (5 * 5 * 32 * 64 + 64)
            + (8 * 8 * 64 * 512 + 512) + (512 * 10 + 10),
        ),
        (
            "cifar-cnn", (3, 32, 32), 10,
            (5 * 5 * 3 * 64 + 64) + (5 * 5 * 64 * 64 + 64)
            + (5 * 5 * 64 * 384 + 384) + (384 * 192 + 192) + (192 * 10 + 10),
        ),
    ],
)
def test_parameter_counts(name: str, shape: tuple[int, ...], classes: int, expected: int) -> None:
    assert count_parameters(build_model(name, shape, classes)) == expected


def test_resnet_parameter_counts_plausible() -> None:
    # ResNet-20 ~0.27M, ResNet-18 ~11.2M; exact values pin the architecture.
    assert count_parameters(build_model("resnet20", (3, 32, 32), 10)) == 272_474
    assert count_parameters(build_model("resnet18", (3, 32, 32), 100)) == 11_220_132
    assert count_parameters(build_model("resnet34", (3, 32, 32), 100)) == 21_328_292


@pytest.mark.parametrize("name", MODELS)
def test_classifier_is_last_and_named_fc(name: str) -> None:
    shape, classes = DEFAULT_INPUT[name]
    model = build_model(name, shape, classes)
    names = [n for n, _ in model.named_parameters()]
    assert names[-2:] == ["fc.weight", "fc.bias"]
    assert isinstance(model.fc, nn.Linear)
    assert model.fc.out_features == classes


@pytest.mark.parametrize("name", MODELS)
def test_no_batchnorm(name: str) -> None:
    shape, classes = DEFAULT_INPUT[name]
    model = build_model(name, shape, classes)
    bn_types = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    assert not any(isinstance(m, bn_types) for m in model.modules())
    assert not any("BatchNorm" in type(m).__name__ for m in model.modules())


@pytest.mark.parametrize("name", ["resnet18", "resnet34", "resnet20"])
def test_resnets_use_groupnorm_with_two_groups(name: str) -> None:
    shape, classes = DEFAULT_INPUT[name]
    model = build_model(name, shape, classes)
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert gns and all(m.num_groups == 2 for m in gns)
    # CIFAR stem: 3x3 stride-1 conv, no max-pool
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())


def test_resnet_depths() -> None:
    def blocks(model: nn.Module) -> list[int]:
        return [len(getattr(model, f"layer{i}")) for i in range(1, model.num_stages + 1)]

    assert blocks(build_model("resnet18", (3, 32, 32), 10)) == [2, 2, 2, 2]
    assert blocks(build_model("resnet34", (3, 32, 32), 10)) == [3, 4, 6, 3]
    r20 = build_model("resnet20", (3, 32, 32), 10)
    assert blocks(r20) == [3, 3, 3]
    assert r20.fc.in_features == 64


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_same_weights(name: str) -> None:
    shape, classes = DEFAULT_INPUT[name]
    torch.manual_seed(123)
    a = build_model(name, shape, classes).state_dict()
    torch.manual_seed(123)
    b = build_model(name, shape, classes).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_different_seed_different_weights() -> None:
    torch.manual_seed(1)
    a = build_model("mlp", (60,), 10)
    torch.manual_seed(2)
    b = build_model("mlp", (60,), 10)
    assert not torch.equal(a.fc1.weight, b.fc1.weight)


def test_unknown_model_error() -> None:
    with pytest.raises(ModelError) as exc:
        build_model("vgg16", (3, 32, 32), 10)
    msg = str(exc.value)
    assert "\n" not in msg
    assert "model" in msg and "vgg16" in msg
    for name in MODELS:
        assert name in msg
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("resnet18", (60,)),
        ("resnet34", (60,)),
        ("resnet20", (60,)),
        ("cnn", (60,)),
        ("cifar-cnn", (60,)),
        ("cifar-cnn", (1, 8, 8)),
        ("cnn", (1, 2, 2)),
        ("mlp", (0,)),
    ],
)
def test_incompatible_shape_error(name: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ModelError) as exc:
        build_model(name, shape, 10)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("model")
    assert name in msg and str(shape) in msg


@pytest.mark.parametrize("classes", [0, -1, 2.5])
def test_bad_num_classes(classes: object) -> None:
    with pytest.raises(ModelError):
        build_model("mlp", (60,), classes)  # type: ignore[arg-type]


def test_input_shape_list_accepted() -> None:
    model = build_model("cnn", [1, 28, 28], 10)
    assert model(torch.zeros(1, 1, 28, 28)).shape == (1, 10)


@pytest.mark.parametrize(
    ("dataset", "expected"),
    [
        ("synthetic", "mlp"),
        ("digits", "mlp"),
        ("mnist", "cnn"),
        ("fashion-mnist", "cnn"),
        ("cifar10", "cifar-cnn"),
        ("cifar100", "resnet18"),
    ],
)
def test_default_model(dataset: str, expected: str) -> None:
    assert default_model(dataset) == expected
    assert default_model(dataset) in MODELS


def test_default_model_unknown_dataset() -> None:
    with pytest.raises(ModelError, match="imagenet"):
        default_model("imagenet")
