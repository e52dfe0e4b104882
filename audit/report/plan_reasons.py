"""The report's words for why an audit runs each attack: the planner's reasons (one per rule, and
the attacks' own ``applies``), what its probe saw of the defense, and the engine's reasons (a
base attack, the model's classic attack, the user's request), registered in
:data:`~audit.report.reasons.REASONS` like every other code."""
from __future__ import annotations

from typing import Any, Dict

from audit.report.reasons import Template, add_templates, word


def _spear_basis(params: Dict[str, Any]) -> str:
    return word(params.get("because"))


def _spear(params: Dict[str, Any]) -> str:
    return (f"{_spear_basis(params)}: where a biased Linear layer followed by ReLU is in the upload (FedSGD, or FedAvg "
            "where its input is the image), its gradient has rank <= the batch size and ReLU zeros: the whole batch's "
            "inputs are recovered exactly and certified by reproducing the upload; models without such a layer get a "
            "'not applicable' line naming the reason")


def _spear_features(params: Dict[str, Any]) -> str:
    return (f"{_spear_basis(params)}: the model's first biased Linear followed by ReLU comes after convolutions; SPEAR "
            "recovers its input, each image's features, exactly (certified by reproducing the upload, FedSGD), and "
            "ig runs with them as a per-image prior")


def _conv_span(params: Dict[str, Any]) -> str:
    layers = list(params.get("layers") or [])
    named = ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else "")
    text = (f"{len(layers)} convolution(s) have fewer output positions than channels and patch entries ({named}): "
            "their weight gradient's row space is the span of their input's patches, so the images whose deep maps "
            "lie in it are the private ones, certified by reproducing the upload")
    if params.get("changed"):
        text += (f"; the defense leaves {params.get('whole')} of them whole, which it reads" if params.get("whole")
                 else "; the defense changes every one of them; the attack reads those whose upload keeps the rank gap")
    return text


def _layer_drop(params: Dict[str, Any]) -> str:
    which = "one layer" if params.get("one") else f"{params.get('changed')} of {params.get('tensors')} tensors"
    return (f"only {which} differ from the clean gradient ({', '.join(params.get('layers') or [])}); the others are "
            "exact: drop the defended layer from the objective (detected on the audited model from the observation, "
            "or each candidate tried and the best kept)")


def _clean_seen(params: Dict[str, Any]) -> str:
    rounds = params.get("rounds") or []
    where = (f"at rounds {', '.join(map(str, rounds))}" if rounds else "on some calls (the defense takes no round)")
    return (f"the defense shared the clean gradient (or an exact multiple) in {params.get('clean')} of "
            f"{params.get('calls')} probe calls, {where}")


_CAUSES = {"sign-only": "only signs are shared", "quantized": "values are quantized",
           "sparse": "{sparsity:.0%} extra zeros", "low-rank": "rank-truncated gradients",
           "not-differentiable": "no gradient flows back through the defense", "stochastic": "random perturbation",
           "architectural": "the client model is changed"}


def _inverter(params: Dict[str, Any]) -> str:
    causes = "; ".join(_CAUSES.get(c, c).format(sparsity=params.get("sparsity") or 0.0)
                       for c in params.get("causes") or []) or "perturbed gradient"
    return f"{causes}: learn defended gradient -> image on auxiliary data (needs no differentiable defense)"


