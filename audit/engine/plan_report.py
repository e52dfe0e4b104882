"""What ``gia-audit plan`` prints: resolve a defense, probe it, list the planned attacks."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

from adaptive.planner.plan import plan
from audit.core.metrics import to_jsonable
from audit.core.models import build_model
from audit.engine.compose import resolve_defense


def plan_report(defense: Any = None, defense_args: Optional[Dict[str, Any]] = None, *, model: Optional[str] = None,
                size: int = 8, channels: int = 3, num_classes: int = 10, seed: int = 0, device=None,
                as_json: bool = False) -> str:
    """What ``gia-audit plan`` prints: probe a defense given by name / import path / object
    and list the attacks with their reasons (or the plan as JSON)."""
    resolved = resolve_defense(defense, defense_args or {})
    shape = (int(channels), int(size), int(size))
    net = None if model is None else build_model(model, shape, num_classes, seed=seed)
    if net is not None and device is not None:
        net = net.to(device)
    result = plan(resolved, net, shape, num_classes, seed=seed, device=device)
    if as_json:
        return json.dumps(to_jsonable(result.to_dict()), indent=2)
    return "\n".join(result.summary())
