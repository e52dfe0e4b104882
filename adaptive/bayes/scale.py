"""The scale of a defense's likelihood, so the prior weight can be given scale-free.

``log p(g | x)`` of a defense with little noise is huge and steep, of one with much noise
flat; a fixed prior weight ``beta`` means "no prior" for the first and "only prior" for the
second. The per-coordinate Fisher information ``I = E[(d/dc log p(g | c))^2] / D`` of the
shared gradient ``g`` w.r.t. the clean one ``c`` measures that steepness: ``1/sigma^2`` for
Gaussian noise, ``1/b^2`` for Laplace noise, the mixture's own value for soft pruning.
With ``beta = prior_weight * I / 2`` a prior weight means the same thing under every
defense: for Gaussian noise it is exactly the TV weight of L2 matching (``bayes-l2``).

``I`` is measured white-box on a probe: a seeded random image goes through the client's
model and the defense (Kerckhoffs: the mechanism is known, not the private data).
"""
from __future__ import annotations

import copy
from typing import List, Tuple

import torch
from torch import Tensor

from audit.core.types import Observation, clean_gradients


def _probe(observation: Observation, seed: int, draws: int) -> Tuple[List[Tensor], List[List[Tensor]]]:
    """A clean gradient of a random image and ``draws`` defended ones of the same image."""
    from audit.core.defense_call import call_defense

    obs = observation
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand((obs.batch_size, *obs.input_shape), generator=gen).to(obs.device)
    y = torch.randint(obs.num_classes, (obs.batch_size,), generator=gen).to(obs.device)
    model = copy.deepcopy(obs.model).train(obs.client_mode == "train")
    clean = [g.detach() for g in clean_gradients(model, x, y, obs.loss_fn)]
    defense_gen = torch.Generator(device=obs.device).manual_seed(seed)
    shared = [[g.detach() for g in call_defense(obs.defense, model, x, y, loss_fn=obs.loss_fn,
                                                generator=defense_gen, round=obs.step)] for _ in range(draws)]
    return clean, shared


def fisher_information(observation: Observation, seed: int = 0) -> float:
    """Per-coordinate Fisher information of ``observation.defense.log_prob`` at a probe."""
    clean, (shared,) = _probe(observation, seed, 1)
    leaves = [c.clone().requires_grad_(True) for c in clean]
    log_prob = observation.defense.log_prob(shared, leaves)
    scores = torch.autograd.grad(log_prob, leaves)
    numel = sum(s.numel() for s in scores)
    return float(sum(s.pow(2).sum() for s in scores) / numel)


def draw_information(observation: Observation, seed: int = 0, floor: float = 0.05) -> float:
    """``1 / v`` with ``v`` the per-coordinate variance of the defense's randomness (two
    draws at a probe), at most ``1 / (floor * RMS)^2`` -- the Monte Carlo kernel's scale."""
    clean, (a, b) = _probe(observation, seed, 2)
    numel = sum(c.numel() for c in clean)
    var = float(sum((p - q).pow(2).sum() for p, q in zip(a, b)) / (2 * numel))
    rms2 = float(sum(c.pow(2).sum() for c in clean) / numel)
    return 1.0 / max(var, floor ** 2 * rms2, 1e-30)
