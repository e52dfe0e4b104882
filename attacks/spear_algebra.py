"""SPEAR's linear algebra (:mod:`attacks.spear`): the low-rank factors of a layer's gradient,
kernel directions of random row subsets and the ranked pool of those found, the mixing matrix
scaled by the bias gradient, and the ReLU activity a selection predicts. Shared by both sides of
the search, ``dZ``'s zeros (:mod:`attacks.spear`) and the input's (:mod:`attacks.spear_dual`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor


def low_rank_factors(dw: Tensor, rank: int) -> Tuple[Tensor, Tensor, float]:
    """``dW ~ L R`` with ``L`` ``(m, rank)`` and ``R`` ``(rank, n)`` from the SVD, in float64, and
    the noise floor: the first dropped singular value over the last kept (0 for rank ``rank``)."""
    u, s, vh = torch.linalg.svd(dw.detach().double(), full_matrices=False)
    floor = float(s[rank] / s[rank - 1]) if len(s) > rank and s[rank - 1] > 0 else 0.0
    return u[:, :rank] * s[:rank], vh[:rank], floor


def sample_directions(rows: Tensor, count: int, generator: torch.Generator, zero_tol: float,
                      min_zeros: int, replace: bool = False, screen: int = 0) -> Tuple[Tensor, Tensor]:
    """``count`` kernel directions of random ``(B-1)``-row subsets of ``rows`` ``(m, B)``, kept
    where the subset's kernel is one-dimensional and ``rows @ q`` has at least ``min_zeros``
    entries within ``zero_tol`` of its largest: ``(directions (k, B) unit, sign-normalised;
    zero counts (k,))``. ``replace``: draw rows independently (cheaper for thousands of rows; a
    subset that repeats a row has no one-dimensional kernel and is dropped). ``screen``: count
    zeros on that many random rows first, and on all rows only for directions with more than
    ``B + 1`` there (a true direction of thousands of rows has tens)."""
    m, b = rows.shape
    if replace:
        picks = torch.randint(0, m, (count, b - 1), generator=generator, device=rows.device)
    else:
        picks = torch.rand(count, m, generator=generator, dtype=rows.dtype, device=rows.device).topk(b - 1, dim=1).indices
    subsets = rows[picks]
    # the kernel of [A a] is (-A^-1 a, 1) where A is invertible (otherwise it is not one-dimensional or
    # not of this form; the other (B-1) x (B-1) minors would give it, at (B-1)x the cost, for a rare case)
    head, info = torch.linalg.solve_ex(subsets[..., :-1], -subsets[..., -1:])
    q = torch.cat([head[..., 0], torch.ones(count, 1, dtype=rows.dtype, device=rows.device)], dim=1)
    q = q / q.norm(dim=1, keepdim=True)
    if screen and m > screen:
        probe = (rows[torch.randint(0, m, (screen,), generator=generator, device=rows.device)] @ q.T).abs()
        passed = (info == 0) & ((probe <= zero_tol * probe.amax(0)).sum(0) > b + 1)
        q, info, subsets = q[passed], info[passed], subsets[passed]
    values = (rows @ q.T).abs()
    zeros = (values <= zero_tol * values.amax(0)).sum(0)
    keep = (info == 0) & torch.isfinite(q).all(1) & (zeros >= min_zeros)
    if b > 1 and bool(keep.any()):  # at batch 1 the subset is empty and its kernel the whole line
        s = torch.linalg.svdvals(subsets[keep])
        keep[keep.clone()] = s[:, -1] > 1e-7 * s[:, 0]
    q = q[keep]
    lead = q.gather(1, q.abs().argmax(1, keepdim=True))
    return q * lead.sign(), zeros[keep]


class Candidates:
    """The distinct directions found so far (at most ``keep``) with their zero counts and how
    often each was found, the most often found (then sparsest) first: a true direction comes
    back from every subset of its image's zero rows, a spurious one rarely twice. Directions
    with ``|cos| > same`` count as one."""

    def __init__(self, b: int, keep: int, dtype, device, same: float = 0.9999):
        self.q = torch.zeros(0, b, dtype=dtype, device=device)
        self.zeros = torch.zeros(0, dtype=torch.long, device=device)
        self.hits = torch.zeros(0, dtype=torch.long, device=device)
        self.keep, self.same = keep, same

    def __len__(self) -> int:
        return len(self.q)

    def _ranked(self, hits: Tensor, zeros: Tensor) -> Tensor:
        return torch.argsort(hits * (int(zeros.max()) + 1) + zeros, descending=True, stable=True)

    def add(self, q: Tensor, zeros: Tensor) -> None:
        q, zeros = torch.cat([self.q, q]), torch.cat([self.zeros, zeros])
        hits = torch.cat([self.hits, torch.ones(len(q) - len(self.hits), dtype=torch.long, device=q.device)])
        if not len(q):
            return
        _, groups = torch.unique(torch.round(q * 1e4), dim=0, return_inverse=True)
        count = int(groups.max()) + 1
        first = torch.full((count,), len(q), dtype=torch.long, device=q.device)
        first.scatter_reduce_(0, groups, torch.arange(len(q), device=q.device), "amin")
        group_hits = torch.zeros(count, dtype=torch.long, device=q.device).scatter_add_(0, groups, hits)
        group_zeros = torch.zeros(count, dtype=torch.long, device=q.device).scatter_reduce_(0, groups, zeros, "amax")
        top = self._ranked(group_hits, group_zeros)[: 4 * self.keep]
        q, zeros, hits = q[first[top]], group_zeros[top], group_hits[top].clone()
        earlier = torch.tril((q @ q.T).abs() > self.same, diagonal=-1)  # a copy of a higher-ranked one
        copy = earlier.any(1)
        hits.scatter_add_(0, earlier.double().argmax(1)[copy], hits[copy])
        kept_t = torch.nonzero(~copy).flatten()
        order = kept_t[self._ranked(hits[kept_t], zeros[kept_t])][: self.keep]
        self.q, self.zeros, self.hits = q[order], zeros[order], hits[order]

    def greedy(self, b: int, cond: float = 1e-3) -> Optional[Tensor]:
        """The indices of ``b`` linearly independent directions, in rank order; None when there
        are not ``b``."""
        chosen = independent(self.q, b, cond)
        return torch.tensor(chosen) if len(chosen) == b else None


def independent(vectors: Tensor, most: int, cond: float, among: Optional[List[int]] = None) -> List[int]:
    """Up to ``most`` indices of rows of ``vectors`` (of ``among``, in its order; default all)
    that are linearly independent, each kept where the rows chosen so far with it keep their
    smallest singular value above ``cond`` times the largest."""
    chosen: List[int] = []
    for k in range(len(vectors)) if among is None else among:
        if len(chosen) == most:
            break
        s = torch.linalg.svdvals(vectors[chosen + [k]])
        if float(s[-1]) > cond * float(s[0]):
            chosen.append(k)
    return chosen


def scaled_mixing(rows_all: Tensor, directions: Tensor, db: Tensor) -> Tensor:
    """``Q`` from its unit columns ``(..., B, B)``: the scales (and signs) that make ``L Q 1`` the
    bias gradient (least squares, through the normal equations)."""
    gram, proj = rows_all.T @ rows_all, rows_all.T @ db.detach().double()
    lhs = directions.transpose(-1, -2) @ gram @ directions
    scales = torch.linalg.solve(lhs, (directions.transpose(-1, -2) @ proj[:, None]))
    return directions * scales.transpose(-1, -2)


@dataclass
class Layer:
    """The observed layer in the rows SPEAR reads (those of ``L`` not zero): ``L``, ``R``, the
    bias gradient, and ``R W^T`` and the bias, from which a selection's pre-activations follow."""

    left: Tensor
    right: Tensor
    db: Tensor
    rw: Tensor
    bias: Tensor
    zero_tol: float

    def activity_match(self, directions: Tensor) -> Tensor:
        """Per selection ``(K, B, B)`` and image, the share of rows where the ReLU activity the
        recovered batch predicts (``Z = W x + b > 0``) is the observed one (``dZ != 0``): 1 for the
        true directions; a wrong direction spoils its own image and the one it mixes in."""
        mixing = scaled_mixing(self.left, directions, self.db)
        dz = (self.left @ mixing).abs()
        observed = dz > self.zero_tol * dz.amax(-2, keepdim=True)
        predicted = (torch.linalg.inv(mixing) @ self.rw + self.bias).transpose(-1, -2) > 0
        return (observed == predicted).double().mean(-2)


