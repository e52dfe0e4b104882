"""SPEAR from the other side: the batch from the zeros of the layer's *input*, where those of
``dZ`` cannot separate every image.

``dW = L R`` gives ``dZ = L Q`` and ``X^T = P R`` with ``P = Q^-1``. SPEAR reads the columns of
``Q`` off the zeros of ``dZ`` (:mod:`attacks.spear`). That fails where images' ReLU patterns
are nested or their ``dZ`` columns proportional (images of one label on an untrained network:
the softmax is nearly the same for all, so ``dZ`` differs between them only by its mask, and
differences of two images come back as often as the true directions). Where the layer's
input is sparse itself (features after ReLU and pooling: about a fifth of each image's live
entries are exactly zero), the rows of ``P`` follow the same rule: ``p_j R`` vanishes wherever
image ``j``'s input does, so the kernel of ``B - 1`` columns of ``R`` where one image is zero
is that image's row. The columns are drawn with replacement (thousands of them); a row is kept
where it zeroes more entries than the drawn ones and the rest share one sign (a ReLU's output
is non-negative; a difference of two images' features is not), ranked by how often it returns;
every choice of ``B`` among the most frequent is scored by the ReLU activity it predicts
(:meth:`attacks.spear_algebra.Layer.activity_match`); the best go to SPEAR's scaling and certificate.
Measured: docs/strength.md (SPEAR).
"""
from __future__ import annotations

import itertools
from typing import List, Optional, Set

import torch
from torch import Tensor

from attacks.spear_algebra import Candidates, Layer, independent, sample_directions

#: best-ranked rows beyond the batch size among which every selection is scored
SPARE = 4
#: selections per round handed to the certificate, best activity match first
PER_ROUND = 3
#: input entries a drawn row's zeros are counted on before all of them (a true row has tens there)
SCREEN = 256
#: images without a found row that :func:`complete` recovers from ``dZ``'s zeros instead
COMPLETE_MISSING = 3
#: subsets drawn per search inside :func:`complete` (a few rows or columns each)
DRAWS = 4096


def _set_key(rows: Tensor) -> bytes:
    """The same key for the same set of rows in any order (a choice tried once)."""
    return torch.round(rows * 1e4).sort(0).values.numpy().tobytes()


def default_input_samples(batch: int) -> int:
    """Column subsets drawn by default: ``2^(B+13)``, at most ``2^23``. An image whose live
    entries are zero with share ``s`` is isolated by a draw with chance ``s^(B-1)``: ``s``
    from 0.13 to 0.25 on the ``cnn`` at batch 8, about 1 to 1,000 returns in ``2^21`` draws."""
    return min(1 << 23, 1 << (batch + 13))


