"""GIFD (Fang et al., ICCV 2023): gradient inversion over the generator's feature domains.

Search the latent first (Adam, ``restarts`` batched), then move down the generator one
block at a time: the features ``h_k`` entering block ``k`` start from the previous stage's
result and are optimised as ``h_k0 + delta`` with ``delta`` projected onto an l1 ball
(radius ``radius * growth^(k-1) * ||h_k0||_1``, so the deviation stays on the generator's
manifold while growing more expressive). Every stage's result is scored by the attack loss
and the best stage (and restart) is returned.

``budget`` is the total number of Adam iterations, split evenly over the stages.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.errors import ConfigError
from audit.core.reasons import Reason

from attacks.generative.common import GenerativeAttack, GenerativeSetup, adam_search, generate, search_latents


def project_l1_ball(v: Tensor, radius: Tensor) -> Tensor:
    """Euclidean projection of each row of ``v`` ``(N, D)`` onto ``{x : ||x||_1 <= radius_n}``
    (sort-based, Duchi et al. 2008); ``radius`` is ``(N,)``."""
    a = v.abs()
    inside = a.sum(1) <= radius
    u, _ = torch.sort(a, dim=1, descending=True)
    css = u.cumsum(1)
    k = torch.arange(1, v.shape[1] + 1, device=v.device, dtype=v.dtype)
    cond = u * k > (css - radius.unsqueeze(1))
    rho = cond.to(v.dtype).cumsum(1).argmax(1, keepdim=True)  # last index where cond holds
    theta = (css.gather(1, rho) - radius.unsqueeze(1)) / (rho + 1).to(v.dtype)
    projected = v.sign() * (a - theta).clamp_min(0)
    return torch.where(inside.unsqueeze(1), v, projected)


class GIFD(GenerativeAttack):
    """Latent search, then l1-ball-constrained search of intermediate features layer by layer;
    the best layer by the attack loss wins."""

    name = "gifd"

    def __init__(self, *, generator=None, generator_factory: Optional[str] = None, budget: int = 600,
                 layers: Optional[Sequence[int]] = None, restarts: int = 4, lr_latent: float = 0.03,
                 lr_features: float = 0.03, radius: float = 0.25, growth: float = 2.0, objective: str = "cosine",
                 labels: str = "infer", condition: str = "auto", simulator: Any = "auto", tv: float = 1e-4):
        super().__init__(generator=generator, generator_factory=generator_factory, objective=objective,
                         labels=labels, condition=condition, simulator=simulator, tv=tv)
        if restarts < 1 or lr_latent <= 0 or lr_features <= 0 or radius <= 0 or growth < 1:
            raise ConfigError("gifd: restarts >= 1, learning rates > 0, radius > 0 and growth >= 1 are required")
        self.budget, self.restarts = int(budget), int(restarts)
        self.layers = None if layers is None else [int(k) for k in (layers if isinstance(layers, (list, tuple))
                                                                    else [layers])]
        self.lr_latent, self.lr_features, self.radius, self.growth = lr_latent, lr_features, radius, growth

    def feature_layers(self, num_layers: int) -> list:
        """The blocks whose input features are searched (default: all but the latent)."""
        valid = list(range(1, num_layers))
        if self.layers is None:
            return valid
        bad = [k for k in self.layers if k not in valid]
        if bad or sorted(self.layers) != list(self.layers):
            raise ConfigError(f"gifd: layers must be increasing, from {valid} for this generator; got {self.layers}")
        return list(self.layers)

    def candidates_per_step(self) -> float:
        return float(self.restarts)  # every stage optimises ``restarts`` candidates per step

    def run(self, setup: GenerativeSetup, budget: int) -> Tuple[Tensor, Dict[str, Any]]:
        gen, cond = setup.generator, setup.cond
        layers = self.feature_layers(gen.num_layers) if gen.num_layers > 1 else []
        steps = max(1, budget // (1 + len(layers)))
        z, latent_trace = search_latents(setup, steps, self.restarts, self.lr_latent, keep_all=True)
        stages = [{"layer": 0, **latent_trace}]
        with torch.no_grad():
            best_images = generate(gen, z, cond)  # (R, B, C, H, W)
            best_loss = setup.scorer(best_images)[0].detach()
        best_layer = torch.zeros_like(best_loss, dtype=torch.long)
        r, b = z.shape[:2]
        y = None if cond is None else cond.repeat(r)
        with torch.no_grad():
            h = gen.features(z.reshape(r * b, -1), y, layers[0]) if layers else None
        previous = layers[0] if layers else None
        for k in layers:
            with torch.no_grad():  # carry the last stage's result down to block k
                for block in gen.blocks[previous:k]:
                    h = block(h)
            h, loss, stage = self._search_features(setup, h.reshape(r, b, *h.shape[1:]), k, steps)
            stages.append(stage)
            with torch.no_grad():
                images = gen.decode(h.reshape(r * b, *h.shape[2:]), k).reshape(r, b, *gen.image_shape)
            better = loss < best_loss
            best_images = torch.where(better.view(-1, 1, 1, 1, 1), images, best_images)
            best_layer = torch.where(better, torch.full_like(best_layer, k), best_layer)
            best_loss = torch.minimum(best_loss, loss)
            h, previous = h.reshape(r * b, *h.shape[2:]), k
        chosen = int(torch.argmin(best_loss))
        trace = {"stages": stages, "chosen_restart": chosen, "chosen_layer": int(best_layer[chosen]),
                 "final_losses": best_loss.tolist(), "steps_per_stage": steps,
                 "searched_layers": [0] + layers}
        if gen.num_layers <= 1:
            trace["note"] = Reason("gifd-no-blocks").to_dict()
        return best_images[chosen], trace

    def _search_features(self, setup: GenerativeSetup, h0: Tensor, layer: int, steps: int):
        """Adam over ``delta`` with ``h0 + delta`` decoded from block ``layer``; ``delta`` in an l1 ball."""
        gen = setup.generator
        r, b = h0.shape[:2]
        flat0 = h0.reshape(r * b, -1)
        radius = self.radius * self.growth ** (layer - 1) * flat0.abs().sum(1)

        def loss_fn(variables):
            h = (h0 + variables[0]).reshape(r * b, *h0.shape[2:])
            images = gen.decode(h, layer).reshape(r, b, *gen.image_shape)
            return setup.scorer(images)[0]

        def project(variables):
            delta = variables[0]
            delta.copy_(project_l1_ball(delta.reshape(r * b, -1), radius).reshape(delta.shape))

        best, best_loss, history = adam_search([torch.zeros_like(h0)], loss_fn, steps, [self.lr_features], project,
                                               on_step=setup.tick)
        deviation = best[0].reshape(r * b, -1).abs().sum(1) / radius.clamp_min(1e-12)
        stage = {"layer": layer, "iterations": steps, "final_losses": best_loss.tolist(),
                 "loss_history": history, "feature_shape": list(h0.shape[2:]),
                 "deviation_over_radius": deviation.tolist()}
        return h0 + best[0], best_loss, stage
