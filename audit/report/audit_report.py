"""The risk report: built from a run's result store, written in every registered format
(:mod:`audit.report.formats`: ``report.json``, ``report.md``, ``report.html``, ``psnr_vs_step.png``).

``render(DIR)`` re-renders a finished (or interrupted) audit from disk; this is what
``gia-audit report DIR`` calls.
"""
from __future__ import annotations

import datetime as _dt
import os
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.errors import ConfigError, StoreError
from audit.core.manifest import Manifest
from audit.core.records import AttackResult, StepReport
from audit.core.jsonable import to_jsonable
from audit.report.risk import (empirical_risk, false_positive_rates, judge_step, nulls_from_manifest, overall_verdict,
                               status_of, summarize_attack)
from audit.report.control import control_entry, control_summary, controlled_verdict
from audit.report.rule import LeakRule
from audit.report.format import control_text, overall_text, progress_text, verdict_text
from audit.report.reasons import word
from audit.report.record import Report
from audit.report.store import ResultStore


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


def judge_steps(manifest: Manifest, records: Sequence[AttackResult], thresholds: LeakRule, nulls,
                control_records: Optional[Sequence[AttackResult]]) -> List[StepReport]:
    """One :class:`StepReport` per audited step, each built once from its judged evidence: the
    attacks' summaries, the worst case and verdict, the risk, the control's summary and the
    verdict it qualifies, and what the uploaded buffers did for it (``shares="state"``)."""
    attack_ids, images, info = [a["id"] for a in manifest.attacks], int(manifest.images), manifest.control
    by_step = _by_step(records)
    control_by_step = _by_step(control_records) if info and control_records is not None else None
    effect = (manifest.threat_model or {}).get("buffers")
    steps = []
    for step in manifest.steps:
        by_attack = {a: by_step[step].get(a, []) for a in attack_ids}
        judged = judge_step(by_attack, images, thresholds, nulls)
        control = control_summary(_control_judged(control_by_step, step, info, images, thresholds, nulls),
                                  info or {}, thresholds)
        verdict = controlled_verdict(judged["verdict"], judged["worst_case"].per_image, control)
        if effect:
            verdict = replace(verdict, buffers=buffers_used(by_step[step], effect))
        steps.append(StepReport(step=step, attacks={a: summarize_attack(recs) for a, recs in by_attack.items()},
                                worst_case=judged["worst_case"], verdict=verdict,
                                risk=empirical_risk(by_attack, manifest.risk_delta["delta"]), control=control))
    return steps


def _control_judged(control_by_step, step: int, info, images: int, thresholds: LeakRule, nulls):
    """The control's ``judge_step`` at ``step`` with the attacks that did not apply; None without a control."""
    if control_by_step is None:
        return None
    mine = {a: control_by_step[step].get(a, []) for a in info.get("attacks", [])}
    return {**judge_step(mine, images, thresholds, nulls),
            "not_applicable": [a for a, recs in mine.items()
                               if recs and all(status_of(r) == "not_applicable" for r in recs)]}


