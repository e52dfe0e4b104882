"""DP-SGD: per-example clipping, averaging, Gaussian noise (Abadi et al.), and its privacy cost.

Each example's whole gradient has L2 norm at most ``clip`` in both modes, so the sum over a
batch has sensitivity ``clip`` and the noise ``N(0, (noise_multiplier * clip)^2)`` on the sum
(``/ B`` on the average) is calibrated to it. ``per_layer=True`` clips each of the ``L``
tensors to ``clip / sqrt(L)`` (McMahan et al. 2018's equal split): the per-layer norms then
combine to at most ``clip``. We split the bound rather than scale the noise up to
``clip * sqrt(L)`` so that ``clip`` and ``noise_multiplier`` mean the same privacy in both
modes and :func:`privacy_spent` needs no mode.

:func:`privacy_spent` turns steps, sampling rate and noise multiplier into ``(epsilon, delta)``
with the RDP accountant of the subsampled Gaussian mechanism (Mironov et al. 2019): opacus's
when the ``[dp]`` extra is installed, else our own (same orders, same conversion).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np
import torch
from scipy import integrate, special

from audit.core.errors import ConfigError
from audit.core.types import Defense, default_loss_fn

from defenses.common import check_choice, check_range, per_example_stack, squared_norms
from defenses.noise import add_noise
from defenses.registry import DEFENSES

# opacus's default RDP orders, so both accountants optimise over the same grid
RDP_ORDERS: Tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
ACCOUNTANTS = ("auto", "opacus", "rdp")


@dataclass(frozen=True)
class PrivacySpent:
    """``(epsilon, delta)`` spent by ``steps`` DP-SGD steps, and how it was computed."""

    epsilon: float
    delta: float
    steps: int
    sample_rate: float
    noise_multiplier: float
    order: float  # the RDP order that gave the tightest epsilon
    accountant: str  # "opacus <version> RDP" or "gia-audit RDP"

    def __iter__(self):
        return iter((self.epsilon, self.delta))


def _log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """``log A_alpha`` by the binomial expansion (exact for integer orders)."""
    k = np.arange(alpha + 1, dtype=np.float64)
    log_binom = special.gammaln(alpha + 1) - special.gammaln(k + 1) - special.gammaln(alpha - k + 1)
    with np.errstate(divide="ignore"):
        terms = log_binom + k * math.log(q) + (alpha - k) * np.log1p(-q) + (k * k - k) / (2 * sigma ** 2)
    return float(special.logsumexp(terms))


def _log_a_real(q: float, sigma: float, alpha: float) -> float:
    """``log A_alpha = log E_{z ~ N(0, s^2)} [((1 - q) + q exp((2z - 1) / (2 s^2)))^alpha]`` by
    quadrature (fractional orders)."""
    def log_f(z):
        ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * z - 1) / (2 * sigma ** 2))
        return -0.5 * (z / sigma) ** 2 - math.log(sigma * math.sqrt(2 * math.pi)) + alpha * ratio

    # two bumps: the (1 - q)^alpha one near 0 and the q^alpha one near alpha; integrate both
    lo, hi = -12 * sigma, alpha + 12 * sigma
    grid = np.linspace(lo, hi, 4001)
    top = float(np.max(log_f(grid)))
    value, _ = integrate.quad(lambda z: math.exp(log_f(z) - top), lo, hi, points=[0.0, 0.5, alpha],
                              limit=400, epsabs=0, epsrel=1e-10)
    return top + math.log(value)


def rdp_subsampled_gaussian(q: float, sigma: float, alpha: float) -> float:
    """RDP of one step of the Poisson-subsampled Gaussian mechanism at order ``alpha > 1``."""
    if q == 0:
        return 0.0
    if sigma == 0:
        return math.inf
    if q == 1:
        return alpha / (2 * sigma ** 2)
    log_a = _log_a_integer(q, sigma, int(alpha)) if float(alpha).is_integer() else _log_a_real(q, sigma, alpha)
    return log_a / (alpha - 1)


def epsilon_from_rdp(rdp: Sequence[float], orders: Sequence[float], delta: float) -> Tuple[float, float]:
    """Tightest ``(epsilon, order)`` by the RDP -> (epsilon, delta) conversion of Balle et al.
    2020 (Theorem 21): ``eps = rdp - (log delta + log a) / (a - 1) + log((a - 1) / a)``."""
    a, r = np.asarray(orders, dtype=np.float64), np.asarray(rdp, dtype=np.float64)
    eps = r - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    eps = np.where(np.isnan(eps), np.inf, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(a[best])


def _opacus_rdp():
    try:
        import opacus
        from opacus.accountants.analysis import rdp
    except ImportError:
        return None, None
    return rdp, getattr(opacus, "__version__", "?")


def privacy_spent(steps: int, sample_rate: float, noise_multiplier: float, delta: float = 1e-5, *,
                  accountant: str = "auto") -> PrivacySpent:
    """``(epsilon, delta)`` spent by ``steps`` DP-SGD steps with sampling rate ``sample_rate``
    (batch size / data set size) and ``noise_multiplier`` (noise std / clipping bound).

    ``accountant``: ``"opacus"`` (needs ``pip install 'gia-audit[dp]'``), ``"rdp"`` (ours) or
    ``"auto"`` (opacus when installed). Both treat batches as Poisson-sampled.
    """
    steps = check_range("privacy_spent", "steps", steps, 0, None, integer=True)
    q = check_range("privacy_spent", "sample_rate", sample_rate, 0, 1)
    sigma = check_range("privacy_spent", "noise_multiplier", noise_multiplier, 0, None)
    delta = check_range("privacy_spent", "delta", delta, 0, 1, low_open=True, high_open=True)
    check_choice("privacy_spent", "accountant", accountant, ACCOUNTANTS)
    opacus_rdp, version = _opacus_rdp() if accountant != "rdp" else (None, None)
    if accountant == "opacus" and opacus_rdp is None:
        raise ConfigError("privacy_spent: accountant='opacus' needs opacus; pip install 'gia-audit[dp]' "
                          "or use accountant='rdp'")
    if steps == 0 or q == 0:
        return PrivacySpent(0.0, delta, steps, q, sigma, RDP_ORDERS[0], "none spent")
    if sigma == 0:
        return PrivacySpent(math.inf, delta, steps, q, sigma, RDP_ORDERS[0], "no noise")
    if opacus_rdp is not None:
        rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=list(RDP_ORDERS))
        name = f"opacus {version} RDP"
    else:
        rdp = [steps * rdp_subsampled_gaussian(q, sigma, a) for a in RDP_ORDERS]
        name = "gia-audit RDP"
    eps, order = epsilon_from_rdp(rdp, RDP_ORDERS, delta)
    return PrivacySpent(eps, delta, steps, q, sigma, order, name)


def clip_stacked(per_example: Sequence[torch.Tensor], bound: float, per_layer: bool) -> list:
    """:func:`~defenses.clip.clip_by_norm` of every example of ``(B, *shape)`` stacks at once."""
    if per_layer:
        norms = [g.flatten(1).norm(dim=1) for g in per_example]
    else:  # the whole gradient's norm, accumulated in float64 as global_norm does
        norms = [sum(squared_norms(g) for g in per_example).sqrt()] * len(per_example)
    return [g * torch.clamp(bound / (n.to(g.dtype) + 1e-12), max=1.0).view(-1, *[1] * (g.dim() - 1))
            for g, n in zip(per_example, norms)]


@DEFENSES.register(
    "dp-sgd", "Per-example clipping to `clip` + Gaussian noise of std noise_multiplier*clip/batch"
)
class DPSGD(Defense):
    """Clip each example's gradient to norm ``clip`` (whole model, or ``clip / sqrt(L)`` per
    tensor), average, and add ``N(0, (noise_multiplier * clip / B)^2)`` to every coordinate."""

    name = "dp-sgd"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = True
    differences = (
        "Batches are drawn as fixed-size samples without replacement, while the (epsilon, delta) "
        "accountant assumes Poisson sampling with rate batch size / data set size (as opacus does).",
        "per_layer=True splits the clipping bound equally (clip / sqrt(L) per tensor, McMahan et al. "
        "2018) instead of clipping each tensor to clip.",
    )

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 1.0, per_layer: bool = False):
        self.clip = check_range(self.name, "clip", clip, 0, None, low_open=True)
        self.noise_multiplier = check_range(self.name, "noise_multiplier", noise_multiplier, 0, None)
        self.per_layer = bool(per_layer)

    def clip_bound(self, num_tensors: int) -> float:
        """The norm each clipped piece is held to: ``clip`` for the whole gradient, or
        ``clip / sqrt(num_tensors)`` for each tensor when ``per_layer``."""
        return self.clip / math.sqrt(num_tensors) if self.per_layer else self.clip

    def noise_std(self, batch_size: int) -> float:
        """Standard deviation of the noise on the averaged gradient of a batch (sensitivity of
        the sum is ``clip`` in both modes)."""
        return self.noise_multiplier * self.clip / batch_size

    def privacy(self, steps: int, sample_rate: float, delta: float = 1e-5,
                accountant: str = "auto") -> PrivacySpent:
        """:func:`privacy_spent` with this defense's noise multiplier."""
        return privacy_spent(steps, sample_rate, self.noise_multiplier, delta, accountant=accountant)

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        per_example = per_example_stack(model, inputs, labels, loss_fn)  # (B, *shape) per parameter
        bound = self.clip_bound(len(per_example))
        mean = [g.mean(0) for g in clip_stacked(per_example, bound, self.per_layer)]
        # the per-example passes leave buffers untouched; update them once, as a client would
        with torch.no_grad():
            model(inputs.detach())
        if self.noise_multiplier == 0:
            return mean
        return add_noise(mean, "gaussian", self.noise_std(inputs.shape[0]), generator)
