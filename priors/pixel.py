"""Pixel-level priors: image L2 norm and the [0, 1] range penalty."""
from __future__ import annotations

import torch

from priors.base import PRIORS, Prior, PriorContext


class ImageL2(Prior):
    """``mean((x - center)^2)``: keeps pixels near ``center`` (GradInversion's image-norm prior)."""

    name = "l2"

    def __init__(self, center: float = 0.5):
        self.center = float(center)

    def __call__(self, x, context: PriorContext):
        return (x - self.center).pow(2).mean()


class PixelRange(Prior):
    """``mean(relu(x - 1)^2 + relu(-x)^2)``: zero inside [0, 1] (for unconstrained attacks)."""

    name = "range"

    def __call__(self, x, context: PriorContext):
        return (torch.relu(x - 1).pow(2) + torch.relu(-x).pow(2)).mean()


@PRIORS.register("l2", "image L2: mean squared distance of pixels to center (0.5)")
def l2(center: float = 0.5) -> Prior:
    return ImageL2(center)


@PRIORS.register("range", "penalty on pixels outside [0, 1]")
def pixel_range() -> Prior:
    return PixelRange()
