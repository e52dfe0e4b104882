"""Planner rules: each maps :class:`~adaptive.planner.traits.DefenseTraits` to the attacks that
exploit them, each with its reason as a code and the numbers behind it
(:class:`~audit.core.reasons.Reason`; the report words it). Rules are registered, not chained:
adding one is one decorated function.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List

from audit.core.reasons import Reason
from audit.core.registry import Registry

from adaptive.bayes.optimal import applies as bayes_applies
from adaptive.inverter.attack import applies as inverter_applies
from adaptive.planner.traits import DefenseTraits

RULES = Registry("planner rule")

EOT_SAMPLES = 8
#: the order attacks are listed in a plan: the most defense-specific first
ORDER = ("precode-latent", "svd-subspace", "mask-replay", "layer-drop", "censor-invariants", "analytic",
         "spear", "spear-ig", "conv-span", "through-defense", "bayes-l2", "bayes-l1", "bayes-optimal", "learned-inverter")


@dataclass
class PlannedAttack:
    """An attack the planner proposes: registry name, settings for it, and why (a code)."""

    name: str
    settings: Dict[str, Any]
    why: Reason
    adaptive: bool = True  # False for the naive baseline the adaptive attacks are compared with

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "settings": dict(self.settings), "why": self.why.to_dict(),
                "adaptive": self.adaptive}


Rule = Callable[[DefenseTraits], List[PlannedAttack]]


@RULES.register("baseline", "the naive attack the defense was designed against")
def baseline(t: DefenseTraits) -> List[PlannedAttack]:
    why = Reason("planner-clean-gradient" if t.identity else "planner-naive-baseline")
    return [PlannedAttack("portfolio", {}, why, adaptive=False)]


@RULES.register("analytic", "batch-1 linear gradients still rank-1: closed-form inversion")
def analytic(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.analytic_layers:
        return []
    return [PlannedAttack("analytic", {}, Reason("planner-analytic", layers=len(t.analytic_layers)))]


@RULES.register("spear", "linear-layer gradients keep their rank and ReLU sparsity: exact batch recovery")
def spear(t: DefenseTraits) -> List[PlannedAttack]:
    noisy = t.noise_family == "gaussian" and not (t.sparse or t.low_rank or t.quantized or t.orthogonal)
    if not (t.analytic_layers or noisy):
        return []
    because = (Reason("planner-rank-structured", layers=len(t.analytic_layers)) if t.analytic_layers
               else Reason("planner-gaussian-only", std=t.noise_std)).to_dict()
    if t.relu_linear_input == "features":
        return [PlannedAttack("spear-ig", {}, Reason("planner-spear-features", because=because))]
    return [PlannedAttack("spear", {}, Reason("planner-spear", because=because))]


@RULES.register("conv-span", "deep convolutions' gradients span their input's patches: the batch from their row spaces")
def conv_span(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.conv_span_layers:
        return []
    changed = set(t.changed_layers)
    whole = [n for n in t.conv_span_layers if f"{n}.weight" not in changed]
    return [PlannedAttack("conv-span", {}, Reason("planner-conv-span", layers=list(t.conv_span_layers),
                                                  changed=bool(changed), whole=len(whole)), adaptive=False)]


@RULES.register("through-defense", "pass the dummy gradient through the defense (replay / EOT)")
def through_defense(t: DefenseTraits) -> List[PlannedAttack]:
    if t.identity or t.architectural or not t.differentiable:
        return []
    if not t.stochastic:
        return [PlannedAttack("through-defense", {"samples": 1}, Reason("planner-replay"))]
    if t.noise_family and not (t.sparse or t.orthogonal or t.quantized or t.input_transform):
        return []  # additive noise: EOT only adds variance; the likelihood rule covers it
    return [PlannedAttack("through-defense", {"samples": EOT_SAMPLES}, Reason("planner-eot", samples=EOT_SAMPLES))]


@RULES.register("mask-replay", "read the pruning mask from the observed zeros")
def mask_replay(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.sparse:
        return []
    return [PlannedAttack("mask-replay", {}, Reason("planner-mask", sparsity=t.sparsity))]


@RULES.register("layer-drop", "drop the perturbed layers from the matching objective")
def layer_drop(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.few_layers_changed or t.sparse and not t.one_layer_changed:
        return []
    return [PlannedAttack("layer-drop", {"layers": "auto"}, Reason(
        "planner-layer-drop", one=bool(t.one_layer_changed), changed=len(t.changed_layers), tensors=len(t.layers),
        layers=list(t.changed_layers[:4])))]


@RULES.register("censor-invariants", "match the per-layer norms and orthogonality CENSOR keeps")
def censor_invariants(t: DefenseTraits) -> List[PlannedAttack]:
    if not (t.norm_preserving and t.orthogonal):
        return []
    return [PlannedAttack("censor-invariants", {}, Reason("planner-censor-invariants"))]


@RULES.register("svd-subspace", "match only the transmitted low-rank subspace")
def svd_subspace(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.low_rank:
        return []
    return [PlannedAttack("svd-subspace", {}, Reason("planner-svd-subspace", layers=len(t.rank_reduced_layers)))]


@RULES.register("precode-latent", "architectural bottleneck: analytic recovery + latent variable")
def precode_latent(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.architectural:
        return []
    return [PlannedAttack("precode-latent", {}, Reason("planner-precode-latent"))]


@RULES.register("noise-likelihood", "match with the noise's own log-likelihood (L2 / L1)")
def noise_likelihood(t: DefenseTraits) -> List[PlannedAttack]:
    preset = {"gaussian": "bayes-l2", "laplace": "bayes-l1"}.get(t.noise_family or "")
    if not (t.stochastic and preset):
        return []
    return [PlannedAttack(preset, {}, Reason("planner-noise-likelihood", family=t.noise_family, std=t.noise_std))]


def _offered(applies: Callable[[DefenseTraits], Any], name: str, t: DefenseTraits) -> List[PlannedAttack]:
    """Ask an attack's own ``applies(traits) -> (bool, Reason)``."""
    ok, why = applies(t)
    return [PlannedAttack(name, {}, why)] if ok else []


@RULES.register("bayes-optimal", "the Bayes adversary, for a known likelihood or randomness")
def bayes_optimal(t: DefenseTraits) -> List[PlannedAttack]:
    return _offered(bayes_applies, "bayes-optimal", t)


@RULES.register("learned-inverter", "train an inverter where gradient matching has nothing to hold")
def learned_inverter(t: DefenseTraits) -> List[PlannedAttack]:
    return _offered(inverter_applies, "learned-inverter", t)


@RULES.register("input-transform", "the shared gradient belongs to a transformed input")
def input_transform(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.input_transform:
        return []
    return [PlannedAttack("ig", {}, Reason("planner-input-transform", source=t.input_transform_source.to_dict()),
                          adaptive=False)]


@RULES.register("clean-rounds", "the clean gradient is sometimes shared: attack those rounds with plain matching")
def clean_rounds(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.sometimes_clean:
        return []
    probe = t.rounds_probe
    seen = dict(clean=probe["clean_calls"], calls=probe["calls"], rounds=list(probe.get("clean_rounds") or []))
    return [PlannedAttack("ig", {}, Reason("planner-clean-rounds-ig", **seen), adaptive=False),
            PlannedAttack("analytic", {}, Reason("planner-clean-rounds-analytic", **seen))]


@RULES.register("rescaled", "clipping only rescales: cosine matching is invariant")
def rescaled(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.rescaled or t.stochastic:
        return []
    return [PlannedAttack("ig", {}, Reason("planner-rescaled"), adaptive=False)]
