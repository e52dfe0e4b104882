"""The (epsilon, delta) that an audit's FL training spends, for a defense that has one.

A defense *accounts* for privacy when it declares ``privacy(steps, sample_rate, delta)``
(DP-SGD) or exposes both ``noise_multiplier`` and ``clip`` (per-example clipping plus
Gaussian noise, accounted with :func:`defenses.dpsgd.privacy_spent`); any other defense,
noise without a clipping bound included, has no (epsilon, delta) and is reported as
'not applicable' with the reason.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from audit.core.errors import GiaError

DELTA = 1e-5


def _accountant(defense: Any) -> Optional[Callable[[int, float, float], Any]]:
    """``(steps, sample_rate, delta) -> PrivacySpent`` for a defense that accounts, else None."""
    from defenses.dpsgd import privacy_spent

    for holder in (defense, getattr(defense, "fn", None)):
        if holder is None:
            continue
        declared = getattr(holder, "privacy", None)
        if callable(declared):
            return declared
        sigma, clip = getattr(holder, "noise_multiplier", None), getattr(holder, "clip", None)
        if isinstance(sigma, (int, float)) and isinstance(clip, (int, float)):
            return lambda steps, q, delta, s=float(sigma): privacy_spent(steps, q, s, delta)
    return None


def _identification_bound(sigma: Optional[float], local_steps: int, candidates: Optional[int]) -> Dict[str, Any]:
    """Hayes et al.'s bound for the observed update of a private batch (sampled for sure: q = 1)."""
    from audit.core.reconstruction_bound import identification_bound

    if sigma is None or not candidates:
        return {"unavailable": "needs the defense's noise multiplier and the number of candidates K"}
    value = identification_bound(1.0 / candidates, sigma, steps=local_steps, sample_rate=1.0)
    return {"bound": value, "candidates": candidates, "noise_multiplier": sigma, "steps": local_steps,
            "description": f"no attacker identifies a private image among K = {candidates} candidates (chance "
                           f"1/{candidates}) from one observed update of {local_steps} DP-SGD step(s) with noise "
                           f"multiplier {sigma:g} with probability above {value:.1%} (Hayes, Mahloujifar & Balle "
                           "2023: the power of the most powerful test at level 1/K)"}


def privacy_report(defense: Any, fl, train_size: int, steps: Sequence[int], delta: float = DELTA,
                   candidates: Optional[int] = None) -> Dict[str, Any]:
    """Per audited step, the (epsilon, delta) spent by the DP-SGD steps trained before it:
    ``step x local_steps`` steps at sample rate ``fl.batch_size / the smallest client split``;
    and, with ``candidates`` (K), the bound on identifying a private image among K that one
    observed update (``local_steps`` noised steps of the private batch) allows."""
    name = getattr(defense, "name", "defense")
    account = _accountant(defense)
    if account is None:
        return {"applicable": False,
                "reason": f"defense {name!r} has no (epsilon, delta) accounting (no privacy(steps, sample_rate, "
                          "delta) method, nor a noise_multiplier with a clipping bound clip)"}
    split = train_size // fl.clients  # tensor_split: the smallest client split, the largest rate
    sample_rate = min(1.0, fl.batch_size / max(split, 1))
    per_step = []
    try:
        for step in steps:
            spent = account(int(step) * fl.local_steps, sample_rate, delta)
            per_step.append({"step": int(step), "rounds": int(step) * fl.local_steps, "epsilon": spent.epsilon,
                             "delta": spent.delta, "order": getattr(spent, "order", None)})
    except (GiaError, ValueError, TypeError) as err:
        return {"applicable": False, "reason": f"defense {name!r}: privacy accounting failed ({err})"}
    accountant = getattr(spent, "accountant", "rdp") if per_step else "rdp"
    sigma = getattr(spent, "noise_multiplier", None) if per_step else None
    bound = _identification_bound(sigma, fl.local_steps, candidates)
    return {"identification_bound": bound, "applicable": True, "accountant": accountant, "sample_rate": sample_rate, "delta": delta,
            "noise_multiplier": sigma, "per_step": per_step,
            "description": f"RDP accountant ({accountant}) of the subsampled Gaussian mechanism: noise multiplier "
                           f"{sigma}, sample rate {sample_rate:.4g} = train batch size {fl.batch_size} / the "
                           f"client's train split ({split} images), {fl.local_steps} DP-SGD step(s) per FL round, "
                           f"delta {delta:g}; batches are treated as Poisson-sampled"}
