"""Planner rules: each maps :class:`~adaptive.planner.traits.DefenseTraits` to the attacks that
exploit them, with the reason in words. Rules are registered, not chained: adding one is
one decorated function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

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
    """An attack the planner proposes: registry name, settings for it, and why."""

    name: str
    settings: Dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    adaptive: bool = True  # False for the naive baseline the adaptive attacks are compared with


Rule = Callable[[DefenseTraits], List[PlannedAttack]]


def _pct(x: float) -> str:
    return f"{x:.0%}"


@RULES.register("baseline", "the naive attack the defense was designed against")
def baseline(t: DefenseTraits) -> List[PlannedAttack]:
    why = ("no perturbation detected: the clean gradient is shared" if t.identity
           else "naive baseline: the portfolio of plain gradient-matching strategies, for comparison "
                "with the adaptive attacks")
    return [PlannedAttack("portfolio", {}, why, adaptive=False)]


@RULES.register("analytic", "batch-1 linear gradients still rank-1: closed-form inversion")
def analytic(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.analytic_layers:
        return []
    return [PlannedAttack("analytic", {}, (
        f"linear-layer gradients stay exactly rank-1 consistent (dW = db x^T) in "
        f"{len(t.analytic_layers)} layer(s): the layer input is recovered in closed form "
        "for batch 1 when the audited model starts with a linear layer"))]


@RULES.register("spear", "linear-layer gradients keep their rank and ReLU sparsity: exact batch recovery")
def spear(t: DefenseTraits) -> List[PlannedAttack]:
    noisy = t.noise_family == "gaussian" and not (t.sparse or t.low_rank or t.quantized or t.orthogonal)
    if not (t.analytic_layers or noisy):
        return []
    why = (f"linear-layer gradients stay exactly rank-structured in {len(t.analytic_layers)} layer(s)"
           if t.analytic_layers else f"additive gaussian noise only (std ~{t.noise_std:.3g}), which SPEAR tolerates up "
                                     "to a level (docs/strength.md (SPEAR))")
    if t.relu_linear_input == "features":
        return [PlannedAttack("spear-ig", {}, (
            f"{why}: the model's first biased Linear followed by ReLU comes after convolutions; SPEAR recovers "
            "its input, each image's features, exactly (certified by reproducing the upload, FedSGD), and ig "
            "runs with them as a per-image prior"))]
    return [PlannedAttack("spear", {}, (
        f"{why}: where a biased Linear layer followed by ReLU is in the upload (FedSGD, or FedAvg where its input "
        "is the image), its gradient has rank <= the batch size and ReLU zeros: the whole batch's inputs are "
        "recovered exactly and certified by reproducing the upload; models without such a layer get a "
        "'not applicable' line naming the reason"))]


@RULES.register("conv-span", "deep convolutions' gradients span their input's patches: the batch from their row spaces")
def conv_span(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.conv_span_layers:
        return []
    changed = set(t.changed_layers)
    whole = [n for n in t.conv_span_layers if f"{n}.weight" not in changed]
    kept = (f"the defense leaves {len(whole)} of them whole, which it reads" if changed and whole
            else "the defense changes every one of them; the attack reads those whose upload keeps the rank gap"
            if changed else "")
    return [PlannedAttack("conv-span", {}, (
        f"{len(t.conv_span_layers)} convolution(s) have fewer output positions than channels and patch entries "
        f"({', '.join(t.conv_span_layers[:3])}{', ...' if len(t.conv_span_layers) > 3 else ''}): their weight "
        "gradient's row space is the span of their input's patches, so the images whose deep maps lie in it are "
        "the private ones, certified by reproducing the upload" + (f"; {kept}" if kept else "")), adaptive=False)]


@RULES.register("through-defense", "pass the dummy gradient through the defense (replay / EOT)")
def through_defense(t: DefenseTraits) -> List[PlannedAttack]:
    if t.identity or t.architectural or not t.differentiable:
        return []
    if not t.stochastic:
        return [PlannedAttack("through-defense", {"samples": 1}, (
            "deterministic and differentiable: replay the defense on the dummy gradient, so both "
            "sides of the matching loss are defended the same way"))]
    if t.noise_family and not (t.sparse or t.orthogonal or t.quantized or t.input_transform):
        return []  # additive noise: EOT only adds variance; the likelihood rule covers it
    return [PlannedAttack("through-defense", {"samples": EOT_SAMPLES}, (
        f"stochastic and differentiable: EOT, the dummy gradient goes through the defense "
        f"with {EOT_SAMPLES} samples of its randomness per step, averaged in the loss"))]


@RULES.register("mask-replay", "read the pruning mask from the observed zeros")
def mask_replay(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.sparse:
        return []
    return [PlannedAttack("mask-replay", {}, (
        f"sparse: {_pct(t.sparsity)} extra exact zeros in the changed layers; the mask is read "
        "from the zeros of the observed gradient and applied to the dummy gradient"))]


@RULES.register("layer-drop", "drop the perturbed layers from the matching objective")
def layer_drop(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.few_layers_changed or t.sparse and not t.one_layer_changed:
        return []
    which = "one layer" if t.one_layer_changed else f"{len(t.changed_layers)} of {len(t.layers)} tensors"
    return [PlannedAttack("layer-drop", {"layers": "auto"}, (
        f"only {which} differ from the clean gradient ({', '.join(t.changed_layers[:4])}); the "
        "others are exact: drop the defended layer from the objective (detected on the "
        "audited model from the observation, or each candidate tried and the best kept)"))]


@RULES.register("censor-invariants", "match the per-layer norms and orthogonality CENSOR keeps")
def censor_invariants(t: DefenseTraits) -> List[PlannedAttack]:
    if not (t.norm_preserving and t.orthogonal):
        return []
    return [PlannedAttack("censor-invariants", {}, (
        "every changed layer keeps its clean norm exactly and is orthogonal to the clean "
        "gradient: match ||grad_l(x')|| = ||shared_l|| and penalise <grad_l(x'), shared_l>"))]


@RULES.register("svd-subspace", "match only the transmitted low-rank subspace")
def svd_subspace(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.low_rank:
        return []
    return [PlannedAttack("svd-subspace", {}, (
        f"rank reduced in {len(t.rank_reduced_layers)} layer(s): project the dummy gradient on the "
        "transmitted row/column subspaces before matching (batch-1 linear gradients are rank 1, "
        "so truncation leaves them intact)"))]


@RULES.register("precode-latent", "architectural bottleneck: analytic recovery + latent variable")
def precode_latent(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.architectural:
        return []
    return [PlannedAttack("precode-latent", {}, (
        "wrap_model changes the client model (variational bottleneck): recover the bottleneck "
        "input analytically from the encoder's gradients and optimise the bottleneck draw "
        "jointly with the dummy input"))]


@RULES.register("noise-likelihood", "match with the noise's own log-likelihood (L2 / L1)")
def noise_likelihood(t: DefenseTraits) -> List[PlannedAttack]:
    preset = {"gaussian": "bayes-l2", "laplace": "bayes-l1"}.get(t.noise_family or "")
    if not (t.stochastic and preset):
        return []
    return [PlannedAttack(preset, {}, (
        f"the random part looks {t.noise_family} (std ~{t.noise_std:.3g}): its log-likelihood "
        f"is the matching loss"))]


def _offered(applies: Callable[[DefenseTraits], Any], name: str, t: DefenseTraits) -> List[PlannedAttack]:
    """Ask an attack's own ``applies(traits) -> (bool, reason)``."""
    ok, reason = applies(t)
    return [PlannedAttack(name, {}, reason)] if ok else []


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
    return [PlannedAttack("ig", {}, (
        f"input transform ({t.input_transform_source}): the gradient is that of the transformed "
        "image, which plain matching recovers early in training"), adaptive=False)]


@RULES.register("clean-rounds", "the clean gradient is sometimes shared: attack those rounds with plain matching")
def clean_rounds(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.sometimes_clean:
        return []
    probe = t.rounds_probe
    where = (f"at rounds {', '.join(map(str, probe['clean_rounds']))}" if probe.get("clean_rounds")
             else "on some calls (the defense takes no round)")
    seen = (f"the defense shared the clean gradient (or an exact multiple) in {probe['clean_calls']} of "
            f"{probe['calls']} probe calls, {where}")
    return [PlannedAttack("ig", {}, f"{seen}: plain cosine matching (scale-invariant) on those rounds",
                          adaptive=False),
            PlannedAttack("analytic", {}, f"{seen}: closed-form inversion of the first linear layer on "
                                          "those rounds (batch 1, models that start with a linear layer)")]


@RULES.register("rescaled", "clipping only rescales: cosine matching is invariant")
def rescaled(t: DefenseTraits) -> List[PlannedAttack]:
    if not t.rescaled or t.stochastic:
        return []
    return [PlannedAttack("ig", {}, "only the norm changes (clipping): cosine matching ignores it",
                          adaptive=False)]
