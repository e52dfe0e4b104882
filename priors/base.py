"""The prior interface shared by every image prior.

A prior is called once per restart: ``prior(x, context) -> scalar`` with ``x`` the dummy
batch ``(B, C, H, W)`` in image space and ``context`` a :class:`PriorContext`. It must be
pure torch (it runs under ``torch.func.vmap`` over restarts). A prior that needs side
information names it in ``requires``: ``"bn_stats"`` (the observation model's BatchNorm
running statistics; checked before the attack starts), ``"bn_steps"`` (every local step's
BatchNorm input statistics, for the statistics the client's uploaded buffers reveal) or ``"group_mean"`` (the optimisation run then
fills ``context.group_mean``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from torch import Tensor

from audit.core.registry import Registry

PRIORS = Registry("prior")


@dataclass
class PriorContext:
    """Per-evaluation information a prior may use.

    * ``iteration`` -- the optimiser step (group consistency switches on at a step); an
      int, or an object whose ``.iteration`` is the step, read only when a prior asks (so a
      compiled attack loss whose priors never ask is not specialised on the step);
    * ``features`` -- computed on this restart's dummy batch by the simulator, e.g.
      ``features["bn"]``: ``[(mean, var), ...]`` of every BatchNorm input, in module order;
    * ``bn_running`` -- the observation model's BatchNorm running ``(mean, var)`` (or None);
    * ``group_mean`` -- the mean image batch over all restarts, detached (or None);
    * ``observation`` -- the observation (read-only);
    * ``revealed`` -- the batch statistics the client's uploaded buffers reveal
      (:class:`~audit.core.buffers.RevealedStatistics`, this member's), or None.
    """

    step: Any = 0
    features: Dict[str, Any] = field(default_factory=dict)
    bn_running: Optional[List[Tuple[Tensor, Tensor]]] = None
    group_mean: Optional[Tensor] = None
    observation: Any = None
    revealed: Any = None

    def __init__(self, iteration: Any = 0, features: Optional[Dict[str, Any]] = None,
                 bn_running: Optional[List[Tuple[Tensor, Tensor]]] = None, group_mean: Optional[Tensor] = None,
                 observation: Any = None, revealed: Any = None):
        self.step, self.features, self.bn_running = iteration, {} if features is None else features, bn_running
        self.group_mean, self.observation, self.revealed = group_mean, observation, revealed

    @property
    def iteration(self) -> int:
        return self.step if isinstance(self.step, int) else int(self.step.iteration)


class Prior:
    """Base class: a named image prior; lower is more plausible."""

    name = "prior"
    requires: FrozenSet[str] = frozenset()

    def __call__(self, x: Tensor, context: PriorContext) -> Tensor:
        raise TypeError(f"{type(self).__name__} must implement __call__")

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{self.name}({args})"


def requiring(priors: Sequence[Tuple[str, Any, float]], what: str) -> List[str]:
    """The keys of the ``(key, prior, weight)`` entries whose prior ``requires`` ``what``."""
    return [key for key, prior, _ in priors if what in getattr(prior, "requires", ())]


def weighted_total(terms: Dict[str, Tensor], priors: Sequence[Tuple[str, Any, float]]) -> Tensor:
    """The attack loss: ``terms["match"] + sum_k w_k terms[k]`` over the ``(key, prior, weight)``
    entries with a non-zero weight."""
    total = terms["match"]
    for key, _, weight in priors:
        if weight != 0.0:
            total = total + weight * terms[key]
    return total
