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
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from attacks.simulator import GradientSimulator, SimContext
from audit.core.reasons import Reason
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
    ``D'^-1 P D' G'`` with ``D'`` from the dummy and ``P`` the orthogonal projector onto
    ``D' U`` -- exactly the defense's output when the dummy equals the private data.

    The bases are read from each observation (:meth:`observed`: ``U`` and ``V`` of every
    projected layer at its observed rank, zero-padded to the layer's full rank so that every
    observation's bases have one shape), so a step's images run as one group.
    """

    vmappable = True

    def __init__(self, layers: Sequence[int], weighting: Optional[str] = None):
        self.layers, self.weighting = tuple(int(i) for i in layers), weighting
        self.observed_slots = tuple(f"{kind}{i}" for i in self.layers for kind in ("U", "V"))
        self.__name__ = f"subspace-projection(tensors {list(self.layers)}, {weighting or 'orthogonal'})"

    def observed(self, observation: Observation) -> List[Tensor]:
        """``U``, ``V`` per projected layer of ``observation``'s own gradient, zero-padded."""
        out = []
        for i in self.layers:
            m = matrix_view(observation.gradients[i])
            u, v = subspace(m, numerical_rank(m))
            full = min(m.shape)
            out += [torch.nn.functional.pad(u, (0, full - u.shape[1])),
                    torch.nn.functional.pad(v, (0, full - v.shape[1]))]
        return out

    def project(self, m: Tensor, u: Tensor, v: Tensor) -> Tensor:
        if self.weighting is None:
            return u @ (u.T @ m @ v) @ v.T
        # the projector onto span(D U) as A (A^T A)^-1 A^T, A = D U, in float64; the padding's
        # zero columns get a unit diagonal so the Gram matrix stays invertible and they add nothing
        # (a QR of the padded A would have a singular R, and no gradient through it)
        d = row_weights(m, self.weighting)
        a = (d[:, None] * u).double()
        padding = (u.abs().sum(0) == 0).double()
        coef = torch.linalg.solve(a.T @ a + torch.diag(padding), a.T @ (d[:, None] * m).double())
        return ((a @ coef) / d[:, None].double()).to(m.dtype)

    def __call__(self, grads: List[Tensor], context: SimContext) -> List[Tensor]:
        out = list(grads)
        bases = context.observed
        for k, i in enumerate(self.layers):
            out[i] = self.project(matrix_view(grads[i]), bases[2 * k], bases[2 * k + 1]).reshape(grads[i].shape)
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
            return Adaptation(skip=Reason("svd-nothing-truncated"))
        names = trainable_names(observation.model)
        declared = getattr(observation.defense, "channel_weights", None)
        weighting = declared() if callable(declared) else None
        weighting = weighting if weighting in ("sqrt", "square") else None
        notes = {"projected": {n: {"observed_rank": r[0], "clean_rank": r[1]}
                               for n, r in zip(names, ranks) if r is not None},
                 "projection": f"oblique, {weighting} channel weights (declared by the defense)" if weighting
                 else "orthogonal on the observed row and column spaces"}
        layers = [i for i, r in enumerate(ranks) if r is not None]
        return Adaptation({"simulator": GradientSimulator([SubspaceProjection(layers, weighting)])}, notes)


register(SVDSubspace, "SVDefense: match the dummy gradient projected on the transmitted low-rank subspaces")
