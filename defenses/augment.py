"""AutoAugment image operations on tensors in [0, 1] (differentiable w.r.t. the pixels).

Each operation takes ``(image (1, C, H, W), level 0..9, sign +-1)``. Magnitude ranges follow
the common AutoAugment implementation used by ATS: translate up to 150/331 of the width,
shear up to 0.3, rotate up to 30 degrees, enhance factors ``1 +- 0.9 * level / 9``.
"""
from __future__ import annotations

import math

import torch
import torchvision.transforms.functional as TF1
import torchvision.transforms.v2.functional as TF
from torch import Tensor
from torchvision.transforms import InterpolationMode

from audit.core.registry import Registry

AUGMENTATIONS = Registry("augmentation")
FILL = 0.0
NEAREST = InterpolationMode.NEAREST


def magnitude(maximum: float, level: int) -> float:
    """Level ``0..9`` on the AutoAugment scale ``linspace(0, maximum, 10)``."""
    return maximum * level / 9


def _affine(img: Tensor, *, translate=(0, 0), shear=(0.0, 0.0), angle=0.0) -> Tensor:
    return TF.affine(img, angle=float(angle), translate=[int(t) for t in translate], scale=1.0,
                     shear=[float(s) for s in shear], interpolation=NEAREST, fill=FILL)


@AUGMENTATIONS.register("translateX", "shift horizontally by up to 150/331 of the width")
def translate_x(img, level, sign):
    return _affine(img, translate=(round(sign * magnitude(150 / 331, level) * img.shape[-1]), 0))


@AUGMENTATIONS.register("translateY", "shift vertically by up to 150/331 of the height")
def translate_y(img, level, sign):
    return _affine(img, translate=(0, round(sign * magnitude(150 / 331, level) * img.shape[-2])))


@AUGMENTATIONS.register("shearX", "horizontal shear, factor up to 0.3")
def shear_x(img, level, sign):
    return _affine(img, shear=(math.degrees(math.atan(sign * magnitude(0.3, level))), 0.0))


@AUGMENTATIONS.register("shearY", "vertical shear, factor up to 0.3")
def shear_y(img, level, sign):
    return _affine(img, shear=(0.0, math.degrees(math.atan(sign * magnitude(0.3, level)))))


@AUGMENTATIONS.register("rotate", "rotation by up to 30 degrees")
def rotate(img, level, sign):
    return TF.rotate(img, sign * magnitude(30.0, level), NEAREST, fill=FILL)


def _factor(level, sign) -> float:
    return 1.0 + sign * magnitude(0.9, level)


@AUGMENTATIONS.register("brightness", "brightness factor 1 +- 0.9")
def brightness(img, level, sign):
    return TF.adjust_brightness(img, _factor(level, sign))


@AUGMENTATIONS.register("contrast", "contrast factor 1 +- 0.9")
def contrast(img, level, sign):
    return TF.adjust_contrast(img, _factor(level, sign))


@AUGMENTATIONS.register("color", "saturation factor 1 +- 0.9 (identity on grey images)")
def color(img, level, sign):
    return TF.adjust_saturation(img, _factor(level, sign)) if img.shape[-3] == 3 else img


@AUGMENTATIONS.register("sharpness", "sharpness factor 1 +- 0.9")
def sharpness(img, level, sign):
    # the v2 kernel blends in place, which breaks autograd; the v1 tensor kernel does not
    return TF1.adjust_sharpness(img, _factor(level, sign))


@AUGMENTATIONS.register("invert", "1 - x")
def invert(img, level, sign):
    return 1.0 - img


@AUGMENTATIONS.register("solarize", "invert pixels above 1 - level/9")
def solarize(img, level, sign):
    return torch.where(img >= 1.0 - magnitude(1.0, level), 1.0 - img, img)


@AUGMENTATIONS.register("autocontrast", "stretch each channel to [0, 1]")
def autocontrast(img, level, sign):
    lo = img.amin(dim=(-2, -1), keepdim=True)
    hi = img.amax(dim=(-2, -1), keepdim=True)
    return torch.where(hi > lo, (img - lo) / (hi - lo).clamp_min(1e-12), img)
