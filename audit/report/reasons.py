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


def add_templates(templates: Dict[str, Template]) -> None:
    """Register each code's template (its description is the code)."""
    for code, template in templates.items():
        REASONS.add(code, template, code)


def is_reason(value: Any) -> bool:
    """Whether ``value`` is a reason's JSON object (``{"code", "params"}``)."""
    return isinstance(value, dict) and "code" in value and set(value) <= {"code", "params"}


def trace_words(trace: Any, prefix: str = "") -> Dict[str, str]:
    """The sentences of the reasons an attack's trace holds, by key (a nested one as
    ``labels.note``): what the trace says in words, for a reader of ``metrics.json``."""
    out: Dict[str, str] = {}
    for key, value in dict(trace or {}).items():
        if isinstance(value, Reason) or is_reason(value):
            out[prefix + str(key)] = word(value)
        elif isinstance(value, dict):
            out.update(trace_words(value, f"{prefix}{key}."))
    return out


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


def _words(items: Any) -> str:
    return "; ".join(word(r) for r in (items or []))


def _run_batched(params: Dict[str, Any]) -> str:
    n = params.get("observations") or 1
    over = f"{n} observations x {params.get('restarts')} restarts" if n > 1 else f"{params.get('restarts')} restarts"
    return f"batched (vmap over {over})"


def _not_vmappable(params: Dict[str, Any]) -> str:
    why = f"; {word(params['why'])}" if params.get("why") else ""
    return f"{params.get('simulator')} is not vmappable{why}"


def _compile_unused(params: Dict[str, Any]) -> str:
    route = word(params.get("route"))
    return f"{route[:-1] if route.endswith(')') else route}; compile=true not used: {word(params.get('why'))})"


def _capture_off(params: Dict[str, Any]) -> str:
    replayed = params.get("replayed") or 0
    return f"off: {_words(params.get('why'))}" + (f"; {replayed} iteration(s) replayed before" if replayed else "")


def _captured(p: Dict[str, Any]) -> str:
    kept = (f"built here (set up in {p.get('setup_s', 0):.2f} s)" if p.get("built") else "reused from an earlier run")
    return (f"{p.get('route')}: {_words(p.get('why'))}; the whole iteration as one program over {p.get('members')} "
            f"member(s) (padded to {p.get('padded')}), {p.get('replays')} iteration(s) replayed, {p.get('warm')} run "
            f"to warm up; programs: {p.get('built')} built, {p.get('reused')} reused; program {kept}")


def _aux_data(p: Dict[str, Any]) -> str:
    text = (f"declared auxiliary images ({p.get('images')})" if p.get("origin") == "declared" else
            f"{p.get('origin')} {p.get('split')} split ({p.get('size')})")
    if p.get("limit") is not None:
        text += f", a random {p['limit']}"
    return text + (", labels predicted by the audited model" if p.get("labels") == "predicted" else "")


