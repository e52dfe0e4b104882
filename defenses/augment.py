"""The ATS code's AutoAugment image operations on tensors in [0, 1] (differentiable w.r.t. the
pixels).

Each operation takes ``(image (1, C, H, W), level 0..9, sign +-1)`` and uses the magnitude
ranges of the ATS authors' ``autoaugment.SubPolicy`` (gaow0007/ATSPrivacy): translate up to
150/331 of the size, shear up to 0.3 (about the top-left corner), rotate up to 30 degrees
counter-clockwise only, filled with grey 128/255; colour, contrast, sharpness and brightness
factors ``1 +- 0.5 * level / 9``; solarize threshold ``256 (1 - level / 9)`` on the 8-bit scale;
posterize to ``round(8 - 4 * level / 9)`` bits. Posterize and equalize are piecewise
constant: their value is exact and their gradient passes straight through.
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
FILL = 0.0  # translate and shear (the ATS code's fillcolor (0, 0, 0))
ROTATE_FILL = 128 / 255  # rotate_with_fill composites onto grey 128
NEAREST = InterpolationMode.NEAREST
ENHANCE_MAX = 0.5  # the ATS code's color / contrast / sharpness / brightness range (AutoAugment: 0.9)


def magnitude(maximum: float, level: int) -> float:
    """Level ``0..9`` on the AutoAugment scale ``linspace(0, maximum, 10)``."""
    return maximum * level / 9


def _affine(img: Tensor, *, translate=(0, 0), shear=(0.0, 0.0), center=None) -> Tensor:
    return TF.affine(img, angle=0.0, translate=[int(t) for t in translate], scale=1.0,
                     shear=[float(s) for s in shear], interpolation=NEAREST, fill=FILL, center=center)


def straight_through(img: Tensor, value: Tensor) -> Tensor:
    """``value`` in the forward pass, the identity's gradient in the backward pass."""
    return img + (value - img).detach()


@AUGMENTATIONS.register("translateX", "shift horizontally by up to 150/331 of the width")
def translate_x(img, level, sign):
    return _affine(img, translate=(round(sign * magnitude(150 / 331, level) * img.shape[-1]), 0))


@AUGMENTATIONS.register("translateY", "shift vertically by up to 150/331 of the height")
def translate_y(img, level, sign):
    return _affine(img, translate=(0, round(sign * magnitude(150 / 331, level) * img.shape[-2])))


@AUGMENTATIONS.register("shearX", "horizontal shear about the top-left corner, factor up to 0.3")
def shear_x(img, level, sign):
    return _affine(img, shear=(math.degrees(math.atan(sign * magnitude(0.3, level))), 0.0), center=[0, 0])


@AUGMENTATIONS.register("shearY", "vertical shear about the top-left corner, factor up to 0.3")
def shear_y(img, level, sign):
    return _affine(img, shear=(0.0, math.degrees(math.atan(sign * magnitude(0.3, level)))), center=[0, 0])


@AUGMENTATIONS.register("rotate", "counter-clockwise rotation by up to 30 degrees (no sign), grey fill")
def rotate(img, level, sign):
    return TF.rotate(img, magnitude(30.0, level), NEAREST, fill=ROTATE_FILL)


def _factor(level, sign) -> float:
    return 1.0 + sign * magnitude(ENHANCE_MAX, level)


@AUGMENTATIONS.register("brightness", "brightness factor 1 +- 0.5")
def brightness(img, level, sign):
    return TF.adjust_brightness(img, _factor(level, sign))


@AUGMENTATIONS.register("contrast", "contrast factor 1 +- 0.5")
def contrast(img, level, sign):
    return TF.adjust_contrast(img, _factor(level, sign))


@AUGMENTATIONS.register("color", "saturation factor 1 +- 0.5 (identity on grey images)")
def color(img, level, sign):
    return TF.adjust_saturation(img, _factor(level, sign)) if img.shape[-3] == 3 else img


@AUGMENTATIONS.register("sharpness", "sharpness factor 1 +- 0.5")
def sharpness(img, level, sign):
    # the v2 kernel blends in place, which breaks autograd; the v1 tensor kernel does not
    return TF1.adjust_sharpness(img, _factor(level, sign))


@AUGMENTATIONS.register("invert", "1 - x")
def invert(img, level, sign):
    return 1.0 - img


@AUGMENTATIONS.register("solarize", "invert 8-bit values >= 256 (1 - level/9)")
def solarize(img, level, sign):
    return torch.where(img * 255 >= 256 * (1.0 - level / 9), 1.0 - img, img)


@AUGMENTATIONS.register("posterize", "keep the top round(8 - 4 level/9) bits of each 8-bit value")
def posterize(img, level, sign):
    step = 2 ** (8 - round(8 - 4 * level / 9))
    value = torch.floor(torch.round(img.detach() * 255) / step) * step / 255
    return straight_through(img, value)


@AUGMENTATIONS.register("equalize", "histogram equalisation per channel (8-bit, as PIL)")
def equalize(img, level, sign):
    return straight_through(img, TF.equalize(img.detach()))


@AUGMENTATIONS.register("autocontrast", "stretch each channel to [0, 1]")
def autocontrast(img, level, sign):
    lo = img.amin(dim=(-2, -1), keepdim=True)
    hi = img.amax(dim=(-2, -1), keepdim=True)
    return torch.where(hi > lo, (img - lo) / (hi - lo).clamp_min(1e-12), img)
