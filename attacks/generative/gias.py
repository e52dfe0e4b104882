"""GIAS (Jeon et al., NeurIPS 2021): gradient inversion in alternative spaces.

1. Latent search: Adam over ``z`` (``restarts`` batched), matching ``simulate(G(z, y))`` to
   the shared gradient; the best restart is kept.
2. Parameter search: every image gets its own copy of the generator's weights, optimised
   jointly with its latent (``torch.func.functional_call`` under ``vmap`` over the images),
   with an optional L2 pull of the weights towards the pretrained ones (``weight_reg``).

``budget`` is the total number of Adam iterations; ``latent_fraction`` of it goes to step 1
(``latent_fraction=1`` is plain latent search, the baseline GIAS improves on).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor
from torch.func import functional_call

from audit.core.errors import ConfigError

from attacks.generative.common import GenerativeAttack, GenerativeSetup, adam_search, generate, search_latents


class GIAS(GenerativeAttack):
    """Latent search, then per-image generator-parameter search, with the gradient-matching loss."""

    name = "gias"

    def __init__(self, *, generator=None, generator_factory: Optional[str] = None, budget: int = 600,
                 latent_fraction: float = 0.4, restarts: int = 4, lr_latent: float = 0.03,
                 lr_params: float = 1e-3, weight_reg: float = 0.0, kl: float = 0.0, objective: str = "cosine",
                 labels: str = "infer", condition: str = "auto", simulator: Any = "auto", tv: float = 0.0):
        super().__init__(generator=generator, generator_factory=generator_factory, objective=objective,
                         labels=labels, condition=condition, simulator=simulator, tv=tv)
        if not 0.0 < latent_fraction <= 1.0 or restarts < 1:
            raise ConfigError(f"gias: latent_fraction must be in (0, 1] and restarts >= 1, got "
                              f"{latent_fraction}, {restarts}")
        if lr_latent <= 0 or lr_params <= 0 or weight_reg < 0 or kl < 0:
            raise ConfigError("gias: learning rates must be > 0, weight_reg and kl >= 0")
        self.budget, self.latent_fraction, self.restarts = int(budget), float(latent_fraction), int(restarts)
        self.lr_latent, self.lr_params, self.weight_reg, self.kl = lr_latent, lr_params, weight_reg, kl

    def candidates_per_step(self) -> float:
        # latent search scores ``restarts`` candidates per step, the parameter search one
        return self.latent_fraction * self.restarts + (1.0 - self.latent_fraction)

    def run(self, setup: GenerativeSetup, budget: int) -> Tuple[Tensor, Dict[str, Any]]:
        latent_steps = max(1, round(budget * self.latent_fraction))
        param_steps = budget - latent_steps
        z, latent_trace = search_latents(setup, latent_steps, self.restarts, self.lr_latent, self.kl)
        trace: Dict[str, Any] = {"latent_search": latent_trace}
        if param_steps == 0:
            with torch.no_grad():
                return generate(setup.generator, z, setup.cond)[0], trace
        images, param_trace = self.search_parameters(setup, z[0], param_steps)
        trace["parameter_search"] = param_trace
        return images, trace

    def search_parameters(self, setup: GenerativeSetup, z: Tensor, steps: int) -> Tuple[Tensor, Dict[str, Any]]:
        """Adam over per-image generator weights and latents, from the latent-search optimum."""
        gen, b = setup.generator, z.shape[0]
        names = [n for n, _ in gen.named_parameters()]
        base = {n: p.detach() for n, p in gen.named_parameters()}
        buffers = dict(gen.named_buffers())
        cond = setup.cond

        def one_image(params, zi, yi):
            y = None if yi is None else yi.unsqueeze(0)
            return functional_call(gen, (params, buffers), (zi.unsqueeze(0), y))[0]

        def images_of(variables):
            params = dict(zip(names, variables[1:]))
            in_dims = (0, 0, None if cond is None else 0)
            return torch.func.vmap(one_image, in_dims=in_dims)(params, variables[0], cond)

        def loss_fn(variables):
            loss, _ = setup.scorer(images_of(variables).unsqueeze(0))
            if self.weight_reg:
                loss = loss + self.weight_reg * sum((v - base[n]).pow(2).sum() for n, v in zip(names, variables[1:]))
            return loss

        start = [z] + [base[n].expand(b, *base[n].shape).clone() for n in names]
        lrs = [self.lr_latent] + [self.lr_params] * len(names)
        best, best_loss, history = adam_search(start, loss_fn, steps, lrs, on_step=setup.tick)
        with torch.no_grad():
            images = images_of(best)
        drift = sum(float((v - base[n]).pow(2).sum()) for n, v in zip(names, best[1:])) ** 0.5
        return images, {"iterations": steps, "final_loss": float(best_loss[0]), "loss_history": history[0],
                        "weight_drift_l2": drift}

