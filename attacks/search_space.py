"""Where the dummy images live: initialisations (:data:`INITS`) and box constraints
(:data:`BOXES`) mapping the optimised variable to an image.

* ``clamp`` -- the variable is the image, projected onto [0, 1] after every step;
* ``sigmoid`` -- image = sigmoid(variable), always in (0, 1);
* ``none`` -- unconstrained (DLG); the returned reconstruction is clamped to [0, 1].
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from audit.core.registry import Registry

INITS = Registry("initialisation")
BOXES = Registry("box constraint")


@INITS.register("uniform", "U(0, 1) pixels")
def uniform(shape: Sequence[int], generator: torch.Generator, device) -> Tensor:
    return torch.rand(tuple(shape), generator=generator, device=device)


@INITS.register("randn", "N(0, 1) pixels (DLG, the Bayes paper)")
def randn(shape: Sequence[int], generator: torch.Generator, device) -> Tensor:
    return torch.randn(tuple(shape), generator=generator, device=device)


@INITS.register("data-randn", "N(mean, std^2) per channel: N(0, 1) in the model's normalised input space (breaching's DLG)")
def data_randn(shape: Sequence[int], generator: torch.Generator, device, observation=None) -> Tensor:
    """Standard normal in the normalised space the model sees, i.e. the declared data mean plus
    the declared std times N(0, 1) in pixel space (mean 0.5, std 0.25 when none is declared)."""
    mean = getattr(observation, "data_mean", None) or (0.5,) * shape[-3]
    std = getattr(observation, "data_std", None) or (0.25,) * shape[-3]
    view = (-1, 1, 1)
    noise = torch.randn(tuple(shape), generator=generator, device=device)
    return torch.tensor(mean, device=device).view(view) + torch.tensor(std, device=device).view(view) * noise


@INITS.register("gray", "0.5 plus N(0, 0.05^2) noise")
def gray(shape: Sequence[int], generator: torch.Generator, device) -> Tensor:
    return 0.5 + 0.05 * torch.randn(tuple(shape), generator=generator, device=device)


class Box:
    """``image(variable)``, ``variable(image)`` and an in-place ``project`` after each step."""

    name = "none"

    def image(self, z: Tensor) -> Tensor:
        return z

    def variable(self, x: Tensor) -> Tensor:
        return x

    def project_(self, z: Tensor) -> None:
        return None


class ClampBox(Box):
    name = "clamp"

    def variable(self, x):
        return x.clamp(0, 1)

    def project_(self, z):
        with torch.no_grad():
            z.clamp_(0, 1)


class SigmoidBox(Box):
    name = "sigmoid"

    def image(self, z):
        return torch.sigmoid(z)

    def variable(self, x):
        return torch.logit(x.clamp(1e-3, 1 - 1e-3))


BOXES.add("none", Box, "unconstrained pixels (reconstruction clamped at the end)")
BOXES.add("clamp", ClampBox, "pixels projected onto [0, 1] after each step")
BOXES.add("sigmoid", SigmoidBox, "image = sigmoid(variable)")
