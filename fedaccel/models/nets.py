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


class LinearChain:
    """Mixin for models that are ``Linear`` layers with ReLU between them, on
    flattened inputs (:class:`LogReg`, :class:`MLP`, :class:`MLP200`); ``chain``
    names the layers in order. Gives the cohort trainer C copies at once:

    - :meth:`batched_forward`: one :func:`batched_linear` per layer;
    - :meth:`batched_loss_and_grads`: each copy's mean cross-entropy over its
      real samples and its gradient, with the backward pass written out.

    Written by hand because autograd's engine costs more than the arithmetic
    on these models: for the 60-32-10 MLP at batch 16, a batched forward and
    backward of one client took 182 us through ``torch.autograd.grad`` and 73 us
    written out (293 against 112 us for 10 clients, 620 against 449 us for
    100; one thread, micro-benchmark). It is bit for bit what autograd
    computes, not merely close (``tests/test_cohort.py`` checks ``torch.equal``
    for every model here): each step is the derivative op autograd itself
    calls for the forward op (``derivatives.yaml``): ``bmm`` for ``baddbmm``'s
    weight, a sum over the batch for its bias, ``threshold_backward`` for ReLU,
    ``_log_softmax_backward_data`` for log-softmax (whose fast ``exp`` differs
    from ``torch.exp`` in the last bit), and ``nll_loss``'s scatter of
    ``-grad`` at each target.
    """

    chain: tuple[str, ...] = ()

    @classmethod
    def chain_is_forward(cls) -> bool:
        """Whether ``chain`` still describes this class's ``forward``: False for
        a subclass that overrides ``forward`` (or the batched methods) below the
        class that names the chain, whose batched methods would then compute
        its parent's network; the cohort trainer then uses ``vmap`` and autograd."""
        for klass in cls.__mro__:
            if "chain" in vars(klass):
                return True
            if {"forward", "batched_forward", "batched_loss_and_grads", "nll_gradients",
                "batched_layer_inputs", "_activations"} & set(vars(klass)):
                return False
        return False

    @classmethod
    def _activations(cls, p: dict[str, torch.Tensor], x: torch.Tensor, logits: bool = True) -> list[torch.Tensor]:
        """Each layer's input, feature-major ``[C, features, B]``, then (``logits``) the logits ``[C, classes, B]``."""
        acts = [features_first(x)]
        for i, name in enumerate(cls.chain if logits else cls.chain[:-1]):
            z = batched_linear(acts[-1], p[f"{name}.weight"], p[f"{name}.bias"])
            acts.append(torch.relu(z) if i < len(cls.chain) - 1 else z)
        return acts

    @classmethod
    def batched_layer_inputs(cls, p: dict[str, torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer of ``chain``'s input for C models at once (weights ``p``
        stacked, ``x`` ``[C, B, ...]``), feature-major ``[C, features, B]``
        (FedPM's batched FOOF pass, :func:`fedaccel.clients.foof.stacked_foof`)."""
        return cls._activations(p, x, logits=False)

    @classmethod
    def batched_forward(cls, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``forward`` of C models at once (weights ``p`` stacked, ``x`` ``[C, B, ...]``);
        the logits ``[C, B, classes]`` are a view of a feature-major result."""
        return cls._activations(p, x)[-1].transpose(1, 2)

    @classmethod
    def nll_gradients(cls, p: dict[str, torch.Tensor], target: torch.Tensor,
                      label_grad: torch.Tensor) -> torch.Tensor:
        """``nll_loss``'s backward for any number of mini-batches at once:
        ``label_grad`` ``[K, 1, B]`` scattered at each label ``target`` ``[K,
        1, B]`` into zeros ``[K, classes, B]`` (``classes`` the last layer's
        outputs). :meth:`batched_loss_and_grads` forms its mini-batches' own
        when it is not given ``nll_grad``; the cohort trainer forms a round's
        at once, two kernels fewer a step."""
        bias = p[f"{cls.chain[-1]}.bias"]
        shape = (target.shape[0], bias.shape[-1], target.shape[-1])
        return torch.zeros(shape, dtype=label_grad.dtype, device=label_grad.device).scatter_(1, target, label_grad)

    @classmethod
    def batched_loss_and_grads(cls, p: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor,
                               label_grad: torch.Tensor,
                               nll_grad: torch.Tensor | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each client's gradient of its mean cross-entropy over its real
        samples, and each sample's log-probability of its label.

        ``x`` ``[C, B, ...]``; ``target`` ``[C, 1, B]``: the labels; and
        ``label_grad`` ``[C, 1, B]``: the derivative of the sum of the
        clients' losses by each sample's log-probability at its label,
        ``-real / count`` as autograd forms it
        (:func:`fedaccel.clients.cohort.label_gradients`; 0 for a padded
        sample). Both are formed once per round by the trainer. Returns the
        gradients by parameter name, exactly ``torch.autograd.grad(losses.sum(),
        p)`` with ``losses = (cross_entropy(logits, y, 'none') * real).sum(1) /
        count``, and ``log_softmax(logits)`` at each label ``[C, 1, B]`` (minus
        each sample's cross-entropy, bit for bit: the trainer reduces them to
        the losses once per round, not once per step). ``nll_grad``: these
        mini-batches' rows of :meth:`nll_gradients`, if formed already."""
        with torch.no_grad():
            acts = cls._activations(p, x)
            log_probs = torch.log_softmax(acts[-1], dim=1)  # cross_entropy = log_softmax + nll_loss
            # nll_loss's backward: label_grad scattered at each label
            grad = cls.nll_gradients(p, target, label_grad) if nll_grad is None else nll_grad
            grad = torch._log_softmax_backward_data(grad, log_probs, 1, log_probs.dtype)
            grads: dict[str, torch.Tensor] = {}
            for i in range(len(cls.chain) - 1, -1, -1):
                name = cls.chain[i]
                grads[f"{name}.weight"] = torch.bmm(grad, acts[i].transpose(1, 2))
                grads[f"{name}.bias"] = grad.sum(dim=2)
                if i > 0:  # through the layer's weight, then the ReLU before it
                    grad = torch.bmm(p[f"{name}.weight"].transpose(1, 2), grad)
                    grad = torch.ops.aten.threshold_backward(grad, acts[i], 0)
        return grads, log_probs.gather(1, target)


def mlp_hidden_size(in_features: int) -> int:
    """Hidden width of the ``mlp`` model: 32 when ``in_features <= 100`` else 128.

    32 reproduces the 60-32-10 MLP of FedProx / FedCDR on the synthetic data;
    128 gives the usual 784-128-10 MNIST MLP.
    """
    return 32 if in_features <= 100 else 128


class LogReg(LinearChain, nn.Module):
    """Multinomial logistic regression: Flatten + Linear(d, classes).

    Always ``num_classes`` logits (2 logits for a binary task, not 1).
    """

    chain = ("fc",)

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flatten(x))


class MLP(LinearChain, nn.Module):
    """One-hidden-layer MLP: d - h - classes with ReLU.

    The hidden width follows :func:`mlp_hidden_size`: ``h = 32`` when
    ``d <= 100`` (the FedProx/FedCDR 60-32-10 MLP) and ``h = 128`` otherwise
    (784-128-10).  Pass ``hidden`` to override.
    """

    chain = ("fc1", "fc")

    def __init__(self, in_features: int, num_classes: int, hidden: int | None = None) -> None:
        super().__init__()
        h = mlp_hidden_size(in_features) if hidden is None else hidden
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(in_features, h)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(h, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.relu(self.fc1(self.flatten(x))))


class MLP200(LinearChain, nn.Module):
    """The "2NN" of McMahan et al. 2017: d - 200 - 200 - classes with ReLU."""

    chain = ("fc1", "fc2", "fc")

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