class InputSide:
    """The rows of ``P`` found so far from the layer input's zeros (see the module docstring)."""

    def __init__(self, right: Tensor, generator: torch.Generator, zero_tol: float):
        columns = right.T
        norms = columns.norm(dim=1)
        self.columns = columns[norms > 1e-12 * norms.max()]  # entries no image uses carry nothing
        self.b = right.shape[0]
        self.generator, self.zero_tol = generator, zero_tol
        self.found = Candidates(self.b, 32 * self.b, right.dtype, right.device)
        self.tried: Set[bytes] = set()

    def draw(self, count: int) -> None:
        if len(self.columns) < self.b:
            return
        p, zeros = sample_directions(self.columns, count, self.generator, self.zero_tol, self.b + 1, replace=True,
                                     screen=SCREEN)
        if not len(p):
            return
        values = self.columns @ p.T  # (n, k): each kept row's input entries
        big = values.abs() > self.zero_tol * values.abs().amax(0)
        positive, negative = ((values > 0) & big).sum(0), ((values < 0) & big).sum(0)
        one_sign = (positive == 0) | (negative == 0)  # a ReLU's output is one-signed; a mix of two images is not
        p = p[one_sign] * torch.where(positive[one_sign] > 0, 1.0, -1.0).to(p.dtype)[:, None]
        self.found.add(p, zeros[one_sign])

    def completions(self, layer: Layer) -> List[Tensor]:
        """``Q`` completed from ``dZ``'s zeros (:func:`complete`) from up to ``B - 1`` best-ranked
        independent rows ``P_U``: those found more than once, then any; each set once, and none
        where more than :data:`COMPLETE_MISSING` rows would be missing."""
        out = []
        for pool in (torch.nonzero(self.found.hits > 1).flatten().tolist(), list(range(len(self.found)))):
            chosen = independent(self.found.q, self.b - 1, 1e-6, pool)
            if len(chosen) < self.b - COMPLETE_MISSING:
                continue
            key = _set_key(self.found.q[chosen])
            if key in self.tried:
                continue
            self.tried.add(key)
            q = complete(self.found.q[chosen], layer, self.generator, self.zero_tol)
            if q is not None:
                out.append(q)
        return out

    def selections(self, layer: Layer) -> List[Tensor]:
        """Up to :data:`PER_ROUND` untried choices of ``B`` among the best-ranked rows, as ``Q``'s
        unit columns ``(B, B)``, the best predicted ReLU activity first."""
        recurring = torch.arange(min(len(self.found), self.b + SPARE))  # ranked: most returns, then most zeros
        if len(recurring) < self.b:
            return []
        combos = torch.tensor(list(itertools.combinations(range(len(recurring)), self.b)), dtype=torch.long)
        rows = self.found.q[recurring][combos]  # (K, B, B): each choice's rows of P
        s = torch.linalg.svdvals(rows)
        rows = rows[s[:, -1] > 1e-6 * s[:, 0]]
        if not len(rows):
            return []
        q = torch.linalg.inv(rows)
        q = q / q.norm(dim=-2, keepdim=True)
        order = torch.argsort(layer.activity_match(q).mean(-1), descending=True)
        out = []
        for k in order.tolist():
            key = _set_key(rows[k])
            if key in self.tried:
                continue
            self.tried.add(key)
            out.append(q[k])
            if len(out) == PER_ROUND:
                break
        return out


def _sparsest(rows: Tensor, generator: torch.Generator, zero_tol: float, draws: int = DRAWS) -> Tensor:
    """Kernel directions ``(k, d)`` of ``draws`` random ``d - 1``-row subsets of ``rows`` ``(n, d)``
    that zero more rows than the drawn ones, the most often found first (the one direction
    where ``d`` is 1)."""
    d = rows.shape[1]
    if d == 1:
        return torch.ones(1, 1, dtype=rows.dtype, device=rows.device)
    found = Candidates(d, 8 * d, rows.dtype, rows.device)
    found.add(*sample_directions(rows, draws, generator, zero_tol, d + 1))
    return found.q


def _inactive_kernel(affine: Tensor, pre: Tensor, bias: Tensor, zero_tol: float) -> Optional[Tensor]:
    """The direction ``(c, t)`` of image ``u``'s column from its known input: ``Z_u = s W x_u + b``
    (``pre``: ``W x_u`` up to the scale ``s > 0``) is inactive on some rows for each ``s``, and
    ``dZ_u`` vanishes exactly there. Each interval of ``s`` between the rows' breakpoints gives
    a set of rows; the largest set whose ``affine`` rows have a one-dimensional kernel with
    ``t != 0`` gives the column. None where no set does."""
    with torch.no_grad():
        cuts = (-bias / pre)[(pre != 0) & (-bias / pre > 0)].sort().values
        if not len(cuts):
            return None
        trials = torch.cat([cuts[:1] / 2, (cuts[1:] + cuts[:-1]) / 2, cuts[-1:] * 2])
        best: Optional[Tensor] = None
        size = affine.shape[1] - 1
        for scale in trials.tolist():
            rows = affine[scale * pre + bias <= 0]
            if len(rows) <= size or (best is not None and len(rows) <= best[1]):
                continue
            _, sv, vh = torch.linalg.svd(rows, full_matrices=False)
            if float(sv[-1]) <= zero_tol * float(sv[0]) and float(sv[-2]) > zero_tol * float(sv[0]) \
                    and abs(float(vh[-1, -1])) > 1e-4:
                best = (vh[-1], len(rows))
        return None if best is None else best[0]


