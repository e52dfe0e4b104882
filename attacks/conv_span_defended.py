"""The span read through a defense: what of a convolution's low-rank weight gradient survives
pruning, SVD truncation and noise, and the test that tells an upload without that structure.

An undefended span layer's gradient ``G`` (``Cout x D``) has rank ``r = B * N`` (less one under
train-mode BatchNorm), ``r`` well below ``min(Cout, D)`` (:mod:`attacks.conv_span_algebra`).

* **Pruning / top-k** keep a subset of ``G``'s entries: ``G`` has about ``r (Cout + D - r)``
  degrees of freedom, so where the kept entries outnumber them the rank completes it
  (:func:`complete_low_rank`, hard impute: the best rank-``r`` matrix that agrees with the kept
  entries). The kept entries are the largest, a biased sample; the completion's agreement on
  them and the completed spectrum's gap say whether it held.
* **SVD truncation** sends ``G``'s top ``k < r`` singular directions: each transmitted row lies
  in the patches' span, so "the transmitted rows are contained in the span of the candidate's
  patches" still constrains the maps (:func:`containment_residual`).
* **Additive noise** is full rank: the top-``r`` right singular subspace of the noisy gradient
  estimates the span (:func:`denoised_basis`), the closer the smaller the noise against ``G``'s
  ``r``-th singular value.
* **No structure** (CENSOR's sampled direction orthogonal to the gradient): the share of the
  upload's energy in its top ``r`` singular values (:func:`top_share`) falls from 1 to about what
  a random matrix of that shape holds; :func:`structure_test` compares it with
  :data:`STRUCTURE_THRESHOLD` (docs/adaptive.md measures both sides).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from attacks.conv_span_algebra import SpanLayer, patches
from audit.core.errors import NotApplicable

#: an upload carries a span layer's low-rank structure where at least this share of its squared
#: norm lies in its top ``r`` singular values (exact and pruned-then-completed uploads: > 0.999;
#: a random matrix of a ResNet-18 span layer's shape: 0.02-0.15; docs/adaptive.md)
STRUCTURE_THRESHOLD = 0.9
#: alternating least-squares iterations of the completion from a random start that checks a completed span
AGREEMENT_ITERATIONS = 200


def matrix(grad: Tensor) -> Tensor:
    """A convolution's weight gradient as ``Cout x (Cin/groups * k * k)`` in float64."""
    return grad.detach().double().reshape(grad.shape[0], -1)


def top_share(grad: Tensor, rank: int) -> float:
    """The share of ``grad``'s squared norm in its top ``rank`` singular values (1.0: rank ``rank``
    at most; an all-zero upload: 0.0)."""
    s = torch.linalg.svdvals(matrix(grad))
    total = float(s.pow(2).sum())
    return 0.0 if total == 0 else float(s[:rank].pow(2).sum()) / total


@dataclass(frozen=True)
class Structure:
    """The structure test on one upload: per span layer the rank the positions give and the share
    of the upload's energy in it; ``present`` where every layer's share reaches ``threshold``."""

    shares: Dict[str, float]
    ranks: Dict[str, int]
    threshold: float

    @property
    def present(self) -> bool:
        return bool(self.shares) and min(self.shares.values()) >= self.threshold

    @property
    def weakest(self) -> Tuple[str, float]:
        name = min(self.shares, key=self.shares.get)
        return name, self.shares[name]


def expected_rank(layer: SpanLayer, batch: int, centred: bool) -> int:
    return batch * layer.positions - (1 if centred else 0)


def structure_test(gradients: Dict[str, Tensor], layers: Sequence[SpanLayer], batch: int, centred: bool,
                   threshold: float = STRUCTURE_THRESHOLD) -> Structure:
    """Whether the upload keeps the low-rank structure the span attack reads, per span layer."""
    ranks = {l.name: expected_rank(l, batch, centred) for l in layers if l.name in gradients}
    shares = {name: top_share(gradients[name], rank) for name, rank in ranks.items()}
    return Structure(shares, ranks, threshold)


def _truncate(x: Tensor, rank: int) -> Tuple[Tensor, Tensor]:
    """``x``'s top ``rank`` singular directions as factors ``(U S, V)``: ``x ~ U S V^T``."""
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return u[:, :rank] * s[:rank], vh[:rank].T


