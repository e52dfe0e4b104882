"""Uniform gradient quantisation (per tensor, min/max range)."""
from __future__ import annotations

import torch
from torch import Tensor

from audit.core.types import Defense

from defenses.common import check_range, rand, resolve_generator
from defenses.registry import DEFENSES


def quantize_tensor(g: Tensor, bits: int, noise: Tensor | None = None) -> Tensor:
    """Round ``g`` onto ``2**bits`` evenly spaced levels between its min and max.

    ``noise`` (uniform [0, 1), same shape) turns rounding into unbiased stochastic rounding.
    The value is the quantised one; the gradient w.r.t. ``g`` is the identity (straight
    through), so attackers can differentiate through the defense.
    """
    lo, hi = torch.aminmax(g.detach())
    step = (hi - lo) / (2 ** bits - 1)
    if step == 0:
        return g
    scaled = (g.detach() - lo).div_(step)
    levels = scaled.add_(noise).floor_() if noise is not None else scaled.round_()
    q = levels.clamp_(0, 2 ** bits - 1).mul_(step).add_(lo)
    return g + (q - g).detach()


@DEFENSES.register("quantize", "Uniform per-tensor quantisation to `bits` bits (bits=8; stochastic rounding optional)")
class Quantize(Defense):
    """Quantises every gradient tensor to ``2**bits`` levels spanning its range."""

    name = "quantize"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS

    def __init__(self, bits: int = 8, stochastic_rounding: bool = False):
        self.bits = check_range(self.name, "bits", bits, 1, 32, integer=True)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.stochastic = self.stochastic_rounding

    def transform(self, grads, *, generator=None, model=None):
        if not self.stochastic_rounding:
            return [quantize_tensor(g, self.bits) for g in grads]
        gen = resolve_generator(generator, grads[0].device)
        return [
            quantize_tensor(g, self.bits, rand(g.shape, generator=gen, device=g.device, dtype=g.dtype))
            for g in grads
        ]
