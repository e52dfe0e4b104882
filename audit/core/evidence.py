"""The mathematics of evidence: scores invariant where the gradient is blind, identification
among candidates, and exact binomial intervals.

A leak figure means something only next to what an attacker gets without the shared update
(``docs/evidence.md``). This module holds the pieces the null and the leak rule are built
from; nothing here knows about audits.

* :func:`aligned_psnr`: PSNR after the least-squares per-channel gain (>= 0) and offset that
  bring a reconstruction closest to its target -- the four numbers train-mode BatchNorm
  leaves free do not hide a recovered image, and cannot flatter a flat guess either.
* :class:`Similarity`: distances between images after per-channel standardisation (so also
  blind to gain and offset), LPIPS when its weights are installed, else SSIM.
* :func:`clopper_pearson`, :func:`excluded_rate`, :func:`images_to_exclude`: exact binomial
  statements about a recovery rate seen on few images; :func:`binomial_tail` and
  :func:`images_needed`: how many of n images a step's word needs at a level.
* :func:`mcnemar_exact`: the paired exact test of a defense's effect on the same images.
* :func:`mean_difference`: the difference of two means over seeds (e.g. test accuracies of
  training runs) with its Welch t interval.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.errors import DataError

EPS = 1e-6


# --------------------------------------------------------------------------- gain / offset
def fit_gain_offset(recon: Tensor, target: Tensor) -> Tensor:
    """``recon`` with each channel mapped by ``a * x + b`` (``a >= 0``) to fit ``target`` best in
    least squares, clamped to [0, 1]. Shapes ``(N, C, H, W)`` (broadcast on N)."""
    r, t = recon.double().flatten(2), target.double().flatten(2)
    r, t = torch.broadcast_tensors(r, t)
    rm, tm = r.mean(-1, keepdim=True), t.mean(-1, keepdim=True)
    cov = ((r - rm) * (t - tm)).mean(-1, keepdim=True)
    var = (r - rm).pow(2).mean(-1, keepdim=True)
    gain = torch.where(var > EPS ** 2, cov / var.clamp_min(EPS ** 2), torch.zeros_like(var)).clamp_min(0)
    fitted = gain * (r - rm) + tm
    return fitted.clamp(0, 1).reshape(r.shape[:2] + recon.shape[2:]).to(recon.dtype)


def aligned_psnr(recon: Tensor, target: Tensor) -> Tensor:
    """PSNR (dB, data range 1) of ``recon`` after :func:`fit_gain_offset` to ``target``,
    per image; ``>=`` the plain PSNR up to the clamp. Broadcasts over the first dimension."""
    fitted = fit_gain_offset(recon, target)
    mse = (fitted.double() - target.double()).pow(2).flatten(1).mean(1)
    return 10.0 * torch.log10(1.0 / mse.clamp_min(1e-20))


def standardise(images: Tensor) -> Tensor:
    """Each image's channels to zero mean and unit spread, mapped to ``0.5 + z / 4`` (two
    standard deviations fill [0, 1]); a flat channel becomes uniform 0.5. Invariant to a
    per-channel gain > 0 and offset."""
    x = images.double()
    mean = x.mean((-2, -1), keepdim=True)
    std = x.std((-2, -1), keepdim=True, unbiased=False)
    z = torch.where(std > 1e-4, (x - mean) / std.clamp_min(1e-4), torch.zeros_like(x))
    return (0.5 + z / 4).to(images.dtype)


# --------------------------------------------------------------------------- similarity
@dataclass(frozen=True)
class Similarity:
    """A perceptual distance between standardised images, smaller = more alike: ``prepare``
    turns images into a representation once (an LPIPS embedding, standardised pixels),
    ``between`` gives the ``(Q, C)`` distances of two prepared sets. ``name`` is what the
    report prints."""

    name: str
    prepare: Callable[[Tensor], Tensor]
    between: Callable[[Tensor, Tensor], Tensor]

    def distances(self, queries: Tensor, candidates: Tensor) -> Tensor:
        return self.between(self.prepare(queries), self.prepare(candidates))


def lpips_embedding(images: Tensor, model) -> Tensor:
    """Flat vectors whose squared Euclidean distance is LPIPS (v0.1 linear heads): each
    layer's unit-normalised features weighted by the square root of its linear head and by
    ``1 / sqrt(H W)``. Distances between many images then cost one feature pass each."""
    x = images.float().expand(-1, 3, -1, -1) * 2 - 1
    with torch.no_grad():
        outs = model.net(model.scaling_layer(x))
        parts = []
        for layer, feat in enumerate(outs):
            unit = feat / (feat.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
            weight = model.lins[layer].model[-1].weight.detach().clamp_min(0).sqrt().view(1, -1, 1, 1)
            parts.append((unit * weight).flatten(1) / math.sqrt(feat.shape[-2] * feat.shape[-1]))
    return torch.cat(parts, 1).double()


def squared_distances(q: Tensor, c: Tensor) -> Tensor:
    """``(Q, C)`` squared Euclidean distances between rows."""
    return (q.pow(2).sum(1, keepdim=True) + c.pow(2).sum(1) - 2 * q @ c.T).clamp_min(0)


def ssim_matrix(queries: Tensor, candidates: Tensor, window: int = 7) -> Tensor:
    """SSIM of every (query, candidate) pair, ``(Q, C)``: a uniform ``window`` (scikit-image's
    default with sample covariances), data range 1, averaged over channels and positions."""
    win = min(window, *queries.shape[-2:])
    win -= 1 - win % 2
    if win < 3:
        raise DataError(f"SSIM needs images of at least 3x3 pixels, got {tuple(queries.shape[-2:])}")
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    pool = torch.nn.AvgPool2d(win, stride=1)
    n = win * win
    cov_norm = n / (n - 1)

    def moments(x):
        x = x.double()
        return x, pool(x), pool(x * x)

    q, mq, qq = moments(queries)
    c, mc, cc = moments(candidates)
    vq, vc = cov_norm * (qq - mq * mq), cov_norm * (cc - mc * mc)
    out = torch.empty(len(q), len(c), dtype=torch.float64)
    for i in range(len(q)):  # queries are few (a reconstruction, the null's items): candidates batched
        mqc = pool(q[i:i + 1] * c)
        cov = cov_norm * (mqc - mq[i:i + 1] * mc)
        s = ((2 * mq[i:i + 1] * mc + c1) * (2 * cov + c2)) / ((mq[i:i + 1] ** 2 + mc ** 2 + c1) * (vq[i:i + 1] + vc + c2))
        out[i] = s.flatten(1).mean(1)  # valid positions only: scikit-image crops half a window
    return out


def similarity(shape, prefer_lpips: bool = True,
               device: torch.device | str = "cpu") -> Tuple[Similarity, Optional[str]]:
    """For images of ``shape`` ``(C, H, W)``: LPIPS on standardised images when its weights are
    installed and the images fit AlexNet, else ``1 - SSIM`` on standardised images (or, below
    3x3 pixels, their squared distance); with the reason LPIPS was not used (None when it was)."""
    from audit.core.metrics import LPIPS_MIN_SIDE, MetricUnavailable, lpips_model

    channels, side = shape[0], min(shape[1:])
    why = "LPIPS was not asked for"
    if prefer_lpips and side < LPIPS_MIN_SIDE:
        why = f"LPIPS (AlexNet) needs at least {LPIPS_MIN_SIDE}x{LPIPS_MIN_SIDE} pixels"
    elif prefer_lpips and channels not in (1, 3):
        why = f"LPIPS needs 1 or 3 channels, these images have {channels}"
    elif prefer_lpips:
        try:
            model = lpips_model(device)
            return Similarity("LPIPS (AlexNet) on per-channel standardised images",
                              lambda x: lpips_embedding(standardise(x), model), squared_distances), None
        except MetricUnavailable as err:
            why = str(err)
    if side < 3:
        return Similarity("squared distance of per-channel standardised images",
                          lambda x: standardise(x).flatten(1).double(), squared_distances), why
    return Similarity("1 - SSIM on per-channel standardised images", standardise,
                      lambda q, c: 1.0 - ssim_matrix(q, c)), why


def rank_among(distances_to_candidates: Tensor, distance_to_truth: Tensor) -> Tensor:
    """The rank of the true image among the candidates plus itself (1 = closest; a candidate
    at the same distance counts as closer, so ties never help identification)."""
    return 1 + (distances_to_candidates <= distance_to_truth.unsqueeze(-1)).sum(-1)


# --------------------------------------------------------------------------- binomial
def clopper_pearson(k: int, n: int, level: float = 0.95) -> Tuple[float, float]:
    """Exact two-sided ``level`` interval of a binomial rate with ``k`` successes of ``n``."""
    from scipy.stats import beta

    if n <= 0:
        return 0.0, 1.0
    alpha = 1.0 - level
    low = 0.0 if k == 0 else float(beta.ppf(alpha / 2, k, n - k + 1))
    high = 1.0 if k == n else float(beta.ppf(1 - alpha / 2, k + 1, n - k))
    return low, high


def binomial_tail(n: int, p: float, k: int) -> float:
    """``P(Binomial(n, p) >= k)``: how often ``n`` independent images, each reaching a class with
    probability ``p``, reach it ``k`` times or more."""
    from scipy.stats import binom

    if k <= 0:
        return 1.0
    return float(binom.sf(k - 1, n, min(max(p, 0.0), 1.0)))


def images_needed(n: int, p: float, alpha: float) -> int:
    """The fewest of ``n`` images (1..n) whose count :func:`binomial_tail` reaches with probability
    at most ``alpha``; ``n + 1`` when no count of ``n`` is that rare."""
    return next((k for k in range(1, n + 1) if binomial_tail(n, p, k) <= alpha), n + 1)


def excluded_rate(n: int, level: float = 0.95) -> float:
    """With 0 successes in ``n`` trials, the smallest rate excluded at one-sided ``level``:
    ``1 - (1 - level)^(1/n)`` (every rate above it would show a success with probability >= level)."""
    return 1.0 if n <= 0 else 1.0 - (1.0 - level) ** (1.0 / n)


def images_to_exclude(rate: float, level: float = 0.95) -> int:
    """How many images with none recovered exclude a recovery rate of ``rate`` at ``level``."""
    return int(math.ceil(math.log(1.0 - level) / math.log(1.0 - rate)))


def mcnemar_exact(stopped: int, let_through: int) -> float:
    """One-sided exact McNemar p-value for paired binary outcomes: ``stopped`` pairs where only
    the first arm succeeded (the control recovered the image, the defended run did not),
    ``let_through`` pairs where only the second did. Under the null of no effect each
    discordant pair is a fair coin, so p = P(Binomial(b + c, 1/2) >= b)."""
    n = stopped + let_through
    if n == 0:
        return 1.0
    return sum(math.comb(n, i) for i in range(stopped, n + 1)) / 2.0 ** n


# --------------------------------------------------------------------------- means over seeds
@dataclass(frozen=True)
class Difference:
    """``mean(a) - weight * mean(b)`` with its two-sided ``level`` interval (Welch's t on the
    standard error of the difference, ``df`` Welch-Satterthwaite degrees of freedom)."""

    estimate: float
    low: float
    high: float
    stderr: float
    df: float
    level: float
    sizes: Tuple[int, int]

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def mean_difference(a: Sequence[float], b: Sequence[float], weight: float = 1.0,
                    level: float = 0.95) -> Optional[Difference]:
    """``mean(a) - weight * mean(b)`` for independent samples ``a`` and ``b`` (e.g. accuracies
    over training seeds) with Welch's t interval; None when either has fewer than two values
    (no spread is known). Samples without spread give a zero-width interval."""
    from scipy.stats import t

    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = math.fsum(a) / len(a), math.fsum(b) / len(b)
    va = math.fsum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = weight ** 2 * math.fsum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    estimate, se = ma - weight * mb, math.sqrt(va + vb)
    if se == 0.0:
        return Difference(estimate, estimate, estimate, 0.0, math.inf, level, (len(a), len(b)))
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    half = float(t.ppf(0.5 + level / 2, df)) * se
    return Difference(estimate, estimate - half, estimate + half, se, df, level, (len(a), len(b)))