def _member_iterations(p: Dict[str, Any]) -> str:
    return f"{p.get('count')} member-iterations {'>=' if p.get('above') else '<'} {p.get('minimum')}"


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
    "one-after-another": lambda p: f"one member after another, {word(p.get('execution'))}",
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
    "labels-inferred": "inferred from the shared gradient",
    "labels-shared": "labels shared by the protocol",
    "generator-unconditional": "unconditional generator",
    "generator-conditioned": "conditioned on the attack's labels (generator classes = model classes)",
    "generator-random-classes": "random generator classes {classes} (generator classes != model classes)",
    "labels-predicted": "model prediction on the reconstruction",
    # how an optimisation ran (a trace's "execution")
    "run-compiled": "compiled (torch.compile of the functional loss and gradient over {members} member(s))",
    "run-sequential": lambda p: f"sequential ({word(p.get('why'))})",
    "run-stacked": "stacked (one call of the defense over {members} member(s) per evaluation: {simulator} is not "
                   "vmappable)",
    "run-single": "single restart (eager autograd, no vmap overhead)",
    "run-batched": _run_batched,
    "run-batched-candidates": "batched (vmap over candidates)",
    "run-compile-failed": "batched (torch.compile failed: {error})",
    "compile-unused": _compile_unused,
    "requested": "requested",
    "path-failed": "{path} failed: {error}",
    "not-vmappable": _not_vmappable,
    "not-functional": "{simulator} is not functional",
    "no-stacked-call": "{simulator} has no stacked call (many_members)",
    "transforms-each-member": "the simulator transforms each member's defended gradient",
    "draws-from-generator": "the defense's transform draws from a generator (no Defense.vmap_draws): its draws run "
                            "member by member",
    "labels-optimised": "the labels are optimised with the images",
    "prior-needs-own-bn": "a prior needs the BatchNorm statistics of each member's own forward pass",
    "sequential-requested": "execution='sequential' was requested",
    "group-mean-changes": "the group-consistency prior changes with the {per}",
    # whether the iteration ran as one captured program (a trace's "capture")
    "capture-off": _capture_off,
    "captured": _captured,
    "capture-setting": "capture={setting!r}",
    "capture-on-cpu": "capture='on' on a CPU: torch.compile of the iteration",
    "capture-cuda-only": "capture='auto' captures on CUDA only (on a {device} the eager batched loop has no launch "
                         "overhead to remove)",
    "capture-too-few": "{iterations} iteration(s) < {minimum}, too few to repay a capture",
    "route-needs-cuda": "route {route!r} needs a CUDA device, the run is on {device}",
    "compile-requested": "compile=true",
    "member-iterations": _member_iterations,
    "box-not-capturable": "box {box!r} is not known to project with pure tensor operations",
    "optimizer-not-capture-safe": "optimizer {optimizer!r} declares no capture-safe update",
    "lbfgs-host-search": "the lbfgs line search accepts or halves each step on the host",
    "route-failed": "{route} failed: {error}",
    "route-instead": "{route} instead",
    # how a result was picked and counted
    "lowest-final-loss": "lowest final attack loss (objective + weighted priors); ground truth unused",
    "lowest-attack-loss": "lowest attack loss (objective + priors); ground truth unused",
    "lowest-matching-loss": "lowest final matching loss (the attack's own objective)",
    "keep-best-after": "lowest attack loss at keep_best_after x the budget; the rest of the budget goes to it",
    "portfolio-pick": "lowest cosine gradient-matching loss, most regularised first, a later candidate wins only below "
                      "{ratio:g} x the pick's; the pick gets the rest of the budget (from its candidate, or its whole "
                      "schedule afresh); ground truth unused",
    "unit-optimisation": "gradient evaluations (restarts x draws x local steps per loss evaluation, incl. one final "
                         "evaluation to pick the restart)",
    "restarts-afforded": "{fits} of {restarts} restarts: the budget of {budget} gradient evaluations affords {fits} "
                         "restart(s) of the ~{per} each needs (per_restart={per_restart!r})",
    "unrolled-exactly": "unrolled exactly: {optimizer}",
    # the adaptive attacks' choices
    "likelihood-monte-carlo": "monte-carlo kernel estimate over {draws} draws of defense {defense!r}",
    "likelihood-exact": "exact: {defense}.log_prob",
    "likelihood-given": "given: {objective}",
    "beta-given": "given",
    "beta-no-prior": "no prior",
    "beta-no-likelihood": "prior_weight {weight:g} (the objective is no likelihood)",
    "beta-fisher": "prior_weight {weight:g} x Fisher information {information:.3g} / 2",
    "aux-data": _aux_data,
    "pairs-per-batch": "per batch (client round)",
    "pairs-vmap": "batched clean gradients (vmap), per-batch transform",
    "pairs-per-batch-unbatchable": "per batch (client round; vmap could not batch this model's gradient)",
    "pairs-defense-many": "batched defense calls (Defense.many), one per chunk of batches",
    "unrolled-smoothed": "unrolled with eps raised to {eps:g} x each tensor's gradient RMS: {optimizer} (the exact "
                         "rule's near-sign update is a step function of the image)",
}
add_templates(_TEMPLATES)
