"""A small (optionally class-conditional) DCGAN that trains on a CPU in minutes.

Generator: latent (+ label embedding) -> 4x4 -> 8x8 -> ... -> HxW, transposed convolutions
with BatchNorm and ReLU, a sigmoid output (images in [0, 1]). Each resolution is one block,
so GIFD can search the features at 4x4, 8x8, ... Discriminator: strided convolutions with
LeakyReLU and a projection head for the label when conditional.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.registry import Registry

from generators.base import ImageGenerator

GENERATORS = Registry("generator")


def _check_image_shape(image_shape: Sequence[int]) -> tuple:
    if len(image_shape) != 3:
        raise ConfigError(f"image_shape must be (channels, height, width), got {tuple(image_shape)}")
    c, h, w = (int(v) for v in image_shape)
    if h != w or h < 8 or h & (h - 1):
        raise ConfigError(
            f"the DCGAN makes square images whose side is a power of two >= 8 (8, 16, 32, 64); "
            f"got {h}x{w}: resize the data (--size) or bring your own generator")
    if c < 1:
        raise ConfigError(f"image channels must be >= 1, got {c}")
    return c, h, w


def _upsample_count(size: int) -> int:
    return int(math.log2(size)) - 2  # 4x4 -> size


class DCGANGenerator(ImageGenerator):
    """DCGAN generator; ``width`` is the channel count of the last hidden block."""

    def __init__(self, latent_dim: int = 32, image_shape: Sequence[int] = (3, 32, 32),
                 num_classes: int = 0, width: int = 32):
        super().__init__()
        c, h, _ = _check_image_shape(image_shape)
        if latent_dim < 1 or width < 1 or num_classes < 0:
            raise ConfigError("latent_dim and width must be >= 1 and num_classes >= 0")
        self.latent_dim, self.image_shape, self.num_classes, self.width = latent_dim, (c, h, h), num_classes, width
        self.label_embedding = nn.Embedding(num_classes, latent_dim) if num_classes else None
        n_up = _upsample_count(h)
        chans = [width * 2 ** (n_up - 1 - i) for i in range(n_up)]  # e.g. 32x32: [4w, 2w, w]
        in_dim = latent_dim * (2 if num_classes else 1)
        blocks = [nn.Sequential(nn.Unflatten(1, (in_dim, 1, 1)),
                                nn.ConvTranspose2d(in_dim, chans[0], 4, 1, 0, bias=False),
                                nn.BatchNorm2d(chans[0]), nn.ReLU())]
        for cin, cout in zip(chans[:-1], chans[1:]):
            blocks.append(nn.Sequential(nn.ConvTranspose2d(cin, cout, 4, 2, 1, bias=False),
                                        nn.BatchNorm2d(cout), nn.ReLU()))
        blocks.append(nn.Sequential(nn.ConvTranspose2d(chans[-1], c, 4, 2, 1), nn.Sigmoid()))
        self.blocks = nn.ModuleList(blocks)
        self.apply(_dcgan_init)

    def embed(self, z: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        if self.label_embedding is None:
            return z
        if labels is None:
            raise ConfigError("this generator is class-conditional: pass labels (B,) with the latents")
        return torch.cat([z, self.label_embedding(labels.to(z.device).long())], dim=1)

    def settings(self) -> dict:
        return {**super().settings(), "width": self.width}


class DCGANDiscriminator(nn.Module):
    """Strided convolutions + LeakyReLU; conditional through a projection on the label."""

    def __init__(self, image_shape: Sequence[int] = (3, 32, 32), num_classes: int = 0, width: int = 32):
        super().__init__()
        c, h, _ = _check_image_shape(image_shape)
        n_down = _upsample_count(h)
        layers, cin = [], c
        for i in range(n_down):
            cout = width * 2 ** i
            layers += [nn.Conv2d(cin, cout, 4, 2, 1, bias=i == 0)]
            if i > 0:
                layers.append(nn.BatchNorm2d(cout))
            layers.append(nn.LeakyReLU(0.2))
            cin = cout
        self.features = nn.Sequential(*layers, nn.Flatten())
        feat_dim = cin * 16
        self.head = nn.Linear(feat_dim, 1)
        self.projection = nn.Embedding(num_classes, feat_dim) if num_classes else None
        self.apply(_dcgan_init)

    def forward(self, x: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """Real/fake logits ``(B,)``."""
        f = self.features(x * 2 - 1)
        out = self.head(f).squeeze(1)
        if self.projection is not None and labels is not None:
            out = out + (self.projection(labels) * f).sum(1)
        return out


def _dcgan_init(m: nn.Module) -> None:
    if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
        nn.init.normal_(m.weight, 0.0, 0.02)
    elif isinstance(m, nn.BatchNorm2d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, 1.0 / math.sqrt(m.embedding_dim))


@GENERATORS.register("dcgan", "small DCGAN (transposed convs, BN, sigmoid output), optionally class-conditional")
def dcgan(latent_dim: int = 32, image_shape: Sequence[int] = (3, 32, 32), num_classes: int = 0,
          width: int = 32):
    return DCGANGenerator(latent_dim, image_shape, num_classes, width), DCGANDiscriminator(
        image_shape, num_classes, width)


def build_generator(name: str = "dcgan", seed: Optional[int] = 0, **settings):
    """``(generator, discriminator)`` of a registered architecture, seeded initialisation."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        return GENERATORS.build(name, **settings)
