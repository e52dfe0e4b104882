"""What ``gia-audit plan`` prints: resolve a defense, probe it, list the planned attacks."""
from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Optional

from adaptive.planner.plan import Plan, plan
from adaptive.planner.traits import DefenseTraits
from audit.core.jsonable import to_jsonable
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
    lines = trait_lines(found.traits)
    for a in found.attacks:
        tag = "adaptive" if a.adaptive else "baseline"
        opts = ", ".join(f"{k}={v}" for k, v in a.settings.items())
        lines.append(f"- {a.name} [{tag}{': ' + opts if opts else ''}]: {word(a.why)}")
    for a in found.unavailable:
        lines.append(f"- ({a.name} not installed): {word(a.why)}")
    return lines


def trait_lines(traits: DefenseTraits) -> List[str]:
    """One line per notable trait the probe found, then its notes."""
    t = traits
    on = [k for k, v in t.flags().items() if v]
    lines = [f"probed defense {t.name!r}", "traits: " + (", ".join(on) if on else "none")]
    if t.changed_layers:
        lines.append(f"layers changed: {len(t.changed_layers)}/{len(t.layers)} "
                     f"({', '.join(t.changed_layers[:6])}{'...' if len(t.changed_layers) > 6 else ''})")
    if t.sparse:
        lines.append(f"extra exact zeros: {t.sparsity:.1%} of the changed entries")
    if t.noise_std is not None:
        family = f", {t.noise_family}" if t.noise_family else ""
        lines.append(f"noise std ~{t.noise_std:.3g} ({t.noise_relative:.2g} x clean RMS{family})")
    if t.rank_reduced_layers:
        lines.append("rank reduced in: " + ", ".join(t.rank_reduced_layers))
    lines.append(f"input transform: {bool(t.input_transform)} ({word(t.input_transform_source)})")
    probe = t.rounds_probe
    if probe.get("calls"):
        where = f" at rounds {', '.join(map(str, probe['clean_rounds']))}" if probe.get("clean_rounds") else ""
        lines.append(f"clean gradient (or an exact multiple) shared in {probe['clean_calls']} of "
                     f"{probe['calls']} round/checkpoint probe calls{where}")
    return lines + [word(n) for n in t.notes]