def _solve_rows(mask: Tensor, values: Tensor, other: Tensor, ridge: float) -> Tensor:
    """For each row ``i``: the ``r`` coefficients whose products with ``other``'s rows fit the
    kept entries ``values[i, mask[i]]`` in least squares (a batched ``r x r`` solve)."""
    r = other.shape[1]
    outer = (other.unsqueeze(2) * other.unsqueeze(1)).reshape(len(other), r * r)
    normal = (mask @ outer).reshape(len(mask), r, r)
    normal = normal + ridge * torch.eye(r, dtype=other.dtype, device=other.device)
    rhs = (values * mask) @ other
    solved, info = torch.linalg.solve_ex(normal, rhs)
    failed = info != 0  # a row whose kept entries see too few of ``other``'s directions: least norm
    if bool(failed.any()):
        solved[failed] = (torch.linalg.pinv(normal[failed]) @ rhs[failed].unsqueeze(-1)).squeeze(-1)
    return solved


@dataclass(frozen=True)
class Completion:
    """A pruned upload completed by its rank: the matrix, its relative disagreement with the kept
    entries, the iterations it took, and how many kept entries there were per degree of freedom."""

    matrix: Tensor
    misfit: float
    iterations: int
    oversampling: float


def complete_low_rank(grad: Tensor, rank: int, kept: Optional[Tensor] = None, iterations: int = 200,
                      tol: float = 1e-10, start: Optional[Tensor] = None) -> Completion:
    """The rank-``rank`` matrix that agrees with ``grad`` on its kept entries (``kept``: a boolean
    mask; default: the nonzero entries, as magnitude pruning leaves them): alternating least
    squares on the factors ``U V^T`` from the zero-filled upload's top singular directions (or from
    ``start``, the right factor ``(columns, rank)``), until the kept entries agree to ``tol``
    (relative) or ``iterations`` run out."""
    observed = matrix(grad)
    mask = ((observed != 0) if kept is None else kept.reshape(observed.shape).to(torch.bool)).double()
    rows, cols = observed.shape
    oversampling = float(mask.sum()) / max(1, rank * (rows + cols - rank))
    norm = float((observed * mask).norm()) or 1.0
    ridge = 1e-12 * norm ** 2 / max(rows, cols)
    u = _truncate(observed * mask, rank)[0] if start is None else _solve_rows(mask, observed, start.to(observed), ridge)
    misfit, done = math.inf, 0
    for done in range(1, iterations + 1):
        v = _solve_rows(mask.T, observed.T, u, ridge)
        u = _solve_rows(mask, observed, v, ridge)
        misfit = float(((u @ v.T - observed) * mask).norm()) / norm
        if misfit <= tol:
            break
    return Completion(u @ v.T, misfit, done, oversampling)


@dataclass(frozen=True)
class CompletedSpan:
    """The row space of a pruned upload, completed on the patch coordinates (``columns``) and
    output channels (``rows``) that kept at least ``need`` entries each: the rows ``basis``
    ``(rank, len(columns))`` span the patches restricted to those coordinates."""

    basis: Tensor
    columns: Tensor
    rows: Tensor
    completion: Completion
    need: int
    agreement: float = math.nan


def complete_span(grad: Tensor, rank: int, need: Optional[int] = None, iterations: int = 100) -> CompletedSpan:
    """:func:`complete_low_rank` where the kept entries determine it. Magnitude pruning keeps the
    largest entries, so patch coordinates of small magnitude keep fewer than ``rank`` entries and no
    completion is unique there; on the coordinates and channels that keep ``need`` (default
    ``2 * rank``) entries each, it is exact (docs/adaptive.md)."""
    observed = matrix(grad)
    need = 2 * rank if need is None else int(need)
    kept = observed != 0
    columns = torch.nonzero(kept.sum(0) >= need).flatten()
    rows = torch.nonzero(kept[:, columns].sum(1) >= need).flatten()
    if not len(columns) > rank or not len(rows) > rank:
        raise NotApplicable(f"too few patch coordinates ({len(columns)}) or channels ({len(rows)}) keep {need} "
                            f"entries each to complete rank {rank}")
    block = observed[rows][:, columns]
    done = complete_low_rank(block, rank, iterations=iterations)
    basis = torch.linalg.svd(done.matrix, full_matrices=False)[2][:rank]
    return CompletedSpan(basis, columns, rows, done, need, span_agreement(block, rank, basis))


