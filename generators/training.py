"""Adversarial training of a generator on auxiliary images (non-saturating GAN loss, Adam)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError, DataError

from generators.base import ImageGenerator


@dataclass
class TrainSettings:
    """Optimisation settings of :func:`train_gan` (DCGAN's: Adam 2e-4, betas (0.5, 0.999))."""

    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-4
    beta1: float = 0.5
    flip: bool = True  # random horizontal flips of the real images

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError(f"training needs steps >= 1, batch_size >= 1 and lr > 0, got {asdict(self)}")


@dataclass
class TrainHistory:
    """Per-step losses of the discriminator and the generator."""

    d_loss: List[float] = field(default_factory=list)
    g_loss: List[float] = field(default_factory=list)


def train_gan(generator: ImageGenerator, discriminator: nn.Module, images: Tensor,
              labels: Optional[Tensor] = None, settings: TrainSettings = TrainSettings(), *,
              seed: int = 0, progress: bool = True) -> TrainHistory:
    """Train ``generator`` against ``discriminator`` on ``images`` (N, C, H, W) in [0, 1].

    ``labels`` (N,) are used when the generator is class-conditional. Both modules are
    trained in place on ``images.device``; the generator is left in eval mode.
    """
    settings.validate()
    _check_training_data(generator, images, labels)
    device = images.device
    rng = torch.Generator(device=device).manual_seed(seed)
    conditional = generator.num_classes > 0
    opt_g = torch.optim.Adam(generator.parameters(), lr=settings.lr, betas=(settings.beta1, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=settings.lr, betas=(settings.beta1, 0.999))
    bce = nn.functional.binary_cross_entropy_with_logits
    generator.train()
    discriminator.train()
    history = TrainHistory()
    n, b = images.shape[0], min(settings.batch_size, images.shape[0])
    ones, zeros = torch.ones(b, device=device), torch.zeros(b, device=device)
    for _ in _progress(range(settings.steps), progress, "training generator"):
        idx = torch.randint(n, (b,), generator=rng, device=device)
        real = images[idx]
        if settings.flip:
            flip = torch.rand(b, generator=rng, device=device) < 0.5
            real = torch.where(flip.view(-1, 1, 1, 1), real.flip(-1), real)
        y = labels[idx] if conditional else None
        fake = generator(torch.randn(b, generator.latent_dim, generator=rng, device=device), y)

        d_loss = bce(discriminator(real, y), ones) + bce(discriminator(fake.detach(), y), zeros)
        opt_d.zero_grad(set_to_none=True)
        d_loss.backward()
        opt_d.step()

        g_loss = bce(discriminator(fake, y), ones)
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        history.d_loss.append(float(d_loss.detach()))
        history.g_loss.append(float(g_loss.detach()))
    generator.eval()
    discriminator.eval()
    return history


def _check_training_data(generator: ImageGenerator, images: Tensor, labels: Optional[Tensor]) -> None:
    if images.dim() != 4 or tuple(images.shape[1:]) != tuple(generator.image_shape):
        raise DataError(f"training images have shape {tuple(images.shape)}; the generator makes "
                        f"{tuple(generator.image_shape)}: resize the data or rebuild the generator")
    if images.shape[0] < 2:
        raise DataError("a generator needs at least 2 training images")
    if not torch.isfinite(images).all() or images.min() < 0 or images.max() > 1:
        raise DataError("training images must be finite and in [0, 1]")
    if generator.num_classes:
        if labels is None or labels.shape != images.shape[:1]:
            raise DataError("a class-conditional generator needs one label per training image")
        if int(labels.min()) < 0 or int(labels.max()) >= generator.num_classes:
            raise DataError(f"labels must be in 0..{generator.num_classes - 1}")


def _progress(iterable, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, leave=False)
