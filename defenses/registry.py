"""The defense registry: every built-in defense registers its class here by name."""
from __future__ import annotations

from audit.core.registry import Registry
from audit.core.types import Defense

DEFENSES = Registry("defense")


def build_defense(name: str, **params) -> Defense:
    """Build a registered defense; bad names / parameters raise ConfigError listing the valid ones."""
    return DEFENSES.build(name, **params)
