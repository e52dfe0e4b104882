"""The planner: probe an unknown defense, then pick the attacks that exploit what it does."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from audit.core.reasons import Reason
from audit.core.types import default_loss_fn

from adaptive.planner.probe import probe_defense
from adaptive.planner.rules import ORDER, RULES, PlannedAttack
from adaptive.planner.traits import DefenseTraits


@dataclass
class Plan:
    """The probed traits, the attacks to run (each with its reason, a code the report words)
    and those proposed but not installed."""

    traits: DefenseTraits
    attacks: List[PlannedAttack]
    unavailable: List[PlannedAttack] = field(default_factory=list)

    def names(self) -> List[str]:
        return [a.name for a in self.attacks]

    def get(self, name: str) -> Optional[PlannedAttack]:
        return next((a for a in self.attacks if a.name == name), None)

    def to_dict(self) -> Dict[str, Any]:
        return {"traits": self.traits.to_dict(), "attacks": [a.to_dict() for a in self.attacks],
                "unavailable": [a.to_dict() for a in self.unavailable]}


def _merge(proposals: List[PlannedAttack]) -> List[PlannedAttack]:
    """One entry per attack name, in first-proposed order; settings merged, and where several
    rules propose it, their reasons kept together (code ``planner-several``)."""
    merged: Dict[str, PlannedAttack] = {}
    whys: Dict[str, List[Reason]] = {}
    for p in proposals:
        whys.setdefault(p.name, [])
        if p.why not in whys[p.name]:
            whys[p.name].append(p.why)
        if p.name not in merged:
            merged[p.name] = PlannedAttack(p.name, dict(p.settings), p.why, p.adaptive)
        else:
            merged[p.name].settings = {**p.settings, **merged[p.name].settings}
    for name, found in whys.items():
        if len(found) > 1:
            merged[name].why = Reason("planner-several", reasons=[w.to_dict() for w in found])
    return list(merged.values())


def _installed_attacks() -> Optional[set]:
    try:
        from attacks import ATTACKS
    except ImportError:
        return None
    return set(ATTACKS.names())


def plan_from_traits(traits: DefenseTraits) -> Plan:
    """Apply every registered rule; keep the attacks that are installed."""
    proposals = [p for name in RULES.names() for p in RULES.get(name)(traits)]
    # the baselines first, then the adaptive attacks, most defense-specific first
    rank = {name: i for i, name in enumerate(ORDER)}
    ordered = [p for p in proposals if not p.adaptive] + sorted(
        (p for p in proposals if p.adaptive), key=lambda p: rank.get(p.name, len(rank)))
    merged = _merge(ordered)
    installed = _installed_attacks()
    if installed is None:
        return Plan(traits, merged)
    return Plan(traits, [a for a in merged if a.name in installed],
                [a for a in merged if a.name not in installed])


def plan(
    defense: Callable,
    model: Optional[nn.Module] = None,
    input_shape: Tuple[int, int, int] = (3, 8, 8),
    num_classes: int = 10,
    *,
    seed: int = 0,
    batch_size: int = 8,
    loss_fn=default_loss_fn,
    device=None,
    rounds: Sequence[int] = (),
    client_model: Optional[nn.Module] = None,
) -> Plan:
    """Probe ``defense`` (any defended-gradient callable) and return the attacks to run.

    ``model`` is the probe network (default: a tiny one built for ``input_shape`` and
    ``num_classes``); the defense is treated as a black box, declared knowledge is used
    when present. ``rounds``: FL rounds (the audited steps) probed besides the default ones.
    ``client_model``: ``model`` as the defense's ``wrap_model`` returned it (None: wrapped here).
    """
    traits = probe_defense(defense, model, input_shape, num_classes, seed=seed, batch_size=batch_size,
                           loss_fn=loss_fn, device=device, rounds=rounds, client_model=client_model)
    return plan_from_traits(traits)
