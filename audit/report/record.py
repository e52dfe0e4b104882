"""The audit report as one typed record: what ``report.json`` holds and every format renders.

:func:`audit.report.audit_report.build_report` makes it from a run's manifest and results;
the formats (:mod:`audit.report.formats`) render it; ``Report.from_dict`` reads a stored
``report.json`` back. Its JSON is the flat object of its fields (keys it does not know, e.g.
a per-round report's ``rounds``, are kept in ``extra`` and written back as they were).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from audit.core.manifest import FlatRecord
from audit.core.records import AttackResult, StepReport


@dataclass(frozen=True)
class Report(FlatRecord):
    """Every number of one audit's report.

    ``title``; ``step_name``: what a step is called ("step", "round"); ``status`` and
    ``progress``; ``not_applicable``: the attacks that did not apply, with their steps and the
    reason in words; ``verdict``: the overall verdict; ``steps``: one :class:`StepReport` per
    audited step; ``results``: every stored :class:`AttackResult`; ``failures``: what went
    wrong; the rest is the manifest's, as the report words it (``plan``, ``control``,
    ``threat_model``, ``thresholds``, the null, ``utility``, ``settings``, ``config``, ...).
    """

    title: str = ""
    progress: Dict[str, Any] = field(default_factory=dict)
    not_applicable: List[Dict[str, Any]] = field(default_factory=list)
    verdict: Dict[str, Any] = field(default_factory=dict)
    defense: Dict[str, Any] = field(default_factory=dict)
    differences: List[str] = field(default_factory=list)
    step_name: str = "step"
    privacy: Dict[str, Any] = field(default_factory=dict)
    threat_model: Dict[str, Any] = field(default_factory=dict)
    plan: Dict[str, Any] = field(default_factory=dict)
    attacks: List[Dict[str, Any]] = field(default_factory=list)
    run_key: Optional[str] = None
    control: Dict[str, Any] = field(default_factory=dict)
    thresholds: Dict[str, Any] = field(default_factory=dict)
    false_positive_rate: Dict[str, Any] = field(default_factory=dict)
    generated: str = ""
    null: Dict[str, Any] = field(default_factory=dict)
    risk_delta: Dict[str, Any] = field(default_factory=dict)
    chance_level: Optional[float] = None
    metric_notes: List[str] = field(default_factory=list)
    status: str = "unknown"
    utility: Dict[str, Any] = field(default_factory=dict)
    data: Dict[str, Any] = field(default_factory=dict)
    settings: Dict[str, Any] = field(default_factory=dict)
    config: Dict[str, Any] = field(default_factory=dict)
    steps: List[StepReport] = field(default_factory=list)
    seeds: Dict[str, Any] = field(default_factory=dict)
    versions: Dict[str, Any] = field(default_factory=dict)
    timing: Dict[str, Any] = field(default_factory=dict)
    failures: List[Dict[str, Any]] = field(default_factory=list)
    results: List[AttackResult] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)
    keeps_none = True  # every section is in report.json, an unknown number as null

    def __post_init__(self):
        object.__setattr__(self, "steps", [StepReport.from_dict(s) for s in self.steps])
        object.__setattr__(self, "results", [AttackResult.from_dict(r) for r in self.results])

    @classmethod
    def of(cls, report: Any) -> "Report":
        """``report`` as a record (a :class:`Report`, or its JSON object)."""
        return cls.from_dict(report)

    # ------------------------------------------------------------------ access
    @property
    def label(self) -> str:
        """The overall verdict's label."""
        return self.verdict.get("label", "")

    def step(self, step: int) -> StepReport:
        """The audited step ``step`` (KeyError naming the audited ones)."""
        for entry in self.steps:
            if entry.step == step:
                return entry
        raise KeyError(f"step {step} was not audited; audited steps: {[s.step for s in self.steps]}")

    def results_at(self, step: int) -> List[AttackResult]:
        """The stored results of ``step``."""
        return [r for r in self.results if r.step == step]

    @property
    def attack_ids(self) -> List[str]:
        """The planned attacks' ids, in the plan's order."""
        return [a["id"] for a in self.attacks]

