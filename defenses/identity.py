"""The undefended baseline (the class lives with the contracts: the client simulation uses it too)."""
from __future__ import annotations

from audit.core.types import NoDefense

from defenses.registry import DEFENSES

DEFENSES.register("none", "No defense: the client shares its clean gradient")(NoDefense)