def span_agreement(block: Tensor, rank: int, basis: Tensor, iterations: int = AGREEMENT_ITERATIONS) -> float:
    """The largest principal sine between ``basis`` and the row space of ``block``'s completion from
    a seeded random start: near zero where the kept entries determine the row space (every start
    ends there), near one where they do not (pruning keeps the largest entries, so counting them is
    not enough; a prediction of held-out entries flips with the last bits of the kernels instead)."""
    start = torch.randn(block.shape[1], rank, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    other = complete_low_rank(block, rank, iterations=iterations, start=start).matrix
    return float(principal_sines(torch.linalg.svd(other, full_matrices=False)[2][:rank], basis)[0])


def denoised_basis(grad: Tensor, rank: int) -> Tuple[Tensor, float]:
    """The top ``rank`` right singular vectors of a noisy upload (``(rank, D)``, the span's
    estimate) and the ratio of the ``rank+1``-th singular value to the ``rank``-th (near 1: the
    noise buries the span; near 0: it is plain)."""
    _, s, vh = torch.linalg.svd(matrix(grad), full_matrices=False)
    ratio = float(s[rank] / s[rank - 1]) if rank < len(s) and s[rank - 1] > 0 else 0.0
    return vh[:rank], ratio


def transmitted_basis(grad: Tensor, tol: float = 1e-6) -> Tensor:
    """An orthonormal basis of a truncated upload's row space (its numerically nonzero singular
    directions): for SVD truncation, ``k`` directions inside the patches' span."""
    _, s, vh = torch.linalg.svd(matrix(grad), full_matrices=False)
    keep = int((s > tol * s[0]).sum()) if len(s) and s[0] > 0 else 0
    return vh[:keep]


def containment_residual(basis: Tensor, conv: nn.Conv2d, maps: Tensor, centred: bool = False) -> Tensor:
    """The share of the transmitted directions ``basis`` ``(k, D)`` outside the span of ``maps``'
    patches (zero for the true maps): the truncated upload's constraint, the converse of the span
    residual, differentiable in ``maps``."""
    p = patches(conv, maps)
    if centred:
        p = p - p.mean(0, keepdim=True)
    q, _ = torch.linalg.qr(p.T.to(basis.dtype))  # (D, BN): an orthonormal basis of the patches' span
    b = basis.to(q.dtype)
    outside = b - (b @ q) @ q.T
    return outside.pow(2).sum() / b.pow(2).sum().clamp_min(1e-30)


def principal_sines(a: Tensor, b: Tensor) -> Tensor:
    """The sines of the principal angles between the row spaces of ``a`` and ``b`` (largest first):
    how far an estimated span is from the true one."""
    qa, _ = torch.linalg.qr(a.double().T)
    qb, _ = torch.linalg.qr(b.double().T)
    cos = torch.linalg.svdvals(qa.T @ qb).clamp(0, 1)
    return (1 - cos.pow(2)).clamp_min(0).sqrt().flip(0)


def layer_gradients(model: nn.Module, grads: Sequence[Tensor], names: Sequence[str]) -> Dict[str, Tensor]:
    """``{module name: weight gradient}`` for the convolutions among the trainable ``names``."""
    convs = {n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    return {n[: -len(".weight")]: g for n, g in zip(names, grads)
            if n.endswith(".weight") and n[: -len(".weight")] in convs}


def read_through(layers: Sequence[SpanLayer], gradients: Dict[str, Tensor], batch: int,
                 centred: bool) -> List[Dict[str, object]]:
    """Per span layer, which form of the span its upload still gives and how well: ``exact`` (the
    structure is there), ``completed`` (entries dropped, completed by the rank), ``contained``
    (fewer directions than the rank: truncation), ``denoised`` (full rank with a top-``r``
    estimate), each with its numbers."""
    out = []
    for layer in layers:
        grad = gradients.get(layer.name)
        if grad is None:
            continue
        rank = expected_rank(layer, batch, centred)
        share = top_share(grad, rank)
        entry: Dict[str, object] = {"layer": layer.name, "rank": rank, "share": share}
        zeros = float((matrix(grad) == 0).double().mean())
        kept = transmitted_basis(grad)
        if share >= 1 - 1e-9 and len(kept) >= rank:
            entry["form"] = "exact"
        elif zeros > 0.05:
            done = complete_low_rank(grad, rank)
            entry.update(form="completed", zeros=zeros, misfit=done.misfit, oversampling=done.oversampling)
        elif len(kept) < rank:
            entry.update(form="contained", directions=len(kept))
        else:
            entry.update(form="denoised", ratio=denoised_basis(grad, rank)[1])
        out.append(entry)
    return out
