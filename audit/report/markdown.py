"""``report.md``: the report as Markdown tables (the image grids are in ``report.html``)."""
from __future__ import annotations

import json
from typing import Any, List

from audit.report.format import (SETTINGS_SECTIONS, attack_cell, attack_header, attack_row, evidence_header,
                                 evidence_notes, evidence_rows, failure_header, failure_rows, kv_rows, overall_text,
                                 plan_traits, privacy_header, privacy_rows, progress_text, step_name, summary_header,
                                 summary_row, unavailable_notes, utility_rows)
from audit.report.formats.registry import report_file
from audit.report.record import Report


def _table(header: List[str], rows: List[List[Any]]) -> List[str]:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return out


def _summary_section(report: Report) -> List[str]:
    name = step_name(report)
    return ([f"## Leakage per {name['title']}", ""]
            + _table(summary_header(name["column"]), [summary_row(s) for s in report.steps]))


def _evidence_section(report: Report) -> List[str]:
    rows = [row for s in report.steps for row in evidence_rows(s)]
    return (["## Evidence per private image (against chance)", ""]
            + _table(evidence_header(step_name(report)["column"]), rows) + [""]
            + [f"- {note}" for note in evidence_notes(report)])


def _attack_section(report: Report) -> List[str]:
    ids, column = report.attack_ids, step_name(report)["column"]
    rows = [[s.step] + [attack_cell(s.attacks[a]) for a in ids] for s in report.steps]
    lines = ["## PSNR (dB) per attack", ""] + _table([column] + ids, rows)
    for aid in ids:
        lines += ["", f"### {aid}", ""] + _table(attack_header(column), [attack_row(s, aid) for s in report.steps])
    notes = unavailable_notes(report)
    if notes:
        lines += [""] + [f"- {m.upper()} unavailable: {why}" for m, why in notes.items()]
    return lines


def _differences_section(report: Report) -> List[str]:
    if not report.differences:
        return []
    return (["## Where this defense differs from its paper / the authors' code", ""]
            + [f"- {d}" for d in report.differences])


def _privacy_section(report: Report) -> List[str]:
    rows, note = privacy_rows(report.privacy, report.steps)
    lines = ["## Privacy spent ((epsilon, delta))", ""]
    if rows is None:
        return lines + [note]
    return lines + _table(privacy_header(step_name(report)["column"]), rows) + ["", note]


def _definitions(report: Report) -> List[str]:
    delta = report.risk_delta
    return [
        "## Definitions", "",
        f"- **Leak rule**: {report.thresholds['rule']}",
        "- **Worst case**: per private image, the most leaking attack for each metric; averaged over images.",
        f"- **Within delta** (the Bayes paper's empirical adversarial risk): the fraction of private "
        f"images the strongest attack reconstructs within l2 distance delta = {delta['delta']:.3f} "
        f"({delta['description']}); the paper's risk R = 1 - this fraction.",
    ] + [f"- {note}" for note in report.metric_notes]


def _threat_section(report: Report) -> List[str]:
    lines = ["## Threat model (what the attacker was given)", ""]
    lines += [f"- **{k}**: {v}" for k, v in kv_rows(report.threat_model)]
    lines += ["", "## Attacks and why they were chosen", ""]
    rows = [[a["id"], a.get("kind", ""), json.dumps(a.get("settings", {})), a.get("reason", "")]
            for a in report.attacks]
    lines += _table(["attack", "kind", "settings", "reason"], rows)
    traits = plan_traits(report.plan)
    if traits:
        lines += ["", "Defense traits found by probing:", ""]
        lines += [f"- {k}: {v}" for k, v in kv_rows(traits)]
    side = report.plan.get("side_information") or {}
    if side:
        lines += ["", "Side information the attacks use beyond the shared weights:", ""]
        lines += [f"- {k}: {v}" for k, v in side.items()]
    return lines


def _utility_section(report: Report) -> List[str]:
    rows, note = utility_rows(report.utility)
    lines = ["## Utility (defense against no defense)", ""]
    if rows is None:
        return lines + [f"unavailable: {note}"]
    return lines + _table(["", "with the defense", "without"], rows) + ["", note]


def _failure_section(report: Report) -> List[str]:
    if not report.failures:
        return []
    return ["## Failures", ""] + _table(failure_header(report), failure_rows(report))


def _settings_section(report: Report) -> List[str]:
    lines = ["## Settings, seeds and versions", ""]
    for title in SETTINGS_SECTIONS:
        rows = [[k, v] for k, v in kv_rows(getattr(report, title))]
        if rows:
            lines += [f"### {title}", ""] + _table(["key", "value"], rows) + [""]
    return lines


def render_markdown(report: Any) -> str:
    """``report.md`` of ``report`` (a :class:`Report`, or its JSON object)."""
    report = Report.of(report)
    name = step_name(report)
    head = [f"# {report.title}", "",
            f"**Verdict: {overall_text(report.verdict, name['column'])}**",
            "",
            f"Status: {report.status}, {progress_text(report)}. Run `{report.run_key}`, "
            f"generated {report.generated}. "
            f"Reconstruction grids: see `{report_file('audit', 'html')}`.", "",
            f"![PSNR versus {name['title']}]({report_file('audit', 'png')})", ""]
    sections = [_summary_section, _evidence_section, _attack_section, _differences_section, _privacy_section, _definitions,
                _threat_section, _utility_section, _failure_section, _settings_section]
    lines = head
    for section in sections:
        part = section(report)
        if part:
            lines += part + [""]
    return "\n".join(lines).replace("<", "&lt;")  # user strings (names, errors) never become HTML
