"""The undefended baseline."""
from __future__ import annotations

from audit.types import Defense

from .registry import DEFENSES


@DEFENSES.register("none", "No defense: the client shares its clean gradient")
class NoDefense(Defense):
    """Shares the clean gradient unchanged."""

    name = "none"
    stochastic = False
