"""Matching only the transmitted subspace of a rank-truncated gradient (SVDefense).

A low-rank defense shares, per weight matrix ``G`` (rows = output channels), a rank-``k``
approximation. Its column space ``U`` and row space ``V`` are read from the observed
gradient itself (its SVD), and the dummy gradient is projected onto them,
``P_U G' P_V``, before matching: the energy the defense discarded is not asked of the
dummy. Only layers whose observed rank is below the rank a clean gradient of the same
batch size has are projected (a batch-1 linear-layer gradient is rank 1 already and is
left intact, which is also why analytic first-layer inversion survives truncation).
When the defense declares a channel weighting (``defense.channel_weights()``, as SVDefense does) the
projection is the defense's own oblique one (see :class:`SubspaceProjection`).
"""
from __future__ import annotations

import copy
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from attacks.simulator import GradientSimulator, SimContext
from audit.core.types import Observation, clean_gradients, trainable_names

from adaptive.adapted import Adaptation, AdaptedAttack, register
from adaptive.planner.probe import random_batch

RANK_RTOL = 1e-5  # truncation zeros sit below this fraction of the largest singular value ...
CLIFF = 1e-3  # ... and below this fraction of the previous one (natural spectra decay smoothly)


def matrix_view(g: Tensor) -> Tensor:
    return g.reshape(g.shape[0], -1)


def numerical_rank(m: Tensor) -> int:
    """The number of singular values before the first truncation cliff (all, if none)."""
    s = torch.linalg.svdvals(m.detach().double())
    if not s.numel() or s[0] <= 0:
        return 0
    for i in range(1, s.numel()):
        if s[i] < RANK_RTOL * s[0] and s[i] < CLIFF * s[i - 1]:
            return i
    return int(s.numel())


def subspace(m: Tensor, rank: int) -> Tuple[Tensor, Tensor]:
    """Orthonormal bases ``(U_r, V_r)`` of the column and row spaces of ``m``."""
    u, _, vh = torch.linalg.svd(m.detach().double(), full_matrices=False)
    return u[:, :rank].to(m.dtype), vh[:rank].T.to(m.dtype)


def row_weights(m: Tensor, weighting: str) -> Tensor:
    """SVDefense's channel weights: row norms (``sqrt``) or squared row norms (``square``)."""
    w = m.pow(2).sum(1)
    return w.clamp_min(1e-30).sqrt() if weighting == "sqrt" else w.clamp_min(1e-30)


class SubspaceProjection:
    """Simulator transform onto the observed subspaces of the truncated layers.

    ``weighting=None``: orthogonal ``U U^T G' V V^T`` (any truncated SVD). ``"sqrt"`` /
    ``"square"`` (SVDefense's channel weighting ``D``, known white-box): the oblique
    ``D'^-1 Q Q^T D' G'`` with ``D'`` from the dummy and ``Q`` an orthonormal basis of
    ``D' U`` -- exactly the defense's output when the dummy equals the private data.
    """

    __name__ = "subspace-projection"
    vmappable = True

    def __init__(self, bases: List[Optional[Tuple[Tensor, Tensor]]], weighting: Optional[str] = None):
        self.bases, self.weighting = bases, weighting

    def project(self, m: Tensor, u: Tensor, v: Tensor) -> Tensor:
        if self.weighting is None:
            return u @ (u.T @ m @ v) @ v.T
        d = row_weights(m, self.weighting)
        q, _ = torch.linalg.qr(d[:, None] * u)
        return (q @ (q.T @ (d[:, None] * m))) / d[:, None]

    def __call__(self, grads: List[Tensor], context: SimContext) -> List[Tensor]:
        out = []
        for g, basis in zip(grads, self.bases):
            out.append(g if basis is None else self.project(matrix_view(g), *basis).reshape(g.shape))
        return out


def truncated_layers(observation: Observation, seed: int = 0) -> List[Optional[Tuple[int, int]]]:
    """Per tensor ``(observed rank, clean rank)`` where the observed rank is lower, else None.
    The clean rank is measured on a random batch of the observation's size."""
    x, y = random_batch(observation.batch_size, observation.input_shape, observation.num_classes, seed,
                        observation.device)
    reference = clean_gradients(copy.deepcopy(observation.model), x, y, observation.loss_fn)
    out: List[Optional[Tuple[int, int]]] = []
    for g, ref in zip(observation.gradients, reference):
        if g.dim() < 2:
            out.append(None)
            continue
        m = matrix_view(g)
        live = min(int((m != 0).any(1).sum()), int((m != 0).any(0).sum()))  # dead units lower the rank too
        observed, natural = numerical_rank(m), min(numerical_rank(matrix_view(ref)), live)
        out.append((observed, natural) if 0 < observed < natural else None)
    return out


class SVDSubspace(AdaptedAttack):
    """Project the dummy gradient onto the observed low-rank subspaces, then match."""

    name = "svd-subspace"
    owns = ("simulator",)

    def adapt(self, observation: Observation) -> Adaptation:
        ranks = truncated_layers(observation)
        if all(r is None for r in ranks):
            return Adaptation(skip="no layer of the observed gradient has a lower rank than a clean gradient "
                                   "of this batch size: nothing was truncated")
        bases = [None if r is None else subspace(matrix_view(g), r[0])
                 for g, r in zip(observation.gradients, ranks)]
        names = trainable_names(observation.model)
        declared = getattr(observation.defense, "channel_weights", None)
        weighting = declared() if callable(declared) else None
        weighting = weighting if weighting in ("sqrt", "square") else None
        notes = {"projected": {n: {"observed_rank": r[0], "clean_rank": r[1]}
                               for n, r in zip(names, ranks) if r is not None},
                 "projection": f"oblique, {weighting} channel weights (declared by the defense)" if weighting
                 else "orthogonal on the observed row and column spaces"}
        return Adaptation({"simulator": GradientSimulator([SubspaceProjection(bases, weighting)])}, notes)


register(SVDSubspace, "SVDefense: match the dummy gradient projected on the transmitted low-rank subspaces")
