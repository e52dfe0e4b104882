"""Refiner's evaluation network D: predicts the noise ratio of an image.

Trained on ``((1 - r) t1 + r t2, r)`` with ``t1`` a natural image (the embedded data set by
default), ``t2`` uniform noise and ``r`` in ``{0, 0.1, ..., 1}`` (every batch is mixed at all
11 ratios, as in the paper's appendix): 3 convs (3x3, stride 2, padding 1; ``width``,
``2 width``, ``4 width`` filters = 128/256/512 by default, ReLU), FC + sigmoid, Adam 1e-4.
Trained networks are cached under ``$GIA_AUDIT_CACHE`` (default ``~/.cache/gia-audit``).
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from audit.core.cache import cache_dir
from audit.core.files import atomic_torch_save
from audit.core.errors import ConfigError

MIX_RATIOS = tuple(i / 10 for i in range(11))


class NoiseRatioNet(nn.Module):
    """The evaluation network D for images of shape ``input_shape``."""

    def __init__(self, input_shape: Tuple[int, int, int], width: int = 128):
        super().__init__()
        c, h, w = input_shape
        layers, cin = [], c
        for mult in (1, 2, 4):
            layers += [nn.Conv2d(cin, width * mult, 3, stride=2, padding=1), nn.ReLU()]
            cin = width * mult
            h, w = (h + 1) // 2, (w + 1) // 2
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.head = nn.Linear(cin * h * w, 1)
        self.input_shape = tuple(input_shape)

    def forward(self, x: Tensor) -> Tensor:
        """Predicted noise ratio in (0, 1), shape ``(B,)``."""
        return torch.sigmoid(self.head(self.features(x))).squeeze(1)


def natural_images(dataset: str, input_shape: Tuple[int, int, int]) -> Tensor:
    """Training images of a registered data set, at the requested shape."""
    from audit.core.data import load_dataset, to_grayscale

    c, h, w = input_shape
    images = load_dataset(dataset, size=h).train_images
    if images.shape[-1] != w:
        images = F.interpolate(images, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
    if images.shape[1] != c:
        images = to_grayscale(images) if c == 1 else images[:, :1].expand(-1, c, -1, -1)
    return images.contiguous()


def train_evaluator(images: Tensor, *, width: int = 128, epochs: int = 20, batch_size: int = 128,
                    lr: float = 1e-4, seed: int = 0, device="cpu") -> NoiseRatioNet:
    """Train D on ``images`` (``(N, C, H, W)`` in [0, 1]) mixed with uniform noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = NoiseRatioNet(tuple(images.shape[1:]), width)
    net = net.to(device)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    ratios = torch.tensor(MIX_RATIOS, device=device)
    for _ in range(epochs):
        order = torch.randperm(len(images), generator=gen)
        for start in range(0, len(images), batch_size):
            clean = images[order[start:start + batch_size]].to(device)
            for r in ratios:
                noise = torch.rand(clean.shape, generator=gen).to(device)
                mixed = (1 - r) * clean + r * noise
                loss = F.binary_cross_entropy(net(mixed), r.expand(len(clean)))
                opt.zero_grad()
                loss.backward()
                opt.step()
    return net.eval().requires_grad_(False)


def load_or_train_evaluator(input_shape: Tuple[int, int, int], *, dataset: str = "embedded",
                            width: int = 128, epochs: int = 20, seed: int = 0, device="cpu",
                            cache: bool = True) -> NoiseRatioNet:
    """The cached D for these settings, training (and caching) it on first use."""
    if width < 1 or epochs < 1:
        raise ConfigError(f"refiner: d_width and d_epochs must be >= 1, got {width}, {epochs}")
    c, h, w = input_shape
    path = cache_dir(f"refiner-evaluator-{dataset}-{c}x{h}x{w}-w{width}-e{epochs}-s{seed}.pt")
    if cache and path.exists():
        net = NoiseRatioNet(tuple(input_shape), width)
        net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return net.to(device).eval().requires_grad_(False)
    net = train_evaluator(natural_images(dataset, tuple(input_shape)), width=width, epochs=epochs,
                          seed=seed, device=device)
    if cache:
        atomic_torch_save({k: v.cpu() for k, v in net.state_dict().items()}, path)
    return net
