"""Which attacks an audit runs: the base attacks, the model's classic attacks and the planner's
defense-aware ones (the planner probes the defense as a black box), or the user's names, with
the user's settings over the planner's; planned on the audit as built
(:class:`~audit.engine.built.BuiltRun`)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import nn

from adaptive import plan_from_traits, probe_defense  # importing adaptive registers its attacks in ATTACKS
from attacks import ATTACKS
from attacks.classic import classic_attacks
from attacks.presets import defaults_fingerprint
from audit.core.errors import GiaError
from audit.core.reasons import Reason
from audit.core.preflight import runs
from audit.engine.built import BuiltRun
from audit.engine.probe_cache import cached_probe

# the portfolio of plain strategies (docs/strength.md), and IG alone: at small budgets IG's full
# share can beat the portfolio's pick, and the verdict takes the strongest attack
BASE_ATTACKS = ("portfolio", "ig")


@dataclass
class AttackSpec:
    """One attack of the audit: registry name, settings, why it runs (a code the report words;
    None for a check of the user's settings alone), base or adaptive."""

    name: str
    settings: Dict[str, Any] = field(default_factory=dict)
    why: Optional[Reason] = None
    kind: str = "base"

    @property
    def id(self) -> str:
        """The attack's name in the report; its settings are checked on resume instead."""
        return self.name

    @cached_property
    def defaults(self) -> str:
        """The fingerprint of what the attack runs with its settings left out (checked on resume;
        computed once per spec, as the registry does not change during an audit)."""
        return defaults_fingerprint(self.name)

    def to_dict(self) -> Dict[str, Any]:
        return {"id": self.id, "name": self.name, "settings": dict(self.settings),
                "why": None if self.why is None else self.why.to_dict(), "kind": self.kind}


def plan(run: BuiltRun, key: Dict[str, Any]) -> Tuple[List[AttackSpec], Dict[str, Any]]:
    """The attacks the audit ``run`` runs (base + the planner's adaptive ones) and the plan for the
    report; the probe's traits are kept under the run's ``key`` settings (:func:`cached_probe`)."""
    parts, steps = run.parts, run.attack_settings.steps
    probe_model, probe_note = planner_model(parts.base_model, parts.dataset)
    try:
        client_probe, _ = planner_model(parts.model, parts.dataset)
        traits = cached_probe(
            run.output_settings.out, key, steps,
            lambda: probe_defense(parts.defense, probe_model, parts.dataset.input_shape, parts.dataset.num_classes,
                                  seed=run.seed, device=parts.device, rounds=steps, client_model=client_probe))
        found = plan_from_traits(traits)
        plan_dict = {**found.to_dict(), **({"model_mode": probe_note.to_dict()} if probe_note else {})}
    except GiaError as err:  # e.g. the defense fails on the planner's probe batch
        failed = Reason("planner-probe-failed", error=type(err).__name__, message=str(err))
        found, plan_dict = None, {"error": failed.to_dict()}
    proposed = [] if found is None else [
        AttackSpec(a.name, dict(a.settings), a.why, "adaptive" if a.adaptive else "base") for a in found.attacks]
    classic = [AttackSpec(n, {}, Reason("attack-classic", why=why.to_dict()))
               for n, why in classic_attacks(parts.base_model)]
    auto = [AttackSpec(n, {}, Reason("attack-base")) for n in BASE_ATTACKS] + classic
    auto = [s for k, s in enumerate(auto) if s.name not in {p.name for p in proposed}
            and s.name not in {a.name for a in auto[:k]}] + proposed
    by_name = {p.name: p for p in proposed}
    specs: Dict[str, AttackSpec] = {}
    args = run.attack_settings.args
    for name in run.attack_settings.names:  # "auto" may be combined with names
        for spec in auto if name == "auto" else [by_name.get(name) or AttackSpec(name, {}, Reason("attack-requested"))]:
            specs.setdefault(spec.id, spec)
    check_attacks([*specs.values(), *(AttackSpec(n, kv) for n, kv in args.items())])
    for spec in specs.values():  # the user's settings override the planner's
        spec.settings.update(args.get(spec.name, {}))
    return list(specs.values()), plan_dict


def planner_model(model: nn.Module, dataset) -> Tuple[nn.Module, Optional[Reason]]:
    """A copy of ``model`` for the planner, whose probe runs single images too: in eval mode
    (with the reason) when train-mode BatchNorm cannot run a batch of 1 (a 1x1 feature map)."""
    probe = copy.deepcopy(model)
    if runs(probe, dataset.input_shape, dataset.num_classes, 1, "train"):
        return probe, None
    return probe.eval(), Reason("planner-probe-eval-mode")


def check_attacks(specs: Sequence[AttackSpec]) -> None:
    """An unknown attack name, or a bad setting of the user's, as a one-line ConfigError now."""
    for spec in specs:
        ATTACKS.get(spec.name)  # an unknown name raises ConfigError listing the valid ones
        if spec.why is None:  # the user's settings: a bad one is an error now, not in every result
            ATTACKS.build(spec.name, **spec.settings)
