"""The risk report: built from a run's result store, written in every registered format
(:mod:`audit.report.formats`: ``report.json``, ``report.md``, ``report.html``, ``psnr_vs_step.png``).

``render(DIR)`` re-renders a finished (or interrupted) audit from disk; this is what
``gia-audit report DIR`` calls.
"""
from __future__ import annotations

import datetime as _dt
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.errors import ConfigError, StoreError
from audit.core.manifest import Manifest
from audit.core.records import AttackResult, StepReport
from audit.report.risk import (empirical_risk, false_positive_rates, judge_step, nulls_from_manifest, overall_verdict,
                               status_of, summarize_attack)
from audit.report.control import control_entry, judge_with_control
from audit.report.rule import LeakRule
from audit.report.format import control_text, overall_text, progress_text, verdict_text
from audit.report.store import ResultStore, to_jsonable


def _by_step(records: Sequence[AttackResult]) -> Dict[int, Dict[str, List[AttackResult]]]:
    by_step: Dict[int, Dict[str, List[AttackResult]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        by_step[rec.step][rec.attack_id].append(rec)
    return by_step


def buffers_used(by_attack: Dict[str, Sequence[AttackResult]], effect: str) -> str:
    """``the buffers' statistics used`` when an attack of the step matched the statistics the
    uploaded buffers reveal (its trace's code ``bn-upload``), else why not (the defense's
    declared effect on them)."""
    if any(r.trace.uses("bn-upload") for recs in by_attack.values() for r in recs):
        return "the buffers' statistics used"
    return f"the buffers' statistics not used (buffers {effect.split(':')[0]})"


def build_report(manifest: Any, records: Sequence[Any],
                 rule: Optional[LeakRule] = None, control_records: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Every number of the report, as one JSON-able dictionary; ``rule`` (default: the
    audit's) judges the stored evidence, so other thresholds need no recomputation.
    ``control_records``: the positive control's results (``manifest["control"]`` says which
    attacks and budget; :mod:`audit.report.control`); without them no step reads "no recovered image".
    ``manifest``: a :class:`~audit.core.manifest.Manifest` (or its JSON object)."""
    manifest = Manifest.from_dict(manifest)
    thresholds = rule or LeakRule.from_dict(manifest.thresholds)
    records = [AttackResult.from_dict(r) for r in records]
    nulls = nulls_from_manifest(manifest)
    delta = manifest.risk_delta["delta"]
    attack_ids = [a["id"] for a in manifest.attacks]
    images = int(manifest.images)
    by_step = _by_step(records)
    steps = []
    for step in manifest.steps:
        by_attack = {a: by_step[step].get(a, []) for a in attack_ids}
        steps.append({"step": step, "attacks": {a: summarize_attack(recs) for a, recs in by_attack.items()},
                      **judge_step(by_attack, images, thresholds, nulls), "risk": empirical_risk(by_attack, delta)})
    info = manifest.control
    controls: Dict[int, Optional[Dict[str, Any]]] = {}
    if info and control_records is not None:
        control_by_step = _by_step([AttackResult.from_dict(r) for r in control_records])
        for step in manifest.steps:
            mine = {a: control_by_step[step].get(a, []) for a in info.get("attacks", [])}
            controls[step] = {**judge_step(mine, images, thresholds, nulls),
                              "not_applicable": [a for a, recs in mine.items()
                                                 if recs and all(status_of(r) == "not_applicable" for r in recs)]}
    judge_with_control(steps, controls, info, thresholds)
    effect = (manifest.threat_model or {}).get("buffers")
    for step in steps:  # what the uploaded buffers did for this step's verdict (shares="state")
        if effect:
            step["verdict"]["buffers"] = buffers_used(by_step[step["step"]], effect)
    planned = [r for r in records if r.step in manifest.steps and r.attack_id in attack_ids]
    skipped = sum(status_of(r) == "not_applicable" for r in planned)
    progress = {"done": len(planned) - skipped, "total": len(manifest.steps) * len(attack_ids) * images - skipped}
    if skipped:  # results that do not apply count neither as done nor as to do
        progress["not_applicable"] = skipped
    failures = list(manifest.failures or []) + [
        {"step": r.step, "attack": r.attack_id, "image": r.image, "defense": r.defense,
         "status": status_of(r), "error": r.reason}
        for r in records if status_of(r) not in ("ok", "not_applicable")
    ]
    steps = [StepReport.from_dict(s).to_dict() for s in steps]  # each step's entry is the record's JSON
    verdict = overall_verdict(steps)
    return to_jsonable({
        "title": f"gia-audit report: {manifest.defense['name']}",
        "step_name": manifest.step_name or "step",
        "generated": _dt.datetime.now().isoformat(timespec="seconds"),
        "run_key": manifest.run_key,
        "status": run_status(manifest.status or "unknown", steps),
        "progress": progress,
        "not_applicable": not_applicable(steps),
        "verdict": verdict,
        "defense": manifest.defense,
        "differences": list(manifest.differences or []),
        "privacy": manifest.privacy or {"applicable": False, "reason": "not recorded by this audit"},
        "threat_model": manifest.threat_model or {},
        "plan": manifest.plan or {},
        "control": control_entry(manifest.control),
        "attacks": manifest.attacks,
        "thresholds": thresholds.to_dict(),
        "false_positive_rate": false_positive_rates(thresholds, nulls),
        "null": (manifest.null or {}).get("description", {}),
        "chance_level": _mean_chance(nulls),
        "risk_delta": manifest.risk_delta,
        "metric_notes": manifest.metric_notes or [],
        "utility": manifest.utility or {},
        "data": manifest.data or {},
        "settings": manifest.settings or {},
        "config": manifest.config or {"unavailable": "this audit was not built from a config"},
        "seeds": manifest.seeds or {},
        "versions": manifest.versions or {},
        "timing": manifest.timing or {},
        "steps": steps,
        "failures": failures,
        "results": [r.to_dict() for r in records],
    })


def not_applicable(steps: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The attacks none of whose results applied at some step: ``{"attack", "steps", "reason"}``
    each, their steps in order (one entry per attack and reason)."""
    found: Dict[Tuple[str, str], List[int]] = {}
    for s in steps:
        for attack, summary in s["attacks"].items():
            if summary.get("status") == "not applicable":
                found.setdefault((attack, summary.get("reason") or "no reason given"), []).append(s["step"])
    return [{"attack": a, "steps": where, "reason": why} for (a, why), where in found.items()]


def _mean_chance(nulls) -> Optional[float]:
    levels = [n.chance_level for n in nulls.values()]
    return sum(levels) / len(levels) if levels else None


def run_status(stored: str, steps: List[Dict[str, Any]]) -> str:
    """The run's status: a finished run with missing evidence is 'incomplete', never 'complete'."""
    failed = sorted({m["attack"] for s in steps for m in s["verdict"].get("failed_attacks", [])
                     if any(not why.startswith("pending") for why in m["reasons"])})
    if stored == "complete" and failed:
        return f"incomplete ({', '.join(failed)} failed)"
    return stored


def control_records(store: ResultStore, manifest: Manifest) -> Optional[List[AttackResult]]:
    """The positive control's stored results for ``manifest``'s images (its ``control`` entry names
    the folder, relative to the audit's, and the run); None when there is none to read."""
    info = manifest.control
    if not info:
        return None
    if info.get("same_run") and info.get("run_key") == store.key:
        control = store
    else:
        control = ResultStore(store.root / info["dir"], info["run_key"])
        if not (control.dir / "results").is_dir():
            return None
    return [r for r in control.records() if r.image < manifest.images]


class AuditReport:
    """The result of an audit: ``data`` holds every number (the content of ``report.json``).

    ``report.verdict``, ``report.steps`` and ``report.psnr(step, attack)`` give quick access;
    ``report.write(out)`` writes it in every registered format (:mod:`audit.report.formats`).
    """

    def __init__(self, data: Dict[str, Any], run_dir: Optional[Path] = None, out: Optional[Path] = None):
        self.data = data
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.out = Path(out) if out is not None else None

    @classmethod
    def from_store(cls, store: ResultStore, rule: Optional[LeakRule] = None) -> "AuditReport":
        manifest = store.load_manifest(strict=True)
        if not manifest.planned:
            raise ConfigError(f"the audit in {store.root} (run {store.key}) stopped before its attacks were "
                              "planned; rerun the same audit command to continue it")
        absent = [k for k in ("steps", "images", "risk_delta", "defense") if getattr(manifest, k) is None]
        if absent:
            raise StoreError(f"{store.manifest_path} lacks {', '.join(absent)}; rerun the same audit command to "
                             "rebuild it")
        # the run key leaves the image count out (a larger rerun extends a smaller one): a rerun with
        # fewer images reports those it asked for, not every one an earlier run stored
        records = [r for r in store.records() if r.image < manifest.images]
        if store.unreadable:  # a lost result is missing evidence, and the report names it
            lost = [{"phase": "store", "status": "unreadable", "error": why} for why in store.unreadable.values()]
            manifest = manifest.updated(status="incomplete (unreadable stored results)",
                                        failures=list(manifest.failures or []) + lost)
        return cls(build_report(manifest, records, rule, control_records(store, manifest)), store.dir, store.root)

    def to_dict(self) -> Dict[str, Any]:
        """The report as one JSON-able record (what ``report.json`` holds)."""
        return self.data

    @classmethod
    def from_dict(cls, data: Dict[str, Any], run_dir: Optional[Path] = None,
                  out: Optional[Path] = None) -> "AuditReport":
        """The report of a record :meth:`to_dict` wrote (``report.json``): it renders as written."""
        return cls(dict(data), run_dir, out)

    # ------------------------------------------------------------------ access
    @property
    def verdict(self) -> str:
        return self.data["verdict"]["label"]

    @property
    def steps(self) -> List[Dict[str, Any]]:
        return self.data["steps"]

    @property
    def failures(self) -> List[Dict[str, Any]]:
        return self.data["failures"]

    @property
    def step_reports(self) -> List[StepReport]:
        """The audited steps as :class:`~audit.core.records.StepReport` records."""
        return [StepReport.from_dict(s) for s in self.steps]

    def step(self, step: int) -> Dict[str, Any]:
        for entry in self.steps:
            if entry["step"] == step:
                return entry
        raise KeyError(f"step {step} was not audited; audited steps: {[s['step'] for s in self.steps]}")

    def psnr(self, step: int, attack: Optional[str] = None) -> Optional[float]:
        """Mean PSNR of ``attack`` at ``step`` (default: the worst case over attacks)."""
        entry = self.step(step)
        return entry["worst_case"]["psnr"] if attack is None else entry["attacks"][attack]["psnr"]

    # ------------------------------------------------------------------ output
    def to_markdown(self) -> str:
        from audit.report.markdown import render_markdown

        return render_markdown(self.data)

    def to_html(self) -> str:
        from audit.report.html import render_html

        return render_html(self.data, self.run_dir)

    def plot_png(self) -> bytes:
        from audit.report.plots import psnr_vs_step_png

        return psnr_vs_step_png(self.data)

    def write(self, out: Optional[os.PathLike | str] = None) -> Dict[str, Path]:
        """Write the report in every registered format; the paths by file name."""
        from audit.report.formats import write_report

        out = Path(out) if out is not None else self.out
        if out is None:
            raise ValueError("AuditReport.write needs an output directory")
        paths = write_report("audit", self, out)
        self.out = out
        return paths

    def summary(self) -> str:
        """A few lines for the terminal."""
        column = self.data.get("step_name") or "step"
        lines = [f"{self.data['title']}  [{self.data['status']}, {progress_text(self.data)}]"]
        for entry in self.steps:
            wc, risk = entry["worst_case"], entry["risk"]
            psnr = "n/a" if wc["psnr"] is None else f"{wc['psnr']:.2f} dB"
            success = "n/a" if risk["success"] is None else f"{risk['success']:.0%}"
            best = "" if wc.get("psnr_max") is None else f", best-recovered image {wc['psnr_max']:.2f} dB"
            lines.append(f"  {column} {entry['step']:>5}: mean PSNR over images {psnr} (each at its strongest attack)"
                         f"{best}, within delta {success}; without the defense: {control_text(entry.get('control'))}; "
                         f"verdict: {verdict_text(entry['verdict'])}")
        lines.append(f"verdict: {overall_text(self.data['verdict'], column)}")
        if self.failures:
            lines.append(f"{len(self.failures)} failure(s); see the report's 'Failures' section")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"AuditReport(verdict={self.verdict!r}, steps={[s['step'] for s in self.steps]}, out={self.out})"

    def _repr_html_(self) -> str:  # notebooks
        return self.to_html()


def render(out: os.PathLike | str, run: Optional[str] = None, thresholds: Any = None) -> AuditReport:
    """Re-render the report of the audit stored in ``out`` (``run``: a run key; default latest)
    from the stored evidence; ``thresholds`` (a LeakRule, dict or ``"margin_db=2,..."``)
    re-judges it under another rule without recomputing anything."""
    rule = None if thresholds is None else LeakRule.of(thresholds)
    report = AuditReport.from_store(ResultStore.open_latest(out, run), rule)
    report.write(out)
    return report
