"""Invariant matching against CENSOR-like defenses.

CENSOR shares, per layer, a random direction orthogonal to the clean gradient with the
clean gradient's norm. The direction carries no information about the data, but two
invariants do: ``||shared_l|| = ||grad_l(x)||`` and ``<shared_l, grad_l(x)> = 0``. This
attack matches exactly those (normalised per layer), instead of the direction.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from attacks.objectives import Objective
from audit.core.errors import ConfigError
from audit.core.types import Observation

from adaptive.adapted import Adaptation, AdaptedAttack, register


class InvariantObjective(Objective):
    """``sum_l (||g_l|| / ||s_l|| - 1)^2 + orthogonality * sum_l cos(g_l, s_l)^2``
    over the layers whose shared gradient is non-zero (pure torch, vmappable)."""

    name = "censor-invariants"

    def __init__(self, orthogonality: float = 1.0):
        if orthogonality < 0:
            raise ConfigError(f"censor-invariants: orthogonality weight must be >= 0, got {orthogonality}")
        self.orthogonality = float(orthogonality)

    def __call__(self, dummy_grads: Sequence[Tensor], target_grads: Sequence[Tensor]) -> Tensor:
        total = dummy_grads[0].new_zeros(())
        for g, s in zip(dummy_grads, target_grads):
            s_norm = s.norm()
            shared = s_norm > 0  # a zero layer is skipped: a mask, not a branch, so it runs under vmap
            s_norm = torch.where(shared, s_norm, torch.ones_like(s_norm))
            g_norm = torch.sqrt(g.pow(2).sum() + 1e-30)
            term = (g_norm / s_norm - 1.0) ** 2
            if self.orthogonality:
                term = term + self.orthogonality * ((g * s).sum() / (g_norm * s_norm)) ** 2
            total = total + torch.where(shared, term, torch.zeros_like(term))
        return total

    def __repr__(self) -> str:
        return f"{self.name}(orthogonality={self.orthogonality:g})"


class CensorInvariants(AdaptedAttack):
    """Match per-layer norms and orthogonality to the shared gradient (see module docstring)."""

    name = "censor-invariants"
    owns = ("objective", "weights", "masks", "sigma", "b")

    def __init__(self, orthogonality: float = 1.0, base: str = "ig", **knobs):
        super().__init__(base, **knobs)
        self.objective = InvariantObjective(orthogonality)

    def adapt(self, observation: Observation) -> Adaptation:
        layers = sum(1 for g in observation.gradients if float(g.norm()) > 0)
        return Adaptation({"objective": self.objective},
                          {"matched": {"invariants": ["norm", "orthogonality"], "layers": layers},
                           "objective": repr(self.objective)})


register(CensorInvariants, "CENSOR: match the per-layer norms and the orthogonality it preserves, not the direction")
