"""PRECODE (Scheliga et al., WACV 2022): a variational bottleneck before the output layer.

``wrap_model`` replaces the last ``nn.Linear`` (in place) by ``bottleneck -> linear``; the
bottleneck encodes the features to ``mu`` / ``logvar`` of size ``K``, samples
``b = mu + exp(logvar / 2) * e`` and decodes ``b`` back to the feature size. The client's
loss is ``loss_fn + beta * KL(N(mu, sigma) || N(0, I))``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.models import last_linear
from audit.core.types import Defense, clean_gradients, default_loss_fn

from defenses.common import check_range, randn
from defenses.registry import DEFENSES


class VariationalBottleneck(nn.Module):
    """``features -> (mu, logvar) -> b -> features``; records the batch-mean KL in ``last_kl``.

    The latent is sampled only while a generator is attached (:meth:`sampling`, which the
    PRECODE defense does during the client's gradient computation); otherwise ``b = mu``
    (evaluation, inference). ``fixed_latent`` (when set) replaces ``b``: adaptive attacks
    that optimise the latent jointly with the input set it.
    """

    def __init__(self, features: int, latent: int):
        super().__init__()
        self.encoder = nn.Linear(features, 2 * latent)
        self.decoder = nn.Linear(latent, features)
        self.latent = latent
        self.generator: Optional[torch.Generator] = None
        self.fixed_latent: Optional[Tensor] = None
        self.last_kl: Optional[Tensor] = None
        self.last_latent: Optional[Tensor] = None

    def __getstate__(self):
        # copies / pickles drop the per-call state (a non-leaf KL tensor cannot be deep-copied)
        state = self.__dict__.copy()
        state.update(generator=None, last_kl=None, last_latent=None)
        return state

    @contextlib.contextmanager
    def sampling(self, generator: torch.Generator) -> Iterator["VariationalBottleneck"]:
        previous, self.generator = self.generator, generator
        try:
            yield self
        finally:
            self.generator = previous

    def posterior(self, x: Tensor):
        """``(mu, sigma)`` of the draw (the :class:`~audit.core.types.LatentBottleneck` protocol)."""
        mu, logvar = self.encoder(x).chunk(2, dim=-1)
        return mu, (0.5 * logvar).exp()

    def forward(self, x: Tensor) -> Tensor:
        mu, logvar = self.encoder(x).chunk(2, dim=-1)
        self.last_kl = 0.5 * (mu ** 2 + logvar.exp() - 1 - logvar).sum(-1).mean()
        if self.fixed_latent is not None:
            b = self.fixed_latent
        elif self.generator is not None:
            b = mu + (0.5 * logvar).exp() * randn(mu.shape, generator=self.generator, device=mu.device, dtype=mu.dtype)
        else:
            b = mu
        self.last_latent = b
        return self.decoder(b)


def bottlenecks(model: nn.Module) -> List[VariationalBottleneck]:
    return [m for m in model.modules() if isinstance(m, VariationalBottleneck)]


def kl_loss(model: nn.Module) -> Tensor:
    """Sum of the KL terms recorded by the model's bottlenecks at their last forward."""
    found = [m.last_kl for m in bottlenecks(model) if m.last_kl is not None]
    if not found:
        raise ConfigError("the model has no PRECODE bottleneck that ran a forward pass; wrap it with "
                          "build_defense('precode').wrap_model(model) and call the model first")
    return sum(found)


@DEFENSES.register("precode", "Variational bottleneck (K=256) before the output layer, loss + beta*KL (beta=1e-3)")
class Precode(Defense):
    """Architectural defense: use :meth:`wrap_model` on the client model before training."""

    name = "precode"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = True

    def __init__(self, latent: int = 256, beta: float = 1e-3, seed: int = 0):
        self.latent = check_range(self.name, "latent", latent, 1, None, integer=True)
        self.beta = check_range(self.name, "beta", beta, 0, None)
        self.seed = int(seed)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Insert the bottleneck before the last ``nn.Linear`` (in place; idempotent)."""
        if bottlenecks(model):
            return model
        name, head = last_linear(model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            neck = VariationalBottleneck(head.in_features, self.latent)
        neck = neck.to(device=head.weight.device, dtype=head.weight.dtype)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, nn.Sequential(neck, head))
        return model

    def latent_bottlenecks(self, model: nn.Module) -> List[VariationalBottleneck]:
        return bottlenecks(model)

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        necks = bottlenecks(model)
        if not necks:
            raise ConfigError("precode: the model has no bottleneck; train the model returned by "
                              "defense.wrap_model(model)")
        gen = generator if generator is not None else torch.Generator(device=inputs.device)

        def loss_with_kl(logits, y):
            return loss_fn(logits, y) + self.beta * kl_loss(model)

        with contextlib.ExitStack() as stack:
            for neck in necks:
                stack.enter_context(neck.sampling(gen))
            return clean_gradients(model, inputs, labels, loss_with_kl)