def build_report(manifest: Any, records: Sequence[Any],
                 rule: Optional[LeakRule] = None, control_records: Optional[Sequence[Any]] = None) -> Report:
    """The report of a run as one :class:`~audit.report.record.Report`: ``rule`` (default: the
    audit's) judges the stored evidence, so other thresholds need no recomputation.
    ``control_records``: the positive control's results (``manifest["control"]`` says which
    attacks and budget; :mod:`audit.report.control`); without them no step reads "no recovered image".
    ``manifest``: a :class:`~audit.core.manifest.Manifest` (or its JSON object). The codes the
    run stored (reasons, the plan's side information) are worded here."""
    manifest = Manifest.from_dict(manifest)
    thresholds = rule or LeakRule.stored(manifest.thresholds)
    records = [AttackResult.from_dict(r) for r in records]
    controls = None if control_records is None else [AttackResult.from_dict(r) for r in control_records]
    nulls = nulls_from_manifest(manifest)
    attack_ids = [a["id"] for a in manifest.attacks]
    steps = judge_steps(manifest, records, thresholds, nulls, controls)
    planned = [r for r in records if r.step in manifest.steps and r.attack_id in attack_ids]
    skipped = sum(status_of(r) == "not_applicable" for r in planned)
    progress = {"done": len(planned) - skipped,
                "total": len(manifest.steps) * len(attack_ids) * int(manifest.images) - skipped}
    if skipped:  # results that do not apply count neither as done nor as to do
        progress["not_applicable"] = skipped
    failures = list(manifest.failures or []) + [
        {"step": r.step, "attack": r.attack_id, "image": r.image, "defense": r.defense,
         "status": status_of(r), "error": r.reason}
        for r in records if status_of(r) not in ("ok", "not_applicable")
    ]
    return Report(
        title=f"gia-audit report: {manifest.defense['name']}", step_name=manifest.step_name or "step",
        generated=_dt.datetime.now().isoformat(timespec="seconds"), run_key=manifest.run_key,
        status=run_status(manifest.status or "unknown", steps), progress=progress,
        not_applicable=not_applicable(steps), verdict=overall_verdict(steps), **declared(manifest),
        thresholds=thresholds.to_dict(), false_positive_rate=false_positive_rates(thresholds, nulls),
        chance_level=_mean_chance(nulls), steps=steps, failures=failures, results=records)


def declared(manifest: Manifest) -> Dict[str, Any]:
    """The report's entries that are the manifest's as the run declared them, as the report
    words them (its plan, control and attacks; what a run did not record, said so)."""
    return dict(
        defense=manifest.defense, differences=list(manifest.differences or []),
        privacy=manifest.privacy or {"applicable": False, "reason": "not recorded by this audit"},
        threat_model=manifest.threat_model or {}, plan=worded_plan(manifest.plan or {}),
        control=control_entry(manifest.control), attacks=worded_attacks(manifest.attacks),
        null=(manifest.null or {}).get("description", {}), risk_delta=manifest.risk_delta,
        metric_notes=manifest.metric_notes or [], utility=manifest.utility or {}, data=manifest.data or {},
        settings=manifest.settings or {},
        config=manifest.config or {"unavailable": "this audit was not built from a config"},
        seeds=manifest.seeds or {}, versions=manifest.versions or {}, timing=manifest.timing or {})


def worded_plan(plan: Dict[str, Any]) -> Dict[str, Any]:
    """The plan with its side information, its probe's notes and failure in words (stored as
    codes; a plan stored with sentences keeps them)."""
    out = dict(plan)
    if out.get("side_information"):
        out["side_information"] = {k: word(v) for k, v in out["side_information"].items()}
    for key in ("error", "model_mode"):
        if out.get(key):
            out[key] = word(out[key])
    if out.get("traits"):
        traits = out["traits"] = dict(out["traits"])
        if "notes" in traits:
            traits["notes"] = [word(n) for n in traits["notes"] or []]
        if traits.get("input_transform_source"):
            traits["input_transform_source"] = word(traits["input_transform_source"])
    return out


