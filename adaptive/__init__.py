"""Adaptive attacks (attacks that use knowledge of the defense) and the planner that probes
an unknown defense and picks them.

Importing this package registers its attacks in :data:`attacks.ATTACKS` (through-defense,
mask-replay, layer-drop, censor-invariants, svd-subspace, precode-latent, conv-span-completed,
conv-span-denoised, bayes-optimal, learned-inverter); ``attacks`` itself never imports ``adaptive``.
"""
from adaptive import censor_invariants, masking, precode_latent, span_through, svd_subspace, through_defense  # noqa: F401,E501
from adaptive.bayes import optimal as _bayes_optimal  # noqa: F401
from adaptive.inverter import attack as _learned_inverter  # noqa: F401
from adaptive.planner.plan import Plan, plan, plan_from_traits
from adaptive.planner.probe import probe_defense, probe_network
from adaptive.planner.rules import RULES, PlannedAttack
from adaptive.planner.traits import DefenseTraits, LayerProbe

__all__ = ["plan", "plan_from_traits", "Plan", "PlannedAttack", "RULES", "probe_defense", "probe_network",
           "DefenseTraits", "LayerProbe"]
