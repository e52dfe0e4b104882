"""ATS (Gao et al., CVPR 2021): train on policy-transformed private inputs, as the ATS code does.

A policy is a chain of operations ``(name, probability, level)``; a spec such as ``"7-4-15"``
names them by their index in the ATS search space (``policy.py`` of gaow0007/ATSPrivacy),
``"+"`` joins alternative chains (one is drawn per image), and an operation can be written
out as ``name:probability:level`` or ``name:level`` (e.g. ``"translateY:2-sharpness:1"``).
As in the ATS code, **every operation of the chain is applied** (its ``SubPolicy`` keeps the
probability but never draws against it) with the code's magnitude ranges
(:mod:`defenses.augment`); the sign of signed operations is drawn per image and operation.
Before the chain each image goes through RandomCrop (zero padding H/8) and a horizontal flip,
as in ATS training on CIFAR.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from audit.core.errors import ConfigError
from audit.core.types import Defense

from defenses.augment import AUGMENTATIONS
from defenses.common import rand, resolve_generator
from defenses.registry import DEFENSES

Op = Tuple[str, float, int]

# the ATS search space, index -> (operation, probability, level), as listed in its policy.py
SEARCH_SPACE: Tuple[Op, ...] = tuple((name, p, level) for p, name, level in (
    (0.1, "invert", 7), (0.2, "contrast", 6), (0.7, "rotate", 2), (0.3, "translateX", 9),
    (0.8, "sharpness", 1), (0.9, "sharpness", 3), (0.5, "shearY", 2), (0.7, "translateY", 2),
    (0.5, "autocontrast", 5), (0.9, "equalize", 2), (0.2, "shearY", 5), (0.3, "posterize", 5),
    (0.4, "color", 3), (0.6, "brightness", 5), (0.3, "sharpness", 9), (0.7, "brightness", 9),
    (0.6, "equalize", 5), (0.5, "equalize", 1), (0.6, "contrast", 7), (0.6, "sharpness", 5),
    (0.7, "color", 5), (0.5, "translateX", 5), (0.3, "equalize", 7), (0.4, "autocontrast", 8),
    (0.4, "translateY", 3), (0.2, "sharpness", 6), (0.9, "brightness", 6), (0.2, "color", 8),
    (0.5, "solarize", 0), (0.0, "invert", 0), (0.2, "equalize", 0), (0.6, "autocontrast", 0),
    (0.2, "equalize", 8), (0.6, "equalize", 4), (0.9, "color", 5), (0.6, "equalize", 5),
    (0.8, "autocontrast", 4), (0.2, "solarize", 4), (0.1, "brightness", 3), (0.7, "color", 0),
    (0.4, "solarize", 1), (0.9, "autocontrast", 0), (0.9, "translateY", 3), (0.7, "translateY", 3),
    (0.9, "autocontrast", 1), (0.8, "solarize", 1), (0.8, "equalize", 5), (0.1, "invert", 0),
    (0.7, "translateY", 3), (0.9, "autocontrast", 1),
))


def _parse_op(token: str) -> Op:
    token = token.strip()
    if token.isdigit():
        if int(token) >= len(SEARCH_SPACE):
            raise ConfigError(f"ats: unknown policy index {token}; known indices: 0..{len(SEARCH_SPACE) - 1} "
                              "(the ATS search space), or write name:level")
        return SEARCH_SPACE[int(token)]
    parts = token.split(":")
    if len(parts) not in (2, 3):
        raise ConfigError(f"ats: cannot read policy operation {token!r}; use an index "
                          f"(0..{len(SEARCH_SPACE) - 1}), name:level or name:probability:level")
    name, prob, level = parts if len(parts) == 3 else (parts[0], "1", parts[1])
    AUGMENTATIONS.get(name)  # unknown names list the valid ones
    try:
        prob_f, level_i = float(prob), int(level)
    except ValueError:
        raise ConfigError(f"ats: {token!r}: probability must be a number and level an integer") from None
    if not (0 <= prob_f <= 1 and 0 <= level_i <= 9):
        raise ConfigError(f"ats: {token!r}: probability must be in [0, 1] and level in 0..9")
    return name, prob_f, level_i


def parse_policies(spec) -> List[List[Op]]:
    """``"21-13-3+7-4-15"`` -> two chains of ``(name, probability, level)``."""
    if isinstance(spec, (int, float)):
        spec = str(int(spec))
    if isinstance(spec, (tuple, list)):  # CLI "7-4-15,21-13-3"-style lists
        spec = "+".join(map(str, spec))
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"ats: policy must be a string such as '7-4-15', got {spec!r}")
    return [[_parse_op(t) for t in chain.split("-")] for chain in spec.split("+")]


def crop_and_flip(img: Tensor, pad: int, dy: int, dx: int, flip: bool) -> Tensor:
    """RandomCrop with zero padding ``pad`` at offset ``(dy, dx)``, then optional h-flip."""
    h, w = img.shape[-2:]
    if pad > 0:
        img = F.pad(img, (pad, pad, pad, pad))[..., dy:dy + h, dx:dx + w]
    return img.flip(-1) if flip else img


@DEFENSES.register("ats", "Train on ATS-policy-transformed inputs (policy=7-4-15, every op applied, crop+flip first)")
class ATS(Defense):
    """Data-side defense: :meth:`transform_inputs` applies the policy to the private batch."""

    name = "ats"
    buffer_effect = "transformed"  # the client trains on, and its buffers record, the transformed batch
    stochastic = True
    differences = (
        "Follows the ATS code rather than AutoAugment's semantics: every operation of the chain is "
        "applied (its probability is never drawn against) with the code's magnitudes (colour, contrast, "
        "sharpness and brightness factors 1 +- 0.5; rotation counter-clockwise only, grey fill).",
        "Operations run on float tensors in [0, 1] through torchvision kernels, not on 8-bit PIL "
        "images: nearest-neighbour sampling everywhere (the ATS code shears with bicubic), "
        "translations rounded to whole pixels, no 8-bit rounding between operations.",
        "Posterize and equalize pass the gradient straight through (they are piecewise constant), "
        "so adaptive attackers can differentiate through every operation.",
    )

    def __init__(self, policy: str = "7-4-15", crop_flip: bool = True):
        self.policy = policy if isinstance(policy, str) else "+".join(map(str, policy))
        self.crop_flip = bool(crop_flip)
        self._chains = parse_policies(policy)

    def transform_inputs(self, inputs: Tensor, generator) -> Tensor:
        """Transform every image with its own random draws (differentiable w.r.t. pixels)."""
        gen = resolve_generator(generator, inputs.device)
        n_ops = max(len(c) for c in self._chains)
        # per image: crop y, crop x, flip, chain choice, then one sign per operation
        u = rand((inputs.shape[0], 4 + n_ops), generator=gen, device="cpu", dtype=torch.float64).tolist()
        pad = max(1, round(inputs.shape[-2] / 8)) if self.crop_flip else 0
        out = []
        for img, draws in zip(inputs.split(1), u):
            if self.crop_flip:
                img = crop_and_flip(img, pad, int(draws[0] * (2 * pad + 1)), int(draws[1] * (2 * pad + 1)),
                                    draws[2] < 0.5)
            chain = self._chains[min(int(draws[3] * len(self._chains)), len(self._chains) - 1)]
            for k, (name, _, level) in enumerate(chain):  # the probability is never drawn against
                img = AUGMENTATIONS.get(name)(img, level, 1.0 if draws[4 + k] < 0.5 else -1.0)
            out.append(img.clamp(0, 1))
        return torch.cat(out)

    def buffer_inputs(self, inputs: Tensor, generator) -> Tensor:
        """The batch the client trains on, whose statistics its buffers record: the same draws
        as the shared gradient's when ``generator`` is at the state the defense's call began with."""
        return self.transform_inputs(inputs, generator)

    def params(self):
        return {"policy": self.policy, "crop_flip": self.crop_flip}
