"""Uniform samples in a delta-ball (the Monte Carlo integral of Algorithm 1, Bayes paper)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from audit.core.errors import ConfigError


def uniform_ball_offsets(shape, k: int, delta: float, *, generator: Optional[torch.Generator],
                         device=None, dtype=torch.float32) -> Tensor:
    """``k`` offsets uniform in the L2 ball of radius ``delta`` in ``prod(shape)`` dimensions.

    Direction: a normalised Gaussian; radius: ``delta * U^(1/d)``. Drawn from ``generator``
    on its device (or from the global RNG on ``device`` when it is None), returned on
    ``device`` with shape ``(k, *shape)``. Works under ``torch.func.vmap``.
    """
    if k < 1:
        raise ConfigError(f"the number of ball samples k must be >= 1, got {k}")
    if delta < 0:
        raise ConfigError(f"the ball radius delta must be >= 0, got {delta}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen_device = generator.device if generator is not None else device
    d = 1
    for s in shape:
        d *= int(s)
    direction = torch.randn((k, d), generator=generator, device=gen_device, dtype=dtype)
    direction = direction / direction.norm(dim=1, keepdim=True).clamp_min(1e-12)
    radius = delta * torch.rand((k, 1), generator=generator, device=gen_device, dtype=dtype) ** (1.0 / d)
    return (direction * radius).view(k, *shape).to(device)
