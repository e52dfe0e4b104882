"""ATS (Gao et al., CVPR 2021): train on AutoAugment-policy-transformed private inputs.

A policy is a chain of operations ``(name, probability, level)``; a spec such as
``"7-4-15"`` names them by their index in the ATS search space, ``"+"`` joins alternative
policies (one is drawn per image), and an operation can be written out as
``name:probability:level`` (e.g. ``"translateY:0.7:2-sharpness:0.8:1"``). Before the policy
each image goes through RandomCrop (padding H/8) and a horizontal flip, as in ATS training.
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

# the indices of the ATS search space used by its best policies (7-4-15, 21-13-3)
POLICY_OPS = {
    3: ("translateX", 0.3, 9),
    4: ("sharpness", 0.8, 1),
    7: ("translateY", 0.7, 2),
    13: ("brightness", 0.6, 5),
    15: ("brightness", 0.7, 9),
    21: ("translateX", 0.5, 5),
}


def _parse_op(token: str) -> Op:
    token = token.strip()
    if token.isdigit():
        if int(token) not in POLICY_OPS:
            raise ConfigError(f"ats: unknown policy index {token}; known indices: "
                              f"{', '.join(map(str, sorted(POLICY_OPS)))}, or write name:probability:level")
        return POLICY_OPS[int(token)]
    parts = token.split(":")
    if len(parts) != 3:
        raise ConfigError(f"ats: cannot read policy operation {token!r}; use an index "
                          f"({', '.join(map(str, sorted(POLICY_OPS)))}) or name:probability:level")
    name, prob, level = parts
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


@DEFENSES.register("ats", "Train on AutoAugment-policy-transformed inputs (policy=7-4-15, crop+flip first)")
class ATS(Defense):
    """Data-side defense: :meth:`transform_inputs` applies the policy to the private batch."""

    name = "ats"
    stochastic = True

    def __init__(self, policy: str = "7-4-15", crop_flip: bool = True):
        self.policy = policy if isinstance(policy, str) else "+".join(map(str, policy))
        self.crop_flip = bool(crop_flip)
        self._chains = parse_policies(policy)

    def transform_inputs(self, inputs: Tensor, generator) -> Tensor:
        """Transform every image with its own random draws (differentiable w.r.t. pixels)."""
        gen = resolve_generator(generator, inputs.device)
        n_ops = max(len(c) for c in self._chains)
        # per image: crop y, crop x, flip, policy choice, then (apply?, sign) per operation
        u = rand((inputs.shape[0], 4 + 2 * n_ops), generator=gen, device="cpu", dtype=torch.float64).tolist()
        pad = max(1, round(inputs.shape[-2] / 8)) if self.crop_flip else 0
        out = []
        for img, draws in zip(inputs.split(1), u):
            if self.crop_flip:
                img = crop_and_flip(img, pad, int(draws[0] * (2 * pad + 1)), int(draws[1] * (2 * pad + 1)),
                                    draws[2] < 0.5)
            chain = self._chains[min(int(draws[3] * len(self._chains)), len(self._chains) - 1)]
            for k, (name, prob, level) in enumerate(chain):
                if draws[4 + 2 * k] < prob:
                    sign = 1.0 if draws[5 + 2 * k] < 0.5 else -1.0
                    img = AUGMENTATIONS.get(name)(img, level, sign)
            out.append(img.clamp(0, 1))
        return torch.cat(out)

    def params(self):
        return {"policy": self.policy, "crop_flip": self.crop_flip}