def complete(known: Tensor, layer: Layer, generator: torch.Generator, zero_tol: float) -> Optional[Tensor]:
    """``Q``'s unit columns ``(B, B)`` from ``k`` rows ``P_U`` ``(k, B)`` of ``Q^-1`` and the zeros of
    ``dZ = L Q`` (``layer.left``: ``L``'s live rows). The other images' columns span the null
    space ``N`` of ``P_U`` (``m = B - k`` dimensions); each is the sparsest ``L q`` in it (``m - 1``
    zero rows fix it). Image ``u`` of ``U`` has ``q_u = q_u0 + N c`` with ``P_U q_u0 = e_u``: its
    input ``p_u R`` is known, so its inactive rows are, up to the input's scale, and ``dZ_u``
    vanishes there (:func:`_inactive_kernel`); else ``m`` sampled zero rows of ``dZ_u`` fix
    ``c``. None where some column is not found."""
    left = layer.left
    null = torch.linalg.svd(known, full_matrices=True).Vh[known.shape[0]:].T  # (B, m)
    m = null.shape[1]
    inside = _sparsest(left @ null, generator, zero_tol)
    if len(inside) < m:
        return None
    columns, loose = [], []
    base = torch.linalg.pinv(known)  # (B, k): P_U q_u0 = e_u
    for i in range(known.shape[0]):
        affine = torch.cat([left @ null, (left @ base[:, i])[:, None]], dim=1)  # (n, m + 1): (c, t)
        c = _inactive_kernel(affine, known[i] @ layer.rw, layer.bias[0], zero_tol)
        if c is None:
            loose.append(i)
            found = _sparsest(affine, generator, zero_tol)
            found = found[found[:, -1].abs() > 1e-4]  # t = 0 is N alone: the other images' columns
            if not len(found):
                return None
            c = found[0]
        columns.append(null @ c[:-1] / c[-1] + base[:, i])
    others = inside @ null.T  # the other images' columns: the best-ranked independent ones
    chosen = independent(others, m, 1e-6)
    if len(chosen) < m:
        return None
    q = torch.stack(columns + list(others[chosen]), dim=1)
    if float(torch.linalg.svdvals(q)[-1]) <= 1e-8 * float(torch.linalg.svdvals(q)[0]):
        return None
    if loose:
        q = _sparser_missing(q, known.shape[0], loose, layer.right, generator, zero_tol)
    return q / q.norm(dim=0, keepdim=True)


def _sparser_missing(q: Tensor, k: int, loose: List[int], right: Tensor, generator: torch.Generator,
                     zero_tol: float) -> Tensor:
    """``Q`` with the missing images' rows of ``Q^-1`` (those after the ``k`` known) made as sparse
    as their input is. A known image whose inactive rows left its column loose (``loose``) had
    it from sampled zeros of ``dZ``, which may add missing images' columns to it; that shows
    in ``Q^-1`` as the known images' rows (exact) mixed into the missing ones. Each missing row
    is therefore taken as the sparsest ``p_m R`` in the span of itself and the loose known rows
    (most zeros among the directions that recur)."""
    p = torch.linalg.inv(q)
    for r in range(k, p.shape[0]):
        family = p[[r, *loose]]
        family = family / family.norm(dim=1, keepdim=True)  # (1 + a, B), comparable weights
        found = Candidates(family.shape[0], 8 * family.shape[0], family.dtype, family.device)
        found.add(*sample_directions((family @ right).T, DRAWS, generator, zero_tol, family.shape[0] + 1))
        keep = (found.q[:, 0].abs() > 1e-4) & (found.hits > 1)  # the missing row itself stays in
        if bool(keep.any()):  # the sparsest: recurring mixes of two images' inputs share fewer zeros
            p[r] = found.q[keep][int(found.zeros[keep].argmax())] @ family
    return torch.linalg.inv(p)
