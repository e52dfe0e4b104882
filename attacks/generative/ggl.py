"""GGL (Li et al., CVPR 2022): gradient-free search of a generator's latent space.

Minimise ``||simulate(G(z, y)) - shared||^2 + kl * KL(z)`` over ``z`` with a nevergrad
optimiser (CMA-ES by default), the class ``y`` from label inference. The dummy gradient is
what the client would share: by default it goes through the observation's defense
(white-box), so the search adapts to deterministic defenses (clipping, pruning masks, ...).
``budget`` counts loss evaluations (GGL: 800); each round asks ``batch`` candidates and
scores them as one batched computation.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from audit.core.errors import ConfigError

from attacks.generative.common import GenerativeAttack, GenerativeSetup, generate, latent_kl


def nevergrad_optimizer(name: str, dimension: int, budget: int, batch: int, seed: int):
    """A seeded nevergrad optimiser from ``ng.optimizers.registry`` over ``R^dimension``."""
    import nevergrad as ng

    if name not in ng.optimizers.registry:
        close = [n for n in ng.optimizers.registry if n.lower() == name.lower()]
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown nevergrad optimizer {name!r}.{hint} Use a name of "
                          "nevergrad.optimizers.registry, e.g. CMA, DiagonalCMA, TwoPointsDE, PSO, OnePlusOne")
    param = ng.p.Array(init=np.zeros(dimension))
    param.random_state = np.random.RandomState(seed)
    return ng.optimizers.registry[name](parametrization=param, budget=budget, num_workers=batch)


class GGL(GenerativeAttack):
    """Generative Gradient Leakage: nevergrad latent search, L2 matching + KL latent prior."""

    name = "ggl"

    def __init__(self, *, generator=None, generator_factory: Optional[str] = None, optimizer: str = "CMA",
                 budget: int = 800, batch: int = 16, kl: float = 0.1, objective: str = "l2",
                 labels: str = "infer", condition: str = "auto", simulator: Any = "auto", tv: float = 0.0):
        super().__init__(generator=generator, generator_factory=generator_factory, objective=objective,
                         labels=labels, condition=condition, simulator=simulator, tv=tv)
        if batch < 1 or kl < 0:
            raise ConfigError(f"ggl: batch must be >= 1 and kl >= 0, got batch={batch}, kl={kl}")
        self.optimizer, self.budget, self.batch, self.kl = optimizer, int(budget), int(batch), float(kl)

    def run(self, setup: GenerativeSetup, budget: int) -> Tuple[Tensor, Dict[str, Any]]:
        gen, obs = setup.generator, setup.observation
        shape = (obs.batch_size, gen.latent_dim)
        seed = int(torch.randint(2 ** 31 - 1, (1,), generator=setup.rng, device=setup.rng.device))
        opt = nevergrad_optimizer(self.optimizer, int(np.prod(shape)), budget, self.batch, seed)
        best_loss, best_z, history = float("inf"), None, []
        done = 0
        while done < budget:
            asked = [opt.ask() for _ in range(min(self.batch, budget - done))]
            z = torch.as_tensor(np.stack([c.value for c in asked]), dtype=torch.float32,
                                device=obs.device).reshape(len(asked), *shape)
            with torch.no_grad():
                images = generate(gen, z, setup.cond)
            match, _ = setup.scorer(images)
            loss = torch.nan_to_num(match.detach() + self.kl * latent_kl(z), nan=float("inf"))
            for cand, value in zip(asked, loss.tolist()):
                opt.tell(cand, value)
            i = int(torch.argmin(loss))
            if best_z is None or float(loss[i]) < best_loss:
                best_loss, best_z = float(loss[i]), z[i].clone()
            history.append(best_loss)
            done += len(asked)
            setup.tick(len(asked), best_loss)
        with torch.no_grad():
            images = generate(gen, best_z.unsqueeze(0), setup.cond)[0]
        trace = {"optimizer": self.optimizer, "final_loss": best_loss, "loss_history": history,
                 "latent_norm": best_z.norm(dim=-1).tolist()}
        return images, trace
