"""What ``gia-audit plan`` prints: resolve a defense, probe it, list the planned attacks."""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Optional

from adaptive.planner.plan import Plan, plan
from audit.core.metrics import to_jsonable
from audit.core.models import build_model
from audit.engine.compose import client_model, resolve_defense, resolve_device
from audit.report.reasons import word


def plan_report(defense: Any = None, defense_args: Optional[Dict[str, Any]] = None, *, model: Optional[str] = None,
                size: int = 8, channels: int = 3, num_classes: int = 10, seed: int = 0, device=None,
                as_json: bool = False) -> str:
    """What ``gia-audit plan`` prints: probe a defense given by name / import path / object
    and list the attacks with their reasons (or the plan as JSON)."""
    resolved = resolve_defense(defense, defense_args or {})
    device = None if device is None else resolve_device(device)
    shape = (int(channels), int(size), int(size))
    net = wrapped = None  # no model: the planner's probe network, wrapped by the planner
    if model is not None:
        net = build_model(model, shape, num_classes, seed=seed)
        net = net.to(device) if device is not None else net
        wrapped = client_model(resolved, copy.deepcopy(net), seed)
    result = plan(resolved, net, shape, num_classes, seed=seed, device=device, client_model=wrapped)
    if as_json:
        return json.dumps(to_jsonable(result.to_dict()), indent=2)
    return "\n".join(plan_lines(result))


def plan_lines(found: Plan) -> List[str]:
    """The plan in lines: the probed traits, then each attack with why it runs."""
    lines = list(found.traits.summary())
    for a in found.attacks:
        tag = "adaptive" if a.adaptive else "baseline"
        opts = ", ".join(f"{k}={v}" for k, v in a.settings.items())
        lines.append(f"- {a.name} [{tag}{': ' + opts if opts else ''}]: {word(a.why)}")
    for a in found.unavailable:
        lines.append(f"- ({a.name} not installed): {word(a.why)}")
    return lines
