"""The report's words for the reasons attacks and the engine store as codes
(:class:`~audit.core.reasons.Reason`): one template per code in :data:`REASONS`.

A template is a ``str.format`` string over the reason's values (a list is joined with commas),
or a function of the values for a reason that holds other reasons. A new code is one
``REASONS.add(code, template, description)``; a code without a template (a third-party
attack's) is written as its code and values, and a sentence stored before codes existed
(code ``text``) as it was written.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Union

from audit.core.reasons import TEXT, Reason
from audit.core.registry import Registry

Template = Union[str, Callable[[Dict[str, Any]], str]]
REASONS = Registry("reason")


def word(reason: Any) -> str:
    """The sentence of ``reason`` (a :class:`Reason`, its JSON object, or a stored sentence)."""
    reason = Reason.of(reason)
    if reason.code not in REASONS:
        return str(reason)
    template: Template = REASONS.get(reason.code)
    if callable(template):
        return template(reason.params)
    values = {k: ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else v for k, v in reason.params.items()}
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError):  # values stored by another version: the code and its values
        return str(reason)


def _portfolio(params: Dict[str, Any]) -> str:
    skipped = params.get("strategies") or {}
    return "no portfolio strategy applies: " + ("; ".join(f"{n}: {word(r)}" for n, r in skipped.items()) or "none")


def _log_prob(params: Dict[str, Any]) -> str:
    who = "no defense" if params.get("defense") is None else f"defense {params['defense']!r}"
    return (f"objective 'defense' needs the defense's log_prob(shared, clean); {who} has none. Use "
            "gaussian(sigma=...), laplacian(b=...) or l2")


def _unused(params: Dict[str, Any]) -> str:
    return f"not used: {word(params.get('why'))}"


def _features_read(params: Dict[str, Any]) -> str:
    if params.get("reading") == "fixed-point":
        return ("used: each image's last-layer features, read off the output layer's gradient; the upload's once, "
                "with the softmax recovered from it (fixed point), the dummy's with its own")
    because = f" ({word(params['because'])})" if params.get("because") else ""
    return f"used: each image's last-layer features, read off the output layer's gradient with the dummy's softmax{because}"


def _bn_upload_used(params: Dict[str, Any]) -> str:
    text = (f"used (weight {params.get('weight'):g}): {word(Reason('buffers-reveal', **params))}, from the "
            "uploaded buffers")
    if params.get("replaces"):
        text += f" (replaces the running-statistics prior {', '.join(params['replaces'])})"
    if params.get("every_attack"):
        text += "; added by every optimisation attack (ig, gi, portfolio, the adaptive attacks built on them)"
    return text


_TEMPLATES: Dict[str, Template] = {
    TEXT: lambda params: str(params.get("text", "")),
    # analytic inversion
    "analytic-fc-inside-module": "the fully connected layers are inside {module} ({name!r}), whose forward is not a "
                                 "plain sequence of layers: what comes before them is unknown (analytic inversion "
                                 "needs nn.Sequential layers up to the first fully connected one)",
    "analytic-no-fc-bias": "the model has no fully connected layer with a bias",
    "analytic-features-not-image": "analytic inversion recovers the input of the first fully connected layer with a "
                                   "bias ({layer!r}, {features} features), but layer {before!r} ({before_type}) "
                                   "comes before it: those are features, not the image (use invert_linear_input "
                                   "for them, or an optimisation attack for the image)",
    "analytic-one-image": "analytic inversion is exact for one image; the batch has {batch}",
    "bias-frozen": "the bias of {layer!r} is frozen, its gradient is not shared",
    "analytic-zero-bias-gradient": "the bias gradient of {layer!r} is zero: nothing to divide by",
    # SPEAR
    "spear-fc-inside-module": "its fully connected layers are inside a module whose forward is not a plain sequence "
                              "of layers: SPEAR needs an nn.Sequential with a biased Linear followed by ReLU",
    "spear-no-relu-linear": "the model has no biased Linear layer followed by ReLU (SPEAR needs one, e.g. the 'mlp' "
                            "or 'cnn')",
    "spear-layer-frozen": "the weight or bias of {layer!r} is frozen: its gradient is not in the upload",
    "spear-local-steps": "the upload is an update after {steps} local step(s) of {optimizer}: the features entering "
                         "{layer!r} change with the convolutions at every step, so its update is not of rank <= the "
                         "batch size (SPEAR applies to FedAvg only where the layer's input is the image)",
    "spear-batch-exceeds-outputs": "the batch of {batch} exceeds the {outputs} outputs of {layer!r}: its gradient's "
                                   "rank cannot separate the images",
    "spear-too-few-rows": "only {rows} rows of {layer!r}'s gradient are non-zero, fewer than the batch of {batch}",
    "spear-too-few-directions": "spear found fewer than {batch} independent directions for the inputs of {layer!r}, "
                                "features behind convolutions, not the images",
    "spear-features-not-image": "spear recovers the inputs of {layer!r} ({features} features per image), not the "
                                "images: convolutions come before it; trace['features'] holds them for the "
                                "optimisation attacks",
    # conv-span
    "conv-span-no-conv": "the model has no trainable nn.Conv2d: the conv-span attack reads convolutions' weight "
                         "gradients",
    "conv-span-no-rank": "no convolution meets the rank condition: each has at least as many output positions as "
                         "output channels or patch entries (the closest, {layer!r}: {positions} positions, "
                         "{channels} channels, patches of {patch}); a wider or deeper model has them",
    "conv-span-batch": "a batch of {batch} over {steps} local step(s) gives {patches} patches to {layer!r}, the "
                       "convolution with the most room, which spans at most {spans}: the span holds up to a batch of "
                       "{largest} at this step count",
    "conv-span-nonlinear-steps": "the upload is an update after {steps} local steps of {optimizer}: its per-entry "
                                 "scaling or weight decay mixes the weights into every convolution's update, so its "
                                 "row space is no longer the union of the steps' patch spans",
    "conv-span-minibatch-steps": "the client took {steps} local steps on mini-batches of {local} of its {batch} images: "
                                 "the images outside the first mini-batch enter the update only at later weights, "
                                 "which the attacker does not have",
    "conv-span-layers-no-rank": "none of the layers {layers} meets the rank condition",
    "conv-span-no-gap": "no convolution's uploaded gradient has the rank the span needs ({checked} checked, smallest "
                        "spectral gap {gap:.2g} > {limit:g}): the upload is perturbed in every layer the attack reads",
    # adaptive attacks
    "precode-no-bottleneck": "the defense declares no latent bottleneck in the model (Defense.latent_bottlenecks, "
                             "see audit.core.types.LatentBottleneck)",
    "precode-batch": "the decoder gradient of a batch of {batch} mixes their draws; the closed-form latent needs "
                     "batch 1",
    "precode-white-box-one-step": "needs a single-step observation with the PRECODE defense known (white-box)",
    "mask-no-zeros": "the observed gradient has no exact zeros: there is no mask to replay",
    "drop-no-layer-changed": "the defense changes no layer's gradient on this model: nothing to drop",
    "drop-every-layer-changed": "the defense changes every layer: dropping them leaves nothing to match",
    "needs-white-box-defense": "needs white-box access to the defense (observation.defense is None)",
    "defense-gradient-one-step": "defense {defense!r} computes its own gradient, which can be replayed for one local "
                                 "step only; the observation has {steps}",
    "svd-nothing-truncated": "no layer of the observed gradient has a lower rank than a clean gradient of this batch "
                             "size: nothing was truncated",
    "bayes-monte-carlo-needs-defense": "bayes-optimal: the Monte Carlo likelihood samples the defense's randomness; "
                                       "the observation has no defense (use likelihood='l2')",
    # the optimisation attack's parts
    "portfolio-none-applies": _portfolio,
    "portfolio-bn-upload-instead": "the uploaded buffers reveal the batch's own BatchNorm statistics, which every "
                                   "strategy matches (bn-upload): the running statistics would only guess at them",
    "simulator-needs-defense": "the 'defense' simulator needs observation.defense (white-box access to the "
                               "mechanism); use the default 'clean' simulator",
    "simulator-one-step": "the 'defense' simulator runs one defended gradient; the observation has {steps} local "
                          "steps of {optimizer}",
    "prior-needs-running-statistics": "prior {prior!r} needs BatchNorm layers with running statistics; the "
                                      "observation's model has none (set its weight to 0)",
    "objective-needs-log-prob": _log_prob,
    "labels-head-frozen": "label inference needs the gradient of the last linear layer {layer!r}, which is frozen in "
                          "this model",
    "idlg-one-image": "idlg infers the label of a single image; the batch has {batch} (use the 'counts' method)",
    "counts-no-positive-rows": "counts label inference: no positive last-layer weight-row sums to calibrate the "
                               "feature scale (features are not non-negative?)",
    "labels-not-shared": "label strategy 'shared' needs an observation with shared labels; use 'infer'",
    "bn-upload-needs-buffers": "the bn-upload term needs the client's uploaded BatchNorm buffers (shares: state) and "
                               "BatchNorm layers in train mode",
    "features-needs-linear-head": "the features term needs a model whose last layer is a linear layer with a bias",
    "features-head-frozen": "the features term needs the output layer's gradient (its parameters are frozen)",
    "features-needs-run": "the features term needs the dummy's gradient and the output layer (set by the run)",
    "features-labels-optimised": "the labels are optimised with the images (it reads one image per label)",
    "features-upload-zeroed": "the observed output layer's gradient has zeroed entries (pruned or masked)",
    "features-gradient-transformed": "the attack transforms the dummy's gradient ({simulator})",
    "features-objective-differs": "the attack's objective ({objective}) models noise or masks or reweights layers",
    "features-read-differs": lambda p: f"{word(p.get('why'))}; the reading would differ between the dummy and the upload",
    "softmax-misfit": "the upload's own softmax does not fit it: residual {residual:.1e} > {tolerance:g}",
    "features-classes-crowded": "a batch of {batch} covers more than {share:.0%} of the {classes} classes, too few "
                                "absent classes for a sharp reading with the dummy's softmax",
    "features-misread": lambda p: f"{word(p.get('why'))}, and {word(p.get('off'))}",
    "features-read": _features_read,
    "run-length": "the weights from the observation moved {share:.0%} of the way to their {long}-iteration values "
                  "for a run of {iterations} iterations (attacks.budget_rule)",
    # the uploaded buffers
    "no-running-statistics": "the model has no BatchNorm layer with running statistics",
    "buffers-not-shared": "the client does not share its buffers (shares: gradient or update)",
    "buffers-eval-mode": "the client trains in eval mode: its BatchNorm buffers do not change",
    "buffers-missing": "the upload lacks {layer}.running_mean / running_var",
    "buffers-zero-momentum": "BatchNorm layer {layer!r} has momentum 0: its buffers never change",
    "buffers-global": "the uploaded buffers equal the global model's: they carry no batch statistics",
    "buffers-not-revealing": "the defense declares the uploaded buffers {effect} (buffer_effect): their statistics "
                             "are not used",
    "buffers-reveal": lambda p: ("the private batch's BatchNorm input statistics of {} layer(s), {}".format(
        p.get("layers"), "exact" if p.get("steps") == 1 else f"the momentum-weighted mixture of {p.get('steps')} "
                                                             "local steps")),
    # the plan's side information
    "bn-upload-used": _bn_upload_used,
    "bn-upload-off": "not used: switched off (bn_upload=0)",
    "bn-upload-unused": _unused,
    "side-unused": _unused,
    "first-observation-failed": "the defense failed on the first observation: {error}",
    # how an attack ran a group of observations (a trace's "grouped")
    "grouped": "one batched run over {members} observations of the same model ({seconds:.2f} s)",
    "grouped-portfolio": "one batched run over {members} observations per strategy, and per continued strategy "
                         "over the observations that chose it",
    "not-grouped": lambda p: f"no: {word(p.get('why'))}",
    "single-observation": "a single observation",
    "observations-differ": "observations differ in {field}",
    "observations-different-models": "observations come from different models (parameters or buffers differ)",
    "group-too-small": "max_members={max_members} fits one observation of {restarts} restarts",
    "one-after-another": "one member after another, {execution}",
    "own-reconstruct": "the attack reconstructs in its own way",
    "no-grouped-path": "{attack} has no grouped path (reconstruct_many)",
    "grouped-run-failed": "the grouped run failed ({error}); one at a time",
    "adaptation-skips": "it does not apply to some observations",
    "adaptation-per-observation": "the adaptation holds tensors of each observation",
    # why a run failed to optimise (a trace's "failure")
    "stalled": lambda p: (f"attack failed to optimise: the loss of the chosen restart never went below its first "
                          f"value in {p.get('iterations')} iterations ({p.get('recoveries')} recoveries tried)"
                          + ("; its loss is flat in the image (no step moved it: a zero or vanishing gradient): no "
                             "unit the image reaches is alive, or the softmax saturates, so the model gives the "
                             "attack nothing to follow from this start" if p.get("flat") else "")),
    "no-iteration": "attack failed to optimise: no iteration ran (budget 0)",
    "portfolio-stalled": "attack failed to optimise: no portfolio strategy decreased its loss",
    "spear-too-few-samples": "spear kept {kept} directions in {samples} samples, fewer than {batch} independent ones: "
                             "raise samples= (the cost grows about 2^batch)",
    "silent-upload": "the upload is zero in float32: nothing to match, so the loss cannot fall; the reconstruction "
                     "is the attack's start and priors alone, scored as such (the upload reveals nothing more)",
    # an attack's notes on what it read
    "analytic-read": lambda p: ("x = dW[row] / db[row], row = argmax |db|" + (
        f"; gradients were defended by {p['defense']!r}: exact only if the first layer is untouched"
        if p.get("defense") else "")),
    "spear-certificate": "the recovered batch reproduces the upload to a relative error of {error:.2e} "
                         "(tolerance {tolerance:g})",
    "spear-uncertified": "no selection of directions reproduced the upload within {tolerance:g} in {samples} samples "
                         "(best {error:.2e}): the upload is noisy or more samples are needed",
    "gifd-no-blocks": "the generator exposes no blocks: latent search only",
    "labels-idlg": lambda p: (f"argmin of the last-layer {p.get('source')} gradient ({p.get('negative')} negative "
                              f"entr{'y' if p.get('negative') == 1 else 'ies'})"),
    "labels-counts": "class counts n_c = B (mean p_c - g_c) from the {source}; mean p from 32 random probe images; "
                     "{negative} classes with negative entries",
    "labels-optimize": "soft labels optimised jointly with the images (DLG)",
    "labels-given": "labels given to evaluate()",
}
for _code, _template in _TEMPLATES.items():
    REASONS.add(_code, _template, _code)
