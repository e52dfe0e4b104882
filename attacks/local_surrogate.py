"""The client's optimiser as the attacker's replica unrolls it.

The replica unrolls the client's real rule (:mod:`audit.core.local_training`) with one change
where the exact rule misleads the attack: Adam's update ``m / (sqrt(v) + eps)`` is close to
the gradient's sign, a step function of the image whose slope promises decreases of the match
that a step does not deliver. The replica smooths it into a soft sign by raising ``eps`` by
:data:`ADAM_RELATIVE_EPS` times each tensor's gradient RMS; momentum, bias correction, the
second moment across steps and weight decay stay exact.
"""
from __future__ import annotations

from typing import Optional

from audit.core.local_training import LocalOptimizer
from audit.core.reasons import Reason

#: Adam's eps in units of each tensor's gradient RMS, for the replica (``bench/bench_strength.py
#: --adam-smoothing``, chosen on held-out embedded images; bench/results/strength/strength.md (The weights of what a client uploads))
ADAM_RELATIVE_EPS = 3.0
SMOOTHED = ("adam", "adamw")


def replica_optimizer(optimizer: LocalOptimizer, relative_eps: Optional[float] = None) -> LocalOptimizer:
    """``optimizer`` as the replica unrolls it (Adam / AdamW smoothed by ``relative_eps``,
    default :data:`ADAM_RELATIVE_EPS`, 0 for the exact rule; every other rule exact)."""
    relative_eps = ADAM_RELATIVE_EPS if relative_eps is None else relative_eps
    if optimizer.name in SMOOTHED and not optimizer.relative_eps and relative_eps:
        return optimizer.with_(relative_eps=relative_eps)
    return optimizer


def replica_note(optimizer: LocalOptimizer) -> Reason:
    """For the trace: which rule the replica unrolls, and how far it departs from it (the
    smoothed eps, where the exact rule's near-sign update is a step function of the image)."""
    used = replica_optimizer(optimizer)
    if used is optimizer:
        return Reason("unrolled-exactly", optimizer=optimizer.describe())
    return Reason("unrolled-smoothed", optimizer=optimizer.describe(), eps=used.relative_eps)
