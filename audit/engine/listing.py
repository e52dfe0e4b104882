"""What ``gia-audit list`` prints: a registry's names with one-line descriptions."""
from __future__ import annotations

import importlib
from typing import List

REGISTRIES = {
    "models": ("audit.core.models", "MODELS"),
    "datasets": ("audit.core.data", "DATASETS"),
    "attacks": ("audit.engine.single", "ATTACKS"),  # imports adaptive, which registers its attacks
    "defenses": ("defenses", "DEFENSES"),
}


def registry_lines(what: str) -> List[str]:
    """One ``name  description`` line per entry of the registry ``what`` (a key of :data:`REGISTRIES`)."""
    module, attr = REGISTRIES[what]
    registry = getattr(importlib.import_module(module), attr)
    width = max(len(n) for n in registry.names())
    return [f"{name:<{width}}  {desc}" for name, desc in registry.items()]
