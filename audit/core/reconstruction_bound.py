"""An upper bound on identification success against DP-SGD (Hayes, Mahloujifar & Balle,
NeurIPS 2023, "Bounding Training Data Reconstruction in DP-SGD").

An adversary who must pick a private example out of K equally likely candidates (baseline
``kappa = 1 / K``) succeeds with probability at most the power, at level ``kappa``, of the
most powerful test between the mechanism's output distributions without and with the
example. For ``T`` DP-SGD steps with noise multiplier ``sigma`` and Poisson sampling rate
``q`` these are ``mu0 = N(0, sigma^2)^T`` and ``mu1 = ((1 - q) N(0, sigma^2) + q N(1,
sigma^2))^T`` (sensitivity 1 after clipping). For ``q = 1`` the pair is Gaussian with
``mu = sqrt(T) / sigma`` and the bound is ``Phi(Phi^-1(kappa) + mu)``; otherwise the
Neyman-Pearson test's power is estimated by Monte Carlo on the likelihood ratio.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm

from audit.core.errors import ConfigError


def identification_bound(kappa: float, noise_multiplier: float, steps: int = 1, sample_rate: float = 1.0,
                         samples: int = 200_000, seed: int = 0) -> float:
    """The largest probability with which any adversary identifies the private example among
    candidates with prior mass ``kappa`` each, after ``steps`` DP-SGD steps."""
    if not 0 < kappa <= 1:
        raise ConfigError(f"kappa must be in (0, 1], got {kappa}")
    if not 0 <= sample_rate <= 1 or steps < 0:
        raise ConfigError(f"need 0 <= sample_rate <= 1 and steps >= 0, got {sample_rate} and {steps}")
    if kappa == 1 or noise_multiplier == 0:
        return 1.0 if noise_multiplier == 0 and steps and sample_rate else kappa
    if steps == 0 or sample_rate == 0:
        return kappa
    sigma = float(noise_multiplier)
    if sample_rate == 1:
        return float(norm.cdf(norm.ppf(kappa) + math.sqrt(steps) / sigma))
    rng = np.random.default_rng(seed)

    def log_ratio(y: np.ndarray) -> np.ndarray:
        # log d mu1 / d mu0 per coordinate: log((1 - q) + q exp((2y - 1) / (2 sigma^2))), summed over steps
        per_step = np.logaddexp(math.log1p(-sample_rate), math.log(sample_rate) + (2 * y - 1) / (2 * sigma ** 2))
        return per_step.sum(-1)

    null = log_ratio(rng.normal(0.0, sigma, size=(samples, steps)))
    threshold = np.quantile(null, 1.0 - kappa)
    shifted = rng.normal(0.0, sigma, size=(samples, steps)) + (rng.random((samples, steps)) < sample_rate)
    return float(max(kappa, np.mean(log_ratio(shifted) > threshold)))
