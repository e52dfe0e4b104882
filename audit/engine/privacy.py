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


def privacy_report(defense: Any, fl, train_size: int, steps: Sequence[int], delta: float = DELTA) -> Dict[str, Any]:
    """Per audited step, the (epsilon, delta) spent by the DP-SGD steps trained before it:
    ``step x local_steps`` steps at sample rate ``fl.batch_size / the smallest client split``."""
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
    return {"applicable": True, "accountant": accountant, "sample_rate": sample_rate, "delta": delta,
            "noise_multiplier": sigma, "per_step": per_step,
            "description": f"RDP accountant ({accountant}) of the subsampled Gaussian mechanism: noise multiplier "
                           f"{sigma}, sample rate {sample_rate:.4g} = train batch size {fl.batch_size} / the "
                           f"client's train split ({split} images), {fl.local_steps} DP-SGD step(s) per FL round, "
                           f"delta {delta:g}; batches are treated as Poisson-sampled"}
