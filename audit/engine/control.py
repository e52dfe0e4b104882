"""The positive control beside every verdict: the same attacks' base forms, at the same budget
and seeds, on the same private images, against the client that uploads *without* the defense.

A defended step with no recovered image says as much about the attacks' power as about the
defense. The control separates the two: where it recovers none of the images either, the step
is "inconclusive (attack power)"; where it recovers k of them, "no recovered image" comes with
"the defense stops k of k" and an exact paired test (:mod:`audit.report.control`).

The control is an audit of the undefended client (defense ``none``) with the audited settings
otherwise unchanged: model, data, seeds, steps, FL training and what the client shares
(:class:`ControlInputs`: the audited config with defense ``none``, and the parts it shares with
the audit: the data, the model, the null, the private batches; a sweep's undefended cell and a
Flower round's replica supply their own). The control holds no reference to the audit it
calibrates. Its results live in its own result store (``OUT/control`` by default), keyed like
every result, so they resume and are reused.

``budget="auto"`` finds the attacks' power first: the control of the first audited step runs at
:data:`SEARCH_START` gradient evaluations and doubles until it recovers at least half of that
step's images or reaches ``max_budget``; the defended audit then runs at the budget found.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from attacks import ATTACKS
from attacks.presets import uses_budget
from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.engine.compose import AuditParts
from audit.engine.config import AuditConfig, config_of_sections
from audit.engine.null import Null, null_evidence
from audit.engine.settings import DEFAULT_BUDGET, Sections
from audit.report.risk import judge_step
from audit.report.store import ResultStore

#: where an audit keeps its control's results, under its output folder
CONTROL_DIR = "control"
#: the budget search starts at the fixed default budget and doubles
SEARCH_START = DEFAULT_BUDGET
#: the adaptive attacks' base form where they name none: the optimisation attack they adapt
DEFAULT_BASE = "ig"


def is_adaptive(name: str) -> bool:
    """Whether the registered attack ``name`` is defense-aware (registered by :mod:`adaptive`)."""
    return getattr(ATTACKS.get(name), "__module__", "").startswith("adaptive")


def base_form(name: str, settings: Dict[str, Any]) -> str:
    """The attack an adaptive attack adapts (its ``base`` setting, else the ``base`` its class
    declares, else :data:`DEFAULT_BASE`); a plain attack is its own base form."""
    if not is_adaptive(name):
        return name
    base = settings.get("base", getattr(ATTACKS.get(name), "base", None))
    return base if isinstance(base, str) and base in ATTACKS and not is_adaptive(base) else DEFAULT_BASE


def control_specs(specs: Sequence[Any], args: Dict[str, Dict[str, Any]]) -> List[Any]:
    """The control's attacks: each audited attack's base form, once, in order. A plain attack
    keeps its settings (and so its seeds and stored results); an adaptive attack's base form
    runs with the user's settings for that base (``args``), as the audit's own base attacks do."""
    out: Dict[str, Any] = {}
    for spec in specs:
        base = base_form(spec.name, spec.settings)
        if base == spec.name:
            out.setdefault(base, replace(spec, settings=dict(spec.settings), kind="base"))
        elif base not in out:
            out[base] = type(spec)(base, dict(args.get(base, {})), Reason("attack-base-form", of=spec.name), "base")
    return list(out.values())


@dataclass
class ControlStep:
    """The control's judgement of one step (``judge_step``'s output) and where it came from."""

    step: int
    judged: Dict[str, Any]

    @property
    def recovered(self) -> int:
        return int(self.judged["verdict"]["recovered"])

    @property
    def images(self) -> int:
        return int(self.judged["verdict"]["images"])


@dataclass
class BudgetSearch:
    """How ``budget="auto"`` found the budget: each tried budget with the control's recovered
    images at the first audited step, the budget chosen and what ended the search (a code; the
    report says it in words, :func:`audit.report.control.search_text`)."""

    start: int
    max_budget: int
    max_minutes: float = math.inf
    tried: List[Dict[str, Any]] = field(default_factory=list)
    budget: Optional[int] = None
    #: what ended the search: "recovered" (half the images), "max_budget" or "max_minutes"
    stopped_by: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ControlInputs:
    """What the positive control is made of: ``config``, the audited config with defense
    ``none`` (the control at a budget and steps is this config with them); what it shares with
    the audit, built once: ``parts`` (the undefended client on the audit's data and model),
    ``null`` and ``private`` (the private batches); where its results go (``out``; ``root``: the
    audit's folder, which the manifest's entry is relative to; ``same_run``: the audit is its own
    control); ``code``: what it ran, as a code (:data:`audit.report.control.CONTROL_KINDS` words it); ``kind``, the audit class that runs it, with its
    keywords ``extra`` besides the config (a federation round, the images the round trained on)."""

    config: AuditConfig
    parts: AuditParts
    null: Null
    private: Tuple[Any, ...]
    out: Path
    root: Path
    same_run: bool
    code: str
    kind: Any
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, sections: Sections, parts: AuditParts, null: Null, private: Sequence[Any], out: Path,
           same_run: bool, code: str, kind: Any, extra: Mapping[str, Any]) -> "ControlInputs":
        """The control of an audit of ``sections`` (its config without the defense), writing to
        ``out``, or, when it is the audit's own (``same_run``), to the audit's folder."""
        root = Path(sections.output_settings.out)
        return cls(config_of_sections(sections).undefended(), parts, null, tuple(private),
                   root if same_run else Path(out), root, same_run, code, kind, dict(extra))

    def audit_at(self, budget: int, steps: Sequence[int]) -> Any:
        """The control's audit at ``budget`` on ``steps``: its config with them, on the shared parts."""
        config = self.config.replace(steps=tuple(steps), budget=int(budget), out=str(self.out))
        return self.kind.from_config(config, parts=self.parts, null=self.null, progress_label="control", **self.extra)


def control_inputs(audit: Any) -> ControlInputs:
    """The control's inputs of an :class:`~audit.engine.audit.Audit`, as it reads them off itself
    once (:meth:`~audit.engine.audit.Audit.control_inputs`)."""
    return audit.control_inputs()


class PositiveControl:
    """The control of one audit (see the module docstring): ``search`` the budget, ``run`` the
    control at it on every audited step, and ``describe`` where its results are for the report.
    ``inputs``: :class:`ControlInputs` (an audit reads them off itself once: :func:`control_inputs`)."""

    def __init__(self, inputs: ControlInputs):
        if not isinstance(inputs, ControlInputs):
            raise TypeError("PositiveControl takes ControlInputs; build them with control_inputs(audit)")
        self.inputs = inputs
        self._audits: Dict[Tuple[int, Tuple[int, ...]], Any] = {}

    # ------------------------------------------------------------------ where and what
    @property
    def same_run(self) -> bool:
        """True when the audited defense is the identity and the audit simulates its client:
        then the audit is its own control (one store, one key)."""
        return self.inputs.same_run

    def out(self) -> Path:
        return self.inputs.out

    def specs(self, specs: Sequence[Any]) -> List[Any]:
        return control_specs(specs, self.inputs.config.sections().attack_settings.args)

    def audit_at(self, budget: int, steps: Sequence[int]) -> Any:
        """The control's audit at ``budget`` on ``steps`` (built once per pair)."""
        key = (int(budget), tuple(steps))
        if key not in self._audits:
            self._audits[key] = self.inputs.audit_at(budget, steps)
        return self._audits[key]

    # ------------------------------------------------------------------ running
    def run(self, specs: Sequence[Any], budget: int, steps: Sequence[int]) -> ResultStore:
        """The control's store at ``budget`` on ``steps``, computing what is not stored (the
        report judges it; :meth:`judge` is the search's own reading)."""
        control = self.audit_at(budget, steps)
        store = ResultStore.create(self.out(), control.key_settings(), retry_errors=control.output_settings.retry_errors)
        control.run_attacks(store, self.specs(specs))
        return store

    def judge(self, store: ResultStore, specs: Sequence[Any], steps: Sequence[int]) -> Dict[int, ControlStep]:
        inputs, images = self.inputs, self.inputs.config.images
        nulls = {(i, j): e for i, batch in enumerate(null_evidence(inputs.null, inputs.private))
                 for j, e in enumerate(batch)}
        ids = [s.id for s in specs]
        records = [r for r in store.records() if r.attack_id in ids and r.image < images]
        out = {}
        for step in steps:
            by_attack = {a: [r for r in records if r.step == step and r.attack_id == a] for a in ids}
            out[step] = ControlStep(step, judge_step(by_attack, images, inputs.config.sections().output_settings.thresholds,
                                                     nulls))
        return out

    def search_budget(self, specs: Sequence[Any], attacks: Any) -> BudgetSearch:
        """``budget="auto"``'s search for ``attacks`` (the audit's attack settings) from :data:`SEARCH_START`."""
        return self.search(specs, SEARCH_START, attacks.max_budget, attacks.max_minutes)

    def search(self, specs: Sequence[Any], start: int, max_budget: int,
               max_minutes: float = math.inf) -> BudgetSearch:
        """Double the budget from ``start`` until the control recovers at least half of the first
        audited step's images, ``max_budget`` is reached, or the next doubling (which costs about
        twice the last try) would end past ``max_minutes`` of search."""
        first = min(self.inputs.config.steps)
        found = BudgetSearch(start, max_budget, max_minutes)
        budget, began = start, time.perf_counter()
        while True:
            tried_at = time.perf_counter()
            step = self.judge(self.run(specs, budget, (first,)), self.specs(specs), (first,))[first]
            now = time.perf_counter()
            need = math.ceil(step.images / 2) if step.images else 1
            found.tried.append({"budget": budget, "step": first, "recovered": step.recovered, "images": step.images,
                                "seconds": round(now - tried_at, 1)})
            found.budget = budget
            if step.images and step.recovered >= need:
                found.stopped_by = "recovered"
                return found
            found.stopped_by = ("max_budget" if budget * 2 > max_budget else
                                "max_minutes" if (now - began + 2 * (now - tried_at)) / 60 > max_minutes else "")
            if found.stopped_by:
                return found
            budget *= 2

    def describe(self, store: ResultStore, specs: Sequence[Any], budget: int,
                 search: Optional[BudgetSearch]) -> Dict[str, Any]:
        """The manifest's ``control`` entry: where its results are (relative to the audit's
        output folder), which attacks, at which budget, and how the budget was found."""
        root = self.inputs.root.resolve()
        where = Path(store.root).resolve()
        rel = Path(os.path.relpath(where, root)).as_posix()
        return {"dir": rel, "run_key": store.key, "same_run": self.same_run, "budget": int(budget),
                "attacks": [s.id for s in self.specs(specs)], "defense": "none",
                "kind": self.inputs.code,
                **({"search": search.to_dict()} if search is not None else {})}


def check_budget_search(names: Sequence[str], max_budget: int, start: int = SEARCH_START) -> None:
    """``budget="auto"``'s bad inputs, before any work: a ceiling below the start, or attacks
    named by the user none of which spends a budget (doubling cannot give them power)."""
    if max_budget < start:
        raise ConfigError(f"max_budget {max_budget} is below the budget search's start {start}; give "
                          f"--max-budget {start} or more, or a fixed --budget")
    named = [n for n in names if n != "auto"]
    fixed = [n for n in named if n in ATTACKS and not uses_budget(n)]
    if named and len(fixed) == len(names):
        raise ConfigError(f"--budget auto searches the budget of attacks that spend one, but {', '.join(fixed)} "
                          "spends none (closed form): give a fixed --budget, or add an optimisation attack")