def improve(layer: Layer, pool: Tensor, chosen: Tensor, cond: float = 1e-3) -> Tuple[Tensor, Tensor]:
    """Local search from the greedy selection ``chosen`` (indices into ``pool`` ``(C, B)``): while
    an image's activity does not match, try every other candidate in the place of the two worst
    and keep the best swap. Returns the selection and its per-image match."""
    match = layer.activity_match(pool[chosen].T[None])[0]
    for _ in range(2 * len(chosen)):
        if bool((match >= 1).all()):
            break
        best = (float(match.mean()), None)
        others = torch.tensor([k for k in range(len(pool)) if k not in set(chosen.tolist())], dtype=torch.long)
        for position in torch.argsort(match)[: min(2, int((match < 1).sum()))]:
            trials = chosen.repeat(len(others), 1)
            trials[:, position] = others
            directions = pool[trials].transpose(-1, -2)
            s = torch.linalg.svdvals(directions)
            ok = s[:, -1] > cond * s[:, 0]
            if not bool(ok.any()):
                continue
            scores = layer.activity_match(directions[ok]).mean(-1)
            k = int(scores.argmax())
            if float(scores[k]) > best[0]:
                best = (float(scores[k]), trials[ok][k])
        if best[1] is None:
            break
        chosen = best[1]
        match = layer.activity_match(pool[chosen].T[None])[0]
    return chosen, match
