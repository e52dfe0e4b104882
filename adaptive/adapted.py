"""Adaptive attacks composed from the optimisation attack.

An :class:`AdaptedAttack` is an optimisation preset (``ig`` by default) whose settings are
adapted to each observation: a subclass's :meth:`AdaptedAttack.adapt` returns the knobs it
changes (the shared-gradient simulator, per-layer objective weights / masks, the
objective, the initialisation) and notes for the trace. Everything else (priors,
optimiser, restarts, labels) is the optimisation attack's, so an adaptive attack and the naive preset
it adapts differ only in what is matched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from attacks.optimization import OptimizationAttack, Progress, not_grouped
from attacks.presets import ATTACKS, KNOBS, compose
from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.core.types import Observation, Reconstruction


@dataclass
class Adaptation:
    """What an adaptive attack changes for one observation."""

    knobs: Dict[str, Any] = field(default_factory=dict)
    notes: Dict[str, Any] = field(default_factory=dict)
    skip: Optional[Reason] = None  # why the attack does not apply (a code; the report words it)


class AdaptedAttack:
    """``reconstruct(observation, budget, seed)``: the ``base`` preset with :meth:`adapt`'s
    knobs; ``knobs`` are any :data:`attacks.presets.KNOBS` (e.g. ``tv=``, ``restarts=``)."""

    name = "adapted"
    #: knobs the adaptation sets itself; a user may not override them
    owns: Tuple[str, ...] = ()

    def __init__(self, base: str = "ig", **knobs: Any):
        defaults = getattr(ATTACKS.get(base), "defaults", None)
        if defaults is None:
            raise ConfigError(f"{self.name}: base {base!r} is not an optimisation preset; use one of "
                              "dlg, idlg, ig, gi, bayes-l2, bayes-l1, bayes-cos")
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise ConfigError(f"{self.name}: unknown settings {unknown}; valid: {', '.join(sorted(KNOBS))}")
        clash = sorted(set(knobs) & set(self.owns))
        if clash:
            raise ConfigError(f"{self.name} sets {clash} itself from the observation; leave them out")
        self.base, self.knobs = base, dict(knobs)
        self.settings = {**defaults, **knobs}

    @property
    def iterations(self) -> int:
        return int(self.settings["iterations"])

    def adapt(self, observation: Observation) -> Adaptation:
        """The knobs for this observation (subclasses)."""
        return Adaptation()

    def compose(self, observation: Observation, adaptation: Optional[Adaptation] = None) -> OptimizationAttack:
        adaptation = adaptation or self.adapt(observation)
        return compose(self.name, explicit={*self.knobs, *adaptation.knobs}, **{**self.settings, **adaptation.knobs})

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Progress] = None) -> Reconstruction:
        return self.adapted_one(observation, self.adapt(observation), budget, seed, progress)

    def adapted_one(self, observation: Observation, adaptation: Adaptation, budget: Optional[int], seed: int,
                    progress: Optional[Progress]) -> Reconstruction:
        """The preset with ``adaptation``'s knobs on one observation."""
        if adaptation.skip:
            return Reconstruction.not_applicable(adaptation.skip, **adaptation.notes)
        rec = self.compose(observation, adaptation).reconstruct(observation, budget, seed, progress)
        rec.trace["adaptive"] = {"attack": self.name, "base": self.base, **adaptation.notes}
        return rec

    def reconstruct_many(self, observations: Sequence[Observation], budget: Optional[int] = None,
                         seeds: Optional[Sequence[int]] = None, progress: Optional[Progress] = None,
                         max_members: int = 64) -> List[Reconstruction]:
        """Several observations of one model as one batched run when every observation gets
        the same adaptation (replay, EOT, dropped layers, masks read from each target); one at
        a time, with the reason in the trace, when the adaptation holds per-observation
        tensors or the attack reconstructs in its own way."""
        seeds = list(seeds) if seeds is not None else [0] * len(observations)
        if type(self).reconstruct is not AdaptedAttack.reconstruct:
            out = [self.reconstruct(o, budget, s, progress) for o, s in zip(observations, seeds)]
            for rec in out:
                rec.trace["grouped"] = not_grouped(Reason("own-reconstruct"))
            return out
        return self.adapted_many(observations, [self.adapt(o) for o in observations], budget, seeds, progress,
                                 max_members)

    def adapted_many(self, observations: Sequence[Observation], adaptations: Sequence[Adaptation],
                     budget: Optional[int], seeds: Sequence[int], progress: Optional[Progress],
                     max_members: int) -> List[Reconstruction]:
        """:meth:`adapted_one` for each observation, as one batched run where the adaptations agree."""
        signatures = {_signature(a) for a in adaptations}
        why = (Reason("adaptation-skips") if any(a.skip for a in adaptations)
               else Reason("adaptation-per-observation") if None in signatures or len(signatures) > 1
               else None)
        if why:
            out = [self.adapted_one(o, a, budget, s, progress) for o, a, s in zip(observations, adaptations, seeds)]
            for rec in out:
                rec.trace["grouped"] = not_grouped(why)
            return out
        attack = self.compose(observations[0], adaptations[0])
        out = attack.reconstruct_many(observations, budget, seeds, progress, max_members=max_members)
        for rec, adaptation in zip(out, adaptations):
            rec.trace["adaptive"] = {"attack": self.name, "base": self.base, **adaptation.notes}
        return out


def _signature(adaptation: Adaptation) -> Optional[str]:
    """A comparable description of an adaptation's knobs; None when a knob holds tensors
    (per-observation data that cannot be shared by a grouped run)."""
    parts = []
    for key, value in sorted(adaptation.knobs.items()):
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, torch.Tensor) for v in items):
            return None
        described = [v.describe() if hasattr(v, "describe") else repr(v) for v in items]
        parts.append(f"{key}={described}")
    return ";".join(parts)


def register(cls, description: str):
    """Register an :class:`AdaptedAttack` subclass in :data:`attacks.ATTACKS` under its name."""
    ATTACKS.add(cls.name, cls, description)
    return cls
