"""Model registry: the field's standard small networks, built by name for an input shape
and a class count. Every built model takes images in [0, 1]: the first layer is a
:class:`Normalize` (identity when no statistics are given). Any ``nn.Module`` works too.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence, Tuple

import torch
from torch import nn

from audit.core.errors import ConfigError
from audit.core.registry import Registry

MODELS = Registry("model")


class Normalize(nn.Module):
    """``(x - mean) / std`` per channel; buffers, so they move with ``.to(device)``."""

    def __init__(self, mean: Optional[Sequence[float]], std: Optional[Sequence[float]], channels: int):
        super().__init__()
        mean = [0.0] * channels if mean is None else list(mean)
        std = [1.0] * channels if std is None else list(std)
        if len(mean) != channels or len(std) != channels:
            raise ConfigError(
                f"normalisation has {len(mean)} means / {len(std)} stds for {channels} channels; "
                "give one value per input channel"
            )
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1))

    def forward(self, x):
        return (x - self.mean) / self.std


def with_normalization(model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> nn.Sequential:
    """Wrap a user model that expects normalised inputs so it takes images in [0, 1]."""
    return nn.Sequential(Normalize(mean, std, len(mean)), model)


def build_model(
    name: str,
    input_shape: Tuple[int, int, int] = (3, 32, 32),
    num_classes: int = 10,
    *,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    seed: Optional[int] = 0,
    **kwargs,
) -> nn.Sequential:
    """Build a registered model; ``seed`` makes its initialisation reproducible."""
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ConfigError(f"input_shape must be (channels, height, width), got {tuple(input_shape)}")
    if num_classes < 2:
        raise ConfigError(f"num_classes must be >= 2, got {num_classes}")
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        body = MODELS.build(name, tuple(input_shape), int(num_classes), **kwargs)
    return nn.Sequential(Normalize(mean, std, input_shape[0]), *body)


def _flat_dim(layers: Sequence[nn.Module], input_shape) -> int:
    with torch.no_grad():
        return int(nn.Sequential(*layers)(torch.zeros(1, *input_shape)).numel())


@MODELS.register("lenet", "DLG's LeNet: 3 strided 5x5 convs with sigmoid, one FC; U(-0.5, 0.5) init")
def lenet(input_shape, num_classes, width: int = 12):
    c = input_shape[0]
    feats = [
        nn.Conv2d(c, width, 5, padding=2, stride=2), nn.Sigmoid(),
        nn.Conv2d(width, width, 5, padding=2, stride=2), nn.Sigmoid(),
        nn.Conv2d(width, width, 5, padding=2, stride=1), nn.Sigmoid(),
        nn.Flatten(),
    ]
    layers = feats + [nn.Linear(_flat_dim(feats, input_shape), num_classes)]
    for m in layers:
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.uniform_(m.weight, -0.5, 0.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return layers


def _conv_block(cin, cout, norm: bool):
    block = [nn.Conv2d(cin, cout, 3, padding=1)]
    if norm:
        block.append(nn.BatchNorm2d(cout))
    return block + [nn.ReLU()]


@MODELS.register("convnet", "Inverting Gradients-style ConvNet (conv-BN-ReLU x6, 3 max-pools); width=16")
def convnet(input_shape, num_classes, width: int = 16, batchnorm: bool = True):
    if width < 1:
        raise ConfigError(f"convnet width must be >= 1, got {width}")
    c, w = input_shape[0], width
    feats = (
        _conv_block(c, w, batchnorm) + _conv_block(w, 2 * w, batchnorm) + [nn.MaxPool2d(2)]
        + _conv_block(2 * w, 4 * w, batchnorm) + _conv_block(4 * w, 4 * w, batchnorm) + [nn.MaxPool2d(2)]
        + _conv_block(4 * w, 4 * w, batchnorm) + [nn.MaxPool2d(2), nn.Flatten()]
    )
    return feats + [nn.Linear(_flat_dim(feats, input_shape), num_classes)]


@MODELS.register("convnet9", "Inverting Gradients' ConvNet as ATS uses it: 9 conv-BN-ReLU, 2 max-pools of 3; width=64")
def convnet9(input_shape, num_classes, width: int = 64):
    """The ConvNet of the Bayes paper's Table 4 (ATS's evaluation network)."""
    if width < 1:
        raise ConfigError(f"convnet9 width must be >= 1, got {width}")
    c, w = input_shape[0], width
    widths = [(c, w), (w, 2 * w), (2 * w, 2 * w), (2 * w, 4 * w), (4 * w, 4 * w), (4 * w, 4 * w)]
    feats = [m for cin, cout in widths for m in _conv_block(cin, cout, True)] + [nn.MaxPool2d(3)]
    feats += [m for _ in range(3) for m in _conv_block(4 * w, 4 * w, True)] + [nn.MaxPool2d(3), nn.Flatten()]
    return feats + [nn.Linear(_flat_dim(feats, input_shape), num_classes)]


#: ``init`` of the Bayes paper's networks: "torch" (PyTorch's defaults) or "lecun" (flax's
#: defaults, as the paper's JAX code builds them: LeCun-normal kernels, zero biases)
INITS = ("torch", "lecun")


def lecun_init(layers: Sequence[nn.Module]) -> None:
    """Initialise every conv / linear layer as flax does by default: kernels from a normal
    truncated at 2 std with variance 1 / fan_in, biases 0. Its gradients at initialisation are
    about 5x PyTorch's default's, which matters wherever noise of a fixed scale is added."""
    trunc_std = 0.87962566103423978  # std of a standard normal truncated to [-2, 2]
    for layer in layers:
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            std = 1.0 / math.sqrt(layer.weight[0].numel()) / trunc_std
            nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


def _initialised(layers: list, init: str) -> list:
    if init not in INITS:
        raise ConfigError(f"init must be one of {', '.join(INITS)}, got {init!r}")
    if init == "lecun":
        lecun_init(layers)
    return layers


@MODELS.register("convbig", "The Bayes paper's ConvBig (2 convs + 3 FC, 2000/1000 hidden), Soteria's target")
def convbig(input_shape, num_classes, init: str = "torch"):
    c = input_shape[0]
    feats = [
        nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(32, 64, 1, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
    ]
    return _initialised(feats + [
        nn.Linear(_flat_dim(feats, input_shape), 2000), nn.ReLU(),
        nn.Linear(2000, 1000), nn.ReLU(),
        nn.Linear(1000, num_classes),
    ], init)


@MODELS.register("cnn", "The Bayes paper's small CNN: conv32-pool-conv64-pool-dense100-dense")
def small_cnn(input_shape, num_classes, init: str = "torch"):
    c = input_shape[0]
    feats = [
        nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten(),
    ]
    return _initialised(feats + [nn.Linear(_flat_dim(feats, input_shape), 100), nn.ReLU(),
                                 nn.Linear(100, num_classes)], init)


@MODELS.register("mlp", "Fully connected ReLU net, PRECODE sizes: in -> 500 x5 -> 256 -> classes")
def mlp(input_shape, num_classes, hidden: Sequence[int] = (500, 500, 500, 500, 500, 256)):
    hidden = [int(hidden)] if isinstance(hidden, (int, float)) else [int(h) for h in hidden]
    layers: list = [nn.Flatten()]
    prev = int(math.prod(input_shape))
    for h in hidden:
        layers += [nn.Linear(prev, h), nn.ReLU()]
        prev = h
    return layers + [nn.Linear(prev, num_classes)]


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


@MODELS.register("resnet18", "CIFAR-style ResNet-18 (3x3 stem, no max-pool); width=64")
def resnet18(input_shape, num_classes, width: int = 64):
    c, w = input_shape[0], width
    layers: list = [nn.Conv2d(c, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
    cin = w
    for i, cout in enumerate([w, 2 * w, 4 * w, 8 * w]):
        for j in range(2):
            layers.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
            cin = cout
    return layers + [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]


def last_linear(model: nn.Module) -> Tuple[str, nn.Linear]:
    """The name and module of the last ``nn.Linear`` (the classifier head)."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear layer")
    return found[-1]


@contextlib.contextmanager
def preserved_buffers(model: nn.Module) -> Iterator[nn.Module]:
    """Run extra forward passes without side effects on buffers (BatchNorm running stats).

    Only buffers that changed are written back, so constant buffers saved for a backward
    pass (e.g. the normalisation statistics) keep their autograd version."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield model
    finally:
        with torch.no_grad():
            for buf, value in saved:
                if not torch.equal(buf, value):
                    buf.copy_(value)
