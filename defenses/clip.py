"""Gradient norm clipping (whole model or per layer)."""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from audit.core.types import Defense

from defenses.common import check_range, global_norm
from defenses.registry import DEFENSES


def clip_by_norm(grads: Sequence[Tensor], bound: float, per_layer: bool = False) -> List[Tensor]:
    """Scale ``grads`` by ``min(1, bound / ||g||)`` (one norm per tensor when ``per_layer``)."""
    if per_layer:
        return [g * torch.clamp(bound / (g.norm() + 1e-12), max=1.0) for g in grads]
    factor = torch.clamp(bound / (global_norm(grads) + 1e-12), max=1.0)
    return [g * factor for g in grads]


@DEFENSES.register("clip", "Clip the gradient norm to `bound` (whole model, or per_layer=true); bound=4")
class Clip(Defense):
    """Deterministic norm clipping: ``g * min(1, bound / ||g||)``."""

    name = "clip"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = False

    def __init__(self, bound: float = 4.0, per_layer: bool = False):
        self.bound = check_range(self.name, "bound", bound, 0, None, low_open=True)
        self.per_layer = bool(per_layer)

    def transform(self, grads, *, generator=None, model=None):
        return clip_by_norm(grads, self.bound, self.per_layer)
