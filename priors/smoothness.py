"""Total variation priors (Inverting Gradients, GradInversion, the Bayes paper)."""
from __future__ import annotations

import torch

from audit.core.errors import ConfigError

from priors.base import PRIORS, Prior, PriorContext


def _differences(x):
    return x[..., 1:, :] - x[..., :-1, :], x[..., :, 1:] - x[..., :, :-1]


class TotalVariation(Prior):
    """Mean absolute neighbour difference. ``anisotropic``: ``mean|dx| + mean|dy|``;
    ``isotropic``: ``mean sqrt(dx^2 + dy^2 + eps)`` on the common interior."""

    name = "tv"

    def __init__(self, kind: str = "anisotropic", eps: float = 1e-8):
        if kind not in ("anisotropic", "isotropic"):
            raise ConfigError(f"tv kind must be 'anisotropic' or 'isotropic', got {kind!r}")
        self.kind, self.eps = kind, float(eps)

    def __call__(self, x, context: PriorContext):
        dy, dx = _differences(x)
        if self.kind == "anisotropic":
            return dx.abs().mean() + dy.abs().mean()
        return torch.sqrt(dx[..., :-1, :].pow(2) + dy[..., :, :-1].pow(2) + self.eps).mean()


@PRIORS.register("tv", "total variation; kind=anisotropic (default) or isotropic")
def tv(kind: str = "anisotropic") -> Prior:
    return TotalVariation(kind)

