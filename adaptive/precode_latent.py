"""Latent recovery against PRECODE's variational bottleneck.

PRECODE's randomness is the bottleneck draw ``b`` fed to the decoder ``Linear(K, F)``. For one
image the decoder's weight gradient is ``db_dec b^T``, so the draw is recovered exactly:
``b = dW_dec[i] / db_dec[i]`` (the same closed form as analytic first-layer inversion,
:func:`attacks.analytic.invert_linear_input`). With ``b`` fixed the client model is
deterministic again:

* when the model starts with a linear layer (the PRECODE MLP) the image itself comes from
  that layer's gradient in closed form, and the recovered ``(x, b)`` is checked by
  recomputing the defended gradient;
* otherwise the dummy image is optimised through the defense (its loss, KL term included)
  with the bottleneck's noise pinned so that its draw is ``b`` (:func:`pin_latents`).

Batches of more than one image mix the draws in the decoder gradient; those are reported
as not applicable.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from attacks.analytic import AnalyticInversion, invert_linear_input
from attacks.optimization import Progress
from attacks.simulator import ClientReplica, DefenseSimulator
from audit.core.defense_call import invoke_defense
from audit.core.reasons import Reason
from audit.core.types import LatentBottleneck, Observation, Reconstruction

from adaptive.adapted import Adaptation, AdaptedAttack, register


def declared_bottlenecks(defense: Any, model: torch.nn.Module) -> List[LatentBottleneck]:
    """The bottlenecks ``defense`` declares in ``model`` (:meth:`Defense.latent_bottlenecks`)."""
    declared = getattr(defense, "latent_bottlenecks", None)
    return list(declared(model)) if callable(declared) else []


def recover_latents(observation: Observation) -> List[Tuple[str, Tensor, float]]:
    """``(decoder name, b (1, K), |db_dec[row]|)`` for every declared bottleneck of the model."""
    names = {m: n for n, m in observation.model.named_modules()}
    out = []
    for neck in declared_bottlenecks(observation.defense, observation.model):
        layer = names[neck.decoder]
        b, _, strength = invert_linear_input(observation, layer)
        out.append((layer, b.detach().unsqueeze(0), strength))
    return out


def pin_latents(defense: Any, model: torch.nn.Module, latents: List[Tensor]) -> torch.nn.Module:
    """Pin the bottlenecks' draws (in order) to ``latents``, in place; returns the model.

    The draw keeps the client's reparameterisation: ``b = mu(x) + sigma(x) * e`` with the
    noise ``e = (b* - mu(x)) / sigma(x)`` held constant, so ``b`` equals the recovered
    ``b*`` while gradients flow through ``mu`` and ``sigma`` as they did on the client
    (a constant ``b`` would cut the input out of the classification loss).
    """
    for neck, b in zip(declared_bottlenecks(defense, model), latents):
        neck.register_forward_pre_hook(_pinned_draw(b))
    return model


def _pinned_draw(b: Tensor):
    def hook(neck: LatentBottleneck, inputs):
        mu, sigma = neck.posterior(inputs[0])
        neck.fixed_latent = mu + sigma * ((b - mu) / sigma).detach()

    return hook


class PinnedLatentSimulator(DefenseSimulator):
    """The defense run on a replica whose bottleneck draws are the recovered ones."""

    def __init__(self, latents: List[Tensor]):
        super().__init__()
        self.latents = latents

    def prepare(self, observation: Observation) -> ClientReplica:
        replica = super().prepare(observation)
        pin_latents(observation.defense, replica.model, self.latents)
        return replica

    def describe(self) -> str:
        return f"PinnedLatentSimulator({len(self.latents)} bottleneck(s))"


def consistency(observation: Observation, images: Tensor, labels: Tensor, latents: List[Tensor]) -> float:
    """Relative distance between the observation and the defended gradient recomputed at
    ``(images, latents)``: ~0 when both were recovered exactly."""
    model = pin_latents(observation.defense, copy.deepcopy(observation.model), latents)
    shared = invoke_defense(observation.defense, model, images, labels, loss_fn=observation.loss_fn,
                            generator=None, round=observation.step)
    num = sum(float((s.detach() - g).pow(2).sum()) for s, g in zip(shared, observation.gradients))
    den = sum(float(g.pow(2).sum()) for g in observation.gradients)
    return (num / max(den, 1e-30)) ** 0.5


class PrecodeLatent(AdaptedAttack):
    """Recover the bottleneck draw, then the image (closed form or optimisation)."""

    name = "precode-latent"
    owns = ("simulator",)

    def _skip(self, observation: Observation) -> Optional[Reason]:
        if not declared_bottlenecks(observation.defense, observation.model):
            return Reason("precode-no-bottleneck")
        if observation.batch_size != 1:
            return Reason("precode-batch", batch=observation.batch_size)
        if not observation.one_step or observation.defense is None:
            return Reason("precode-white-box-one-step")
        return None

    def adapt(self, observation: Observation) -> Adaptation:
        why = self._skip(observation)
        if why:
            return Adaptation(skip=why)
        found = recover_latents(observation)
        notes: Dict[str, Any] = {"latents": {name: {"norm": float(b.norm()), "bias_gradient": s}
                                             for name, b, s in found}}
        return Adaptation({"simulator": PinnedLatentSimulator([b for _, b, _ in found])}, notes)

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Progress] = None) -> Reconstruction:
        adaptation = self.adapt(observation)
        if adaptation.skip:
            return Reconstruction.not_applicable(adaptation.skip, **adaptation.notes)
        latents = adaptation.knobs["simulator"].latents
        closed = AnalyticInversion().reconstruct(observation, seed=seed)
        if closed.applicable:
            rec = closed
            rec.trace["attack"] = self.name
            rec.trace["adaptive"] = {"attack": self.name, "image": "closed form (first linear layer)",
                                     **adaptation.notes}
        else:
            rec = self.compose(observation, adaptation).reconstruct(observation, budget, seed, progress)
            rec.trace["adaptive"] = {"attack": self.name, "base": self.base,
                                     "image": "optimised with the latent pinned", "closed_form": closed.reason.to_dict(),
                                     **adaptation.notes}
        rec.trace["adaptive"]["gradient_residual"] = consistency(observation, rec.inputs, rec.labels, latents)
        return rec


register(PrecodeLatent, "PRECODE: recover the bottleneck draw from the decoder gradient, then the image")
