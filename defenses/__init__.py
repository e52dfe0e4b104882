"""Reference implementations of gradient-inversion defenses, registered by name.

>>> from defenses import build_defense
>>> defense = build_defense("prune", ratio=0.9)
>>> shared = defense(model, inputs, labels, loss_fn=loss_fn, generator=generator)
"""
from defenses.registry import DEFENSES, build_defense

# importing the modules registers the defenses
from defenses import identity, noise, clip, dpsgd, prune, quantize, soteria, precode, ats, censor, svdefense, refiner, decoy, flower  # noqa: E402,F401
from defenses.resolve import call_defense, check_output, defense_name, resolve_defense  # noqa: E402

__all__ = ["DEFENSES", "build_defense", "resolve_defense", "check_output", "call_defense", "defense_name"]