def worded_attacks(attacks: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The audit's attacks, each with why it runs in words (``reason``) beside its code
    (``why``); an entry stored with a sentence keeps it."""
    return [{**a, "reason": word(a["why"])} if a.get("why") else dict(a) for a in attacks or []]


def not_applicable(steps: Sequence[Any]) -> List[Dict[str, Any]]:
    """The attacks none of whose results applied at some step: ``{"attack", "steps", "reason"}``
    each, their steps in order (one entry per attack and reason); ``steps``: :class:`StepReport`
    records or their JSON objects."""
    found: Dict[Tuple[str, str], List[int]] = {}
    for s in map(StepReport.from_dict, steps):
        for attack, summary in s.attacks.items():
            if summary.status == "not applicable":
                found.setdefault((attack, summary.reason or "no reason given"), []).append(s.step)
    return [{"attack": a, "steps": where, "reason": why} for (a, why), where in found.items()]


def _mean_chance(nulls) -> Optional[float]:
    levels = [n.chance_level for n in nulls.values()]
    return sum(levels) / len(levels) if levels else None


def run_status(stored: str, steps: Sequence[StepReport]) -> str:
    """The run's status: a finished run with missing evidence is 'incomplete', never 'complete'."""
    failed = sorted({m["attack"] for s in steps for m in s.verdict.failed_attacks
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
    """The result of an audit: ``record`` holds every number (a :class:`~audit.report.record.Report`);
    ``data`` is its JSON object (the content of ``report.json``).

    ``report.verdict``, ``report.steps`` and ``report.psnr(step, attack)`` give quick access;
    ``report.write(out)`` writes it in every registered format (:mod:`audit.report.formats`).
    """

    def __init__(self, record: Any, run_dir: Optional[Path] = None, out: Optional[Path] = None):
        self.record = Report.from_dict(record)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.out = Path(out) if out is not None else None
        self._data: Optional[Dict[str, Any]] = None

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

    @property
    def data(self) -> Dict[str, Any]:
        """The report's JSON object (what ``report.json`` holds), made once."""
        if self._data is None:
            self._data = to_jsonable(self.record.to_dict())
        return self._data

    def to_dict(self) -> Dict[str, Any]:
        """The report as one JSON-able record (what ``report.json`` holds)."""
        return self.data

    @classmethod
    def from_dict(cls, data: Dict[str, Any], run_dir: Optional[Path] = None,
                  out: Optional[Path] = None) -> "AuditReport":
        """The report of a record :meth:`to_dict` wrote (``report.json``): it renders as written."""
        return cls(Report.from_dict(data), run_dir, out)

    # ------------------------------------------------------------------ access
    @property
    def verdict(self) -> str:
        return self.record.label

    @property
    def steps(self) -> List[Dict[str, Any]]:
        return self.data["steps"]

    @property
    def failures(self) -> List[Dict[str, Any]]:
        return self.record.failures

    @property
    def step_reports(self) -> List[StepReport]:
        """The audited steps as :class:`~audit.core.records.StepReport` records."""
        return self.record.steps

    def step(self, step: int) -> Dict[str, Any]:
        return self.record.step(step).to_dict()

    def psnr(self, step: int, attack: Optional[str] = None) -> Optional[float]:
        """Mean PSNR of ``attack`` at ``step`` (default: the worst case over attacks)."""
        entry = self.record.step(step)
        return entry.worst_case.psnr if attack is None else entry.attacks[attack].psnr

    # ------------------------------------------------------------------ output
    def to_markdown(self) -> str:
        from audit.report.markdown import render_markdown

        return render_markdown(self.record)

    def to_html(self) -> str:
        from audit.report.html import render_html

        return render_html(self.record, self.run_dir)

    def plot_png(self) -> bytes:
        from audit.report.plots import psnr_vs_step_png

        return psnr_vs_step_png(self.record)

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
        report = self.record
        column = report.step_name or "step"
        lines = [f"{report.title}  [{report.status}, {progress_text(report)}]"]
        for entry in report.steps:
            wc, risk = entry.worst_case, entry.risk
            psnr = "n/a" if wc.psnr is None else f"{wc.psnr:.2f} dB"
            success = "n/a" if risk.success is None else f"{risk.success:.0%}"
            best = "" if wc.psnr_max is None else f", best-recovered image {wc.psnr_max:.2f} dB"
            lines.append(f"  {column} {entry.step:>5}: mean PSNR over images {psnr} (each at its strongest attack)"
                         f"{best}, within delta {success}; without the defense: {control_text(entry.control)}; "
                         f"verdict: {verdict_text(entry.verdict)}")
        lines.append(f"verdict: {overall_text(report.verdict, column)}")
        if report.failures:
            lines.append(f"{len(report.failures)} failure(s); see the report's 'Failures' section")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"AuditReport(verdict={self.verdict!r}, steps={[s.step for s in self.record.steps]}, out={self.out})"

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
