"""Stacked execution: every member of a run (observations x restarts) through ONE call of a
simulator that cannot run under ``torch.func.vmap``.

A defense that computes its own gradient with ``torch.autograd`` (CENSOR, Soteria, PRECODE,
Refiner, DP-SGD, a user's callable) cannot be vmapped, so matching through it used to run one
member after another, one defense call each. Its batched entry point ``Defense.many`` takes
every member's dummy batch at once (``(M, B, C, H, W)``) and returns their defended
gradients stacked, differentiable w.r.t. the dummies; the objective and priors are then
evaluated per member (no model call) and one backward pass gives every member's image
gradient. How few model calls that costs is the defense's own ``many``: CENSOR and Refiner
batch theirs; the default runs the calls one after another.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from audit.core.reasons import Reason
from priors import PriorContext, requiring

Run = Any  # an attacks.optimization.OptimizationRun (not imported: it imports this module)


def unstackable(run: Run) -> Optional[Reason]:
    """Why the run's members cannot go through one simulator call (None when they can)."""
    simulator = run.simulator
    if not callable(getattr(simulator, "many_members", None)):
        return Reason("no-stacked-call", simulator=simulator.describe())
    why = simulator.cannot_stack(run.obs) if callable(getattr(simulator, "cannot_stack", None)) else None
    if why:
        return Reason.of(why)
    if run.labels.shape is not None:
        return Reason("labels-optimised")
    if requiring(run.priors, "bn_stats") or requiring(run.priors, "bn_steps"):
        return Reason("prior-needs-own-bn")
    if run.attack.execution == "sequential":
        return Reason("sequential-requested")
    return None


def evaluate(run: Run, variables: List[Tensor]) -> Tuple[Tensor, Dict[str, Tensor], List[Tensor]]:
    """Per-member loss ``(M,)``, terms and the gradient w.r.t. the members' variables."""
    z = variables[0].detach().requires_grad_(True)
    members = z.shape[0]
    owner = [m // run.restarts if run.n > 1 else 0 for m in range(members)]
    group_mean = run._group_mean(variables[0])
    with torch.enable_grad():
        images = run.box.image(z)
        labels = torch.stack([run.plans[n].fixed for n in owner])
        stacked, features = run.simulator.many_members(run.replica, images, labels, run.sim_ctx)
        losses, rows = [], []
        for m, n in enumerate(owner):
            grads = [g[m] for g in stacked]
            terms = {"match": run.objective(grads, run.targets[n][:run.layers])}
            member = {**{k: v[m] for k, v in features.items()}, **run.gradient_features(grads, run.targets[n], labels[m])}
            ctx = PriorContext(run.sim_ctx, member, run.replica.bn_running,
                               None if group_mean is None else group_mean[n], run.obs, revealed=run.revealed(run.targets[n]))
            for key, prior, _ in run.priors:
                terms[key] = prior(images[m], ctx)
            losses.append(run.total(terms))
            rows.append(terms)
        loss = torch.stack(losses)
        (grad,) = torch.autograd.grad(loss.sum(), [z])
    terms = {k: torch.stack([torch.as_tensor(r[k]).detach() for r in rows]) for k in rows[0]}
    return loss.detach(), terms, [grad.detach()]
