"""Additive noise defenses (Gaussian, Laplacian) with their exact log-likelihoods."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Sequence

import torch
from torch import Tensor

from audit.core.types import Defense

from defenses.common import check_range, rand, randn, resolve_generator
from defenses.registry import DEFENSES


def gaussian_noise(shape, scale: float, *, generator, device, dtype) -> Tensor:
    return randn(shape, generator=generator, device=device, dtype=dtype).mul_(scale)


def laplace_noise(shape, scale: float, *, generator, device, dtype) -> Tensor:
    """Inverse-CDF sampling: ``-b sign(u) log(1 - 2|u|)`` with ``u ~ U(-1/2, 1/2)``."""
    u = rand(shape, generator=generator, device=device, dtype=dtype).sub_(0.5)
    tiny = torch.finfo(dtype).tiny
    magnitude = u.abs().mul_(-2).add_(1).clamp_min_(tiny).log_()
    return magnitude.mul_(u.sign_().mul_(-scale))


def gaussian_log_density(x: Tensor, scale: float) -> Tensor:
    """Element-wise ``log N(x; 0, scale^2)``."""
    return -0.5 * (x / scale) ** 2 - math.log(scale) - 0.5 * math.log(2 * math.pi)


def laplace_log_density(x: Tensor, scale: float) -> Tensor:
    """Element-wise ``log Laplace(x; 0, scale)``."""
    return -x.abs() / scale - math.log(2 * scale)


# name -> (sampler, element-wise log-density)
NOISES: Dict[str, tuple[Callable, Callable[[Tensor, float], Tensor]]] = {
    "gaussian": (gaussian_noise, gaussian_log_density),
    "laplacian": (laplace_noise, laplace_log_density),
}


def add_noise(grads: Sequence[Tensor], kind: str, scale: float, generator) -> List[Tensor]:
    """``g + noise`` for every tensor, randomness from ``generator`` only."""
    sample = NOISES[kind][0]
    gen = resolve_generator(generator, grads[0].device)
    return [sample(g.shape, scale, generator=gen, device=g.device, dtype=g.dtype).add_(g) for g in grads]


class AdditiveNoise(Defense):
    """Shares ``g + n`` with i.i.d. noise ``n`` of the given scale on every coordinate."""

    noise: str = "gaussian"
    stochastic = True
    vmap_draws = True

    def __init__(self, sigma: float = 0.1):
        self.sigma = check_range(self.name, "sigma", sigma, 0, None, low_open=True)

    def transform(self, grads, *, generator=None, model=None):
        return add_noise(grads, self.noise, self.sigma, generator)

    def log_prob(self, shared: Sequence[Tensor], clean: Sequence[Tensor]) -> Tensor:
        """Exact ``log p(shared | clean)``, summed over all coordinates (differentiable)."""
        density = NOISES[self.noise][1]
        return sum(density(s - c, self.sigma).sum() for s, c in zip(shared, clean))


@DEFENSES.register("gaussian", "Add N(0, sigma^2) noise to every gradient entry (sigma=0.1)")
class GaussianNoise(AdditiveNoise):
    name = "gaussian"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    noise = "gaussian"


@DEFENSES.register("laplacian", "Add Laplace(0, sigma) noise to every gradient entry (sigma=0.1)")
class LaplacianNoise(AdditiveNoise):
    name = "laplacian"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    noise = "laplacian"
