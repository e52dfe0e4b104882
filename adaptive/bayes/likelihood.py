"""Monte Carlo estimate of log p(g | x) for a stochastic defense without a closed form.

Given K defended gradients ``d_1..d_K`` of the same dummy input (K draws of the defense's
randomness, differentiable w.r.t. the input), the likelihood of the observed gradient
``g`` is estimated with a Gaussian kernel density around the draws:

    log p(g | x) ~= log (1/K) sum_k prod_l N(g_l; d_{k,l}, h_l^2 I)

with one bandwidth ``h_l`` per parameter tensor: the pooled standard deviation of the
draws in that tensor (detached), floored at ``floor * RMS(g_l)`` so that coordinates the
defense leaves deterministic (one draw = a point mass) still contribute an L2 term.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch
from torch import Tensor

from attacks.objectives import Objective
from audit.core.errors import ConfigError


def pooled_bandwidths(draws: Sequence[Sequence[Tensor]], shared: Sequence[Tensor], floor: float) -> List[Tensor]:
    """Per-tensor kernel bandwidth: pooled std of the draws, at least ``floor * RMS(shared)``."""
    out = []
    for layer, g in enumerate(shared):
        stack = torch.stack([d[layer].detach() for d in draws])  # (K, *shape)
        k = len(draws)
        # the mean over coordinates of the unbiased per-coordinate variance (Tensor.var over
        # dim 0 is several times slower on the CPU)
        var = (stack - stack.mean(0)).pow(2).sum() / ((k - 1) * g.numel()) if k > 1 else stack.new_zeros(())
        low = floor * g.detach().pow(2).mean().sqrt().clamp_min(1e-12)
        out.append(torch.maximum(var.sqrt(), low))
    return out


def kernel_log_likelihood(shared: Sequence[Tensor], draws: Sequence[Sequence[Tensor]],
                          floor: float = 0.05) -> Tensor:
    """The kernel density estimate of ``log p(shared | x)`` from ``draws`` (a scalar)."""
    if not draws:
        raise ConfigError("the Monte Carlo likelihood needs at least one defense draw (mc_draws >= 1)")
    if floor <= 0:
        raise ConfigError(f"the bandwidth floor must be > 0, got {floor}")
    bandwidths = pooled_bandwidths(draws, shared, floor)
    per_draw = []
    for d in draws:
        total = shared[0].new_zeros(())
        for g, dl, h in zip(shared, d, bandwidths):
            total = total - 0.5 * ((g - dl) / h).pow(2).sum() - g.numel() * (torch.log(h) + 0.5 * math.log(2 * math.pi))
        per_draw.append(total)
    return torch.logsumexp(torch.stack(per_draw), 0) - math.log(len(draws))


# --------------------------------------------------------------------------- objectives
# The ball simulator (:class:`adaptive.bayes.simulator.BallSimulator`) returns every
# parameter's gradient stacked as ``(k, draws, *shape)``: k points of the delta-ball, each
# through ``draws`` runs of the (possibly random) client. These objectives turn that into
# the negative Monte Carlo objective of Eq. 3 (the optimisation attack minimises). An exact likelihood
# (or any gradient distance) is averaged over them by ``attacks.objectives.StackedMean(inner,
# "ball-mean", dims=2)``.


class MonteCarloLikelihood(Objective):
    """``-(1/k) sum_i log p^(g | x_i)``, ``p^`` the kernel density over the defense draws."""

    def __init__(self, floor: float = 0.05):
        if floor <= 0:
            raise ConfigError(f"bandwidth_floor must be > 0, got {floor}")
        self.floor = float(floor)
        self.name = f"monte-carlo(floor={self.floor:g})"

    def __call__(self, dummy_grads, target_grads):
        k, draws = dummy_grads[0].shape[:2]
        total = 0.0
        for i in range(k):
            samples = [[g[i, d] for g in dummy_grads] for d in range(draws)]
            total = total - kernel_log_likelihood(target_grads, samples, self.floor)
        return total / k
