"""Adaptive attacks (attacks that use knowledge of the defense) and the planner that probes
an unknown defense and picks them."""
from .plan import Plan, plan, plan_from_traits
from .probe import probe_defense, probe_network
from .rules import RULES, PlannedAttack
from .traits import DefenseTraits, LayerProbe

__all__ = ["plan", "plan_from_traits", "Plan", "PlannedAttack", "RULES", "probe_defense", "probe_network",
           "DefenseTraits", "LayerProbe"]