_TEMPLATES: Dict[str, Template] = {
    "planner-several": lambda params: "; ".join(word(r) for r in params.get("reasons") or []),
    "planner-clean-gradient": "no perturbation detected: the clean gradient is shared",
    "planner-naive-baseline": "naive baseline: the portfolio of plain gradient-matching strategies, for comparison "
                              "with the adaptive attacks",
    "planner-analytic": "linear-layer gradients stay exactly rank-1 consistent (dW = db x^T) in {layers} layer(s): "
                        "the layer input is recovered in closed form for batch 1 when the audited model starts with "
                        "a linear layer",
    "planner-rank-structured": "linear-layer gradients stay exactly rank-structured in {layers} layer(s)",
    "planner-gaussian-only": "additive gaussian noise only (std ~{std:.3g}), which SPEAR tolerates up to a level "
                             "(docs/strength.md (SPEAR))",
    "planner-spear": _spear,
    "planner-spear-features": _spear_features,
    "planner-conv-span": _conv_span,
    "planner-replay": "deterministic and differentiable: replay the defense on the dummy gradient, so both sides of "
                      "the matching loss are defended the same way",
    "planner-eot": "stochastic and differentiable: EOT, the dummy gradient goes through the defense with {samples} "
                   "samples of its randomness per step, averaged in the loss",
    "planner-mask": "sparse: {sparsity:.0%} extra exact zeros in the changed layers; the mask is read from the zeros "
                    "of the observed gradient and applied to the dummy gradient",
    "planner-layer-drop": _layer_drop,
    "planner-censor-invariants": "every changed layer keeps its clean norm exactly and is orthogonal to the clean "
                                 "gradient: match ||grad_l(x')|| = ||shared_l|| and penalise <grad_l(x'), shared_l>",
    "planner-svd-subspace": "rank reduced in {layers} layer(s): project the dummy gradient on the transmitted "
                            "row/column subspaces before matching (batch-1 linear gradients are rank 1, so truncation "
                            "leaves them intact)",
    "planner-precode-latent": "wrap_model changes the client model (variational bottleneck): recover the bottleneck "
                              "input analytically from the encoder's gradients and optimise the bottleneck draw "
                              "jointly with the dummy input",
    "planner-noise-likelihood": "the random part looks {family} (std ~{std:.3g}): its log-likelihood is the matching "
                                "loss",
    "planner-input-transform": lambda params: f"input transform ({word(params.get('source'))}): the gradient is "
                                              "that of the transformed image, which plain matching recovers early in "
                                              "training",
    "planner-clean-rounds-ig": lambda params: f"{_clean_seen(params)}: plain cosine matching (scale-invariant) on "
                                              "those rounds",
    "planner-clean-rounds-analytic": lambda params: f"{_clean_seen(params)}: closed-form inversion of the first "
                                                    "linear layer on those rounds (batch 1, models that start with a "
                                                    "linear layer)",
    "planner-rescaled": "only the norm changes (clipping): cosine matching ignores it",
    "planner-probe-failed": "probing the defense failed: {error}: {message}",
    "planner-probe-eval-mode": "eval: the model cannot run one image in train mode (BatchNorm over a 1x1 feature map), "
                               "so the planner probed the defense on it in eval mode",
    # what the probe could not measure, and what else it saw
    "transform-declared": "declared (transform_inputs)",
    "transform-probed": "probed",
    "transform-probed-other-input": "probed (the shared gradient is the exact gradient of another input)",
    "transform-no-linear-stem": "not measured (the model does not start with Normalize/Flatten -> Linear)",
    "transform-first-layer-perturbed": "probed: not measurable (the first layer's gradient is perturbed)",
    "defense-not-differentiable": lambda params: f"not differentiable: {word(params.get('why'))}",
    "defense-detached": "its output is detached from the inputs",
    "defense-differentiation-failed": "differentiating through it failed ({error})",
    "defense-piecewise-constant": "its output is piecewise constant in the inputs (zero gradient)",
    "defense-gradient-not-finite": "differentiating through it gives NaN/inf",
    "defense-global-randomness": "output differs for the same generator seed: the defense draws from global "
                                 "randomness (pass generator= through for reproducible audits)",
    "defense-round-probe-failed": "the defense failed in {calls} round-probe call(s), e.g. {example}",
    "defense-declared-deterministic-varies": "declared deterministic but its output varies between generators",
    # the attacks' own applies(traits)
    "bayes-exact-likelihood": "the defense declares log_prob(shared | clean): its exact likelihood is the objective",
    "bayes-architectural": "architectural defense: p(g | x) depends on the changed model, not a gradient "
                           "perturbation",
    "bayes-deterministic": "deterministic defense: p(g | x) is a point mass, the Bayes adversary reduces to matching "
                           "through the defense",
    "bayes-not-differentiable": "the Monte Carlo likelihood needs gradients through the defense, which passes none "
                                "back",
    "bayes-monte-carlo": "stochastic, differentiable defense: Monte Carlo estimate of log p(g | x) over its randomness",
    "inverter-no-perturbation": "no perturbation: gradient matching / analytic inversion recover more than a learned "
                                "map",
    "inverter-learns": _inverter,
    # the engine's own
    "attack-base": "base attack: always run",
    "attack-classic": lambda params: f"the model's classic attack: {word(params.get('why'))}",
    "attack-requested": "requested by the user",
    "attack-base-form": "base form of {of}",
    "classic-smooth-activations": "every activation is smooth ({activations}): DLG's L2 matching with L-BFGS "
                                  "converges on such networks (its own LeNet) where cosine matching stalls",
}
add_templates(_TEMPLATES)
