"""Priors for the Bayes-optimal adversary: exact negative log-densities (for inputs whose
distribution is known, e.g. the Bayes paper's synthetic check) and the ball average of any
prior (Algorithm 1 evaluates ``log p(x_i)`` at the sampled points)."""
from __future__ import annotations

import math

from torch import Tensor

from audit.core.errors import ConfigError
from priors import Prior, PriorContext


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")
    return float(value)


class GaussianPrior(Prior):
    """``-log N(x; mean, scale^2 I)`` summed over every entry (an exact prior)."""

    name = "gaussian-prior"

    def __init__(self, mean: float = 0.0, scale: float = 1.0):
        self.mean, self.scale = float(mean), _positive("gaussian prior scale", scale)

    def __call__(self, x: Tensor, context: PriorContext) -> Tensor:
        z = (x - self.mean) / self.scale
        return 0.5 * z.pow(2).sum() + x.numel() * (math.log(self.scale) + 0.5 * math.log(2 * math.pi))


class LaplacePrior(Prior):
    """``-log Laplace(x; mean, scale)`` summed over every entry (an exact prior)."""

    name = "laplace-prior"

    def __init__(self, mean: float = 0.0, scale: float = 1.0):
        self.mean, self.scale = float(mean), _positive("laplace prior scale", scale)

    def __call__(self, x: Tensor, context: PriorContext) -> Tensor:
        return (x - self.mean).abs().sum() / self.scale + x.numel() * math.log(2 * self.scale)


class BallAveragedPrior(Prior):
    """``mean_i inner(x_i)`` over the ball points the simulator put in
    ``context.features["ball_points"]`` (``inner(x)`` when there are none)."""

    def __init__(self, inner: Prior):
        self.inner = inner
        self.name = f"ball-{getattr(inner, 'name', 'prior')}"
        self.requires = getattr(inner, "requires", frozenset())

    def __call__(self, x: Tensor, context: PriorContext) -> Tensor:
        points = context.features.get("ball_points") if context.features else None
        if points is None:
            return self.inner(x, context)
        return sum(self.inner(points[i], context) for i in range(points.shape[0])) / points.shape[0]
