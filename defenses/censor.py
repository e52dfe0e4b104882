"""CENSOR (NDSS 2025): orthogonal-subspace sampling with loss-based selection.

Each of ``trials`` candidates draws a Gaussian direction per layer (or for the whole
model), removes its component in the span of the clean gradient (for a batch: the span of
the batch gradient and the per-example gradients), rescales it to the clean norm, and
the candidate whose step ``theta - eta * G_t`` gives the lowest loss on the private batch
(in eval mode) is shared. Unlike the public code, the raw gradient is never sent: the
lowest-loss candidate is kept even when no candidate lowers the loss.

``active_rounds=N`` follows the paper's schedule (CENSOR "only in the first epochs"): rounds
``0 .. N-1`` are defended and later rounds share the clean gradient. The round comes from the
client simulation (``round=`` keyword); a call without one counts as an early round.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from audit.core.types import Defense, clean_gradients, default_loss_fn, trainable_names

from defenses.common import (
    check_range, eval_mode, flatten, per_example_gradients, randn, resolve_generator,
)
from defenses.registry import DEFENSES


def orthonormal_basis(vectors: Tensor) -> Tensor:
    """Orthonormal columns spanning the rows of ``vectors`` (``(k, n)`` -> ``(n, k)``), float64."""
    if vectors.shape[0] == 1:
        v = vectors[0].double()
        return (v / v.norm()).unsqueeze(1)
    q, _ = torch.linalg.qr(vectors.double().T, mode="reduced")
    return q


def orthogonal_candidates(directions: Tensor, basis: Tensor, target_norm: Tensor) -> Tensor:
    """Project ``directions`` ``(T, n)`` onto the complement of ``basis`` (twice, for exact
    orthogonality in floating point) and rescale each row to ``target_norm``."""
    out = directions.double()
    for _ in range(2):
        out = out - (out @ basis) @ basis.T
    out = out * (target_norm.double() / out.norm(dim=1, keepdim=True))
    return out


@DEFENSES.register("censor", "Orthogonal-subspace sampling: best of `trials` (20) random orthogonal updates, eta=1e-4")
class Censor(Defense):
    """Shares a random update orthogonal to the clean gradient with the same norm per layer
    (``layerwise=true``, the paper's default) or for the whole model."""

    name = "censor"
    stochastic = True
    differences = (
        "The raw gradient is never shared: the lowest-loss candidate is sent even when none lowers "
        "the loss (the authors' code then falls back to the clean gradient).",
        "Defends every round unless active_rounds is set; the paper applies CENSOR only in the first "
        "epochs (active_rounds=N defends rounds 0..N-1, later rounds share the clean gradient).",
        "Evaluated here in plain FedSGD on small models, where exactly orthogonal updates train close "
        "to chance; the paper reports FedAvg utility on ResNet-18.",
        "For a batch, the span of the per-example gradients is projected out (the paper's text); the "
        "public code projects out only the batch gradient.",
    )

    def __init__(self, trials: int = 20, eta: float = 1e-4, layerwise: bool = True, chunk: int = 10,
                 active_rounds: Optional[int] = None):
        self.trials = check_range(self.name, "trials", trials, 1, None, integer=True)
        self.eta = check_range(self.name, "eta", eta, 0, None, low_open=True)
        self.layerwise = bool(layerwise)
        self.chunk = check_range(self.name, "chunk", chunk, 1, None, integer=True)
        self.active_rounds = None if active_rounds is None else check_range(
            self.name, "active_rounds", active_rounds, 1, None, integer=True)

    def active(self, round: Optional[int]) -> bool:
        """Whether CENSOR defends ``round`` (None: unknown, treated as an early round)."""
        return self.active_rounds is None or round is None or int(round) < self.active_rounds

    # ------------------------------------------------------------------ sampling
    def _spans(self, model, inputs, labels, loss_fn, grads) -> List[List[Tensor]]:
        """Per parameter: the vectors to project out (batch gradient, then per-example ones)."""
        spans = [[g] for g in grads]
        if inputs.shape[0] > 1:
            # batch gradient + all but one per-example gradient span the per-example span
            # whenever the batch gradient is their mean, and keep a full-rank basis
            for example in per_example_gradients(model, inputs[:-1], labels[:-1], loss_fn):
                for span, g in zip(spans, example):
                    span.append(g)
        return spans

    def candidates(self, grads: Sequence[Tensor], spans: List[List[Tensor]], generator) -> List[Tensor]:
        """``trials`` orthogonal candidates, one ``(T, *shape)`` tensor per parameter."""
        gen = resolve_generator(generator, grads[0].device)
        groups = [list(range(len(grads)))] if not self.layerwise else [[i] for i in range(len(grads))]
        out: List[Tensor] = [None] * len(grads)  # type: ignore[list-item]
        for group in groups:
            clean = flatten([grads[i] for i in group])
            n = clean.numel()
            draws = randn((self.trials, n), generator=gen, device=clean.device, dtype=clean.dtype)
            norm = clean.norm()
            if float(norm.detach()) == 0.0:  # nothing to hide; zero keeps the norm and orthogonality
                cand = torch.zeros_like(draws)
            else:
                span = torch.stack([flatten([spans[i][k] for i in group]) for k in range(len(spans[group[0]]))])
                cand = orthogonal_candidates(draws, orthonormal_basis(span), norm).to(clean.dtype)
            start = 0
            for i in group:
                size = grads[i].numel()
                out[i] = cand[:, start:start + size].reshape(self.trials, *grads[i].shape)
                start += size
        return out

    # ------------------------------------------------------------------ selection
    def candidate_losses(self, model: nn.Module, inputs, labels, loss_fn, cands: List[Tensor]) -> Tensor:
        """Loss of ``theta - eta * G_t`` for every candidate (eval mode, float64, no grad)."""
        names = trainable_names(model)
        params = {n: p.detach().double() for n, p in model.named_parameters()}
        buffers = {n: b.detach().double() if b.is_floating_point() else b for n, b in model.named_buffers()}
        x = inputs.detach().double()
        steps = {n: c.detach().double() for n, c in zip(names, cands)}

        def loss_of(step: Dict[str, Tensor]) -> Tensor:
            moved = dict(params)
            for n, s in step.items():
                moved[n] = params[n] - self.eta * s
            return loss_fn(functional_call(model, (moved, buffers), (x,)), labels)

        with torch.no_grad(), eval_mode(model):
            return vmap(loss_of, chunk_size=self.chunk)(steps)

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None, round=None):
        grads = clean_gradients(model, inputs, labels, loss_fn)
        if not self.active(round):
            return grads
        spans = self._spans(model, inputs, labels, loss_fn, grads)
        cands = self.candidates(grads, spans, generator)
        best = int(torch.argmin(self.candidate_losses(model, inputs, labels, loss_fn, cands)))
        return [c[best] for c in cands]
