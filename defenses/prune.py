"""Gradient pruning: deterministic magnitude top-k, and the Bayes paper's soft pruning."""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
from torch import Tensor

from audit.core.types import Defense

from defenses.common import check_choice, check_range, flatten, rand, resolve_generator, unflatten
from defenses.noise import NOISES, add_noise
from defenses.registry import DEFENSES


def topk_mask(values: Tensor, ratio: float) -> Tensor:
    """Boolean mask keeping the ``n - round(ratio * n)`` entries of largest magnitude."""
    flat = values.detach().reshape(-1)
    keep = flat.numel() - int(round(ratio * flat.numel()))
    mask = torch.zeros_like(flat, dtype=torch.bool)
    if keep > 0:  # out-of-place scatter: runs under vmap (an adaptive attack's batched replay)
        mask = mask.scatter(0, torch.topk(flat.abs(), keep, sorted=False).indices, True)
    return mask.view_as(values)


@DEFENSES.register("prune", "Zero the `ratio` fraction of smallest-magnitude entries, per layer or global; ratio=0.9")
class Prune(Defense):
    """Magnitude pruning: keeps exactly ``n - round(ratio * n)`` entries (per tensor when
    ``scope='layer'``, over the whole model when ``scope='global'``)."""

    name = "prune"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = False
    SCOPES = ("layer", "global")

    def __init__(self, ratio: float = 0.9, scope: str = "layer"):
        self.ratio = check_range(self.name, "ratio", ratio, 0, 1, high_open=True)
        self.scope = check_choice(self.name, "scope", scope, self.SCOPES)

    def masks(self, grads: Sequence[Tensor]) -> List[Tensor]:
        """The boolean keep-masks applied to ``grads`` (what mask-replay attackers reuse)."""
        if self.scope == "global":
            return unflatten(topk_mask(flatten([g.detach() for g in grads]), self.ratio), grads)
        return [topk_mask(g, self.ratio) for g in grads]

    def transform(self, grads, *, generator=None, model=None):
        return [g * m for g, m in zip(grads, self.masks(grads))]


@DEFENSES.register(
    "soft-prune", "Bayes paper: drop each entry with prob `prune_prob` (0.5), then add noise (sigma=0.1)"
)
class SoftPrune(Defense):
    """Random mask then noise: ``s_j = m_j g_j + n_j`` with ``m_j ~ Bernoulli(1 - prune_prob)``.

    The mask is unknown to the attacker, so :meth:`log_prob` is the exact per-coordinate
    mixture ``p N(s; 0) + (1 - p) N(s; g)`` (``N`` the noise density, Gaussian or Laplace).
    """

    name = "soft-prune"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = True
    vmap_draws = True

    def __init__(self, prune_prob: float = 0.5, sigma: float = 0.1, noise: str = "gaussian"):
        self.prune_prob = check_range(self.name, "prune_prob", prune_prob, 0, 1)
        self.sigma = check_range(self.name, "sigma", sigma, 0, None, low_open=True)
        self.noise = check_choice(self.name, "noise", noise, sorted(NOISES))

    def transform(self, grads, *, generator=None, model=None):
        gen = resolve_generator(generator, grads[0].device)
        masked = [
            g * (rand(g.shape, generator=gen, device=g.device, dtype=g.dtype) >= self.prune_prob)
            for g in grads
        ]
        return add_noise(masked, self.noise, self.sigma, gen)

    def log_prob_elementwise(self, shared: Tensor, clean: Tensor) -> Tensor:
        """Per-coordinate log of the mixture density."""
        density = NOISES[self.noise][1]
        terms = []
        if self.prune_prob > 0:
            terms.append(math.log(self.prune_prob) + density(shared, self.sigma))
        if self.prune_prob < 1:
            terms.append(math.log1p(-self.prune_prob) + density(shared - clean, self.sigma))
        return torch.logsumexp(torch.stack(terms), dim=0)

    def log_prob(self, shared: Sequence[Tensor], clean: Sequence[Tensor]) -> Tensor:
        """Exact ``log p(shared | clean)`` with the mask marginalised out (differentiable)."""
        return sum(self.log_prob_elementwise(s, c).sum() for s, c in zip(shared, clean))
