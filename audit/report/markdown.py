"""``report.md``: the report as Markdown tables (the image grids are in ``report.html``)."""
from __future__ import annotations

import json
from typing import Any, Dict, List

from audit.report.format import (attack_cell, attack_header, attack_row, evidence_header, evidence_notes,
                                 evidence_rows, kv_rows, overall_text, plan_traits, privacy_header, privacy_rows,
                                 progress_text, step_name, summary_header, summary_row, unavailable_notes, utility_rows)
from audit.report.formats.registry import report_file


def _table(header: List[str], rows: List[List[Any]]) -> List[str]:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return out


def _summary_section(data: Dict[str, Any]) -> List[str]:
    name = step_name(data)
    return ([f"## Leakage per {name['title']}", ""]
            + _table(summary_header(name["column"]), [summary_row(s) for s in data["steps"]]))


def _evidence_section(data: Dict[str, Any]) -> List[str]:
    rows = [row for s in data["steps"] for row in evidence_rows(s)]
    return (["## Evidence per private image (against chance)", ""]
            + _table(evidence_header(step_name(data)["column"]), rows) + [""]
            + [f"- {note}" for note in evidence_notes(data)])


def _attack_section(data: Dict[str, Any]) -> List[str]:
    ids, column = [a["id"] for a in data["attacks"]], step_name(data)["column"]
    rows = [[s["step"]] + [attack_cell(s["attacks"][a]) for a in ids] for s in data["steps"]]
    lines = ["## PSNR (dB) per attack", ""] + _table([column] + ids, rows)
    for aid in ids:
        lines += ["", f"### {aid}", ""] + _table(attack_header(column), [attack_row(s, aid) for s in data["steps"]])
    notes = unavailable_notes(data)
    if notes:
        lines += [""] + [f"- {m.upper()} unavailable: {why}" for m, why in notes.items()]
    return lines


def _differences_section(data: Dict[str, Any]) -> List[str]:
    if not data.get("differences"):
        return []
    return (["## Where this defense differs from its paper / the authors' code", ""]
            + [f"- {d}" for d in data["differences"]])


def _privacy_section(data: Dict[str, Any]) -> List[str]:
    rows, note = privacy_rows(data.get("privacy", {}), data["steps"])
    lines = ["## Privacy spent ((epsilon, delta))", ""]
    if rows is None:
        return lines + [note]
    return lines + _table(privacy_header(step_name(data)["column"]), rows) + ["", note]


def _definitions(data: Dict[str, Any]) -> List[str]:
    delta = data["risk_delta"]
    return [
        "## Definitions", "",
        f"- **Leak rule**: {data['thresholds']['rule']}",
        "- **Worst case**: per private image, the most leaking attack for each metric; averaged over images.",
        f"- **Within delta** (the Bayes paper's empirical adversarial risk): the fraction of private "
        f"images the strongest attack reconstructs within l2 distance delta = {delta['delta']:.3f} "
        f"({delta['description']}); the paper's risk R = 1 - this fraction.",
    ] + [f"- {note}" for note in data.get("metric_notes", [])]


def _threat_section(data: Dict[str, Any]) -> List[str]:
    lines = ["## Threat model (what the attacker was given)", ""]
    lines += [f"- **{k}**: {v}" for k, v in kv_rows(data["threat_model"])]
    lines += ["", "## Attacks and why they were chosen", ""]
    rows = [[a["id"], a.get("kind", ""), json.dumps(a.get("settings", {})), a.get("reason", "")]
            for a in data["attacks"]]
    lines += _table(["attack", "kind", "settings", "reason"], rows)
    traits = plan_traits(data["plan"])
    if traits:
        lines += ["", "Defense traits found by probing:", ""]
        lines += [f"- {k}: {v}" for k, v in kv_rows(traits)]
    side = (data.get("plan") or {}).get("side_information") or {}
    if side:
        lines += ["", "Side information the attacks use beyond the shared weights:", ""]
        lines += [f"- {k}: {v}" for k, v in side.items()]
    return lines


def _utility_section(data: Dict[str, Any]) -> List[str]:
    rows, note = utility_rows(data["utility"])
    lines = ["## Utility (defense against no defense)", ""]
    if rows is None:
        return lines + [f"unavailable: {note}"]
    return lines + _table(["", "with the defense", "without"], rows) + ["", note]


def _failure_section(data: Dict[str, Any]) -> List[str]:
    if not data["failures"]:
        return []
    rows = [[f.get("step", ""), f.get("attack", ""), f.get("image", ""), f.get("defense", ""),
             f.get("status", f.get("phase", "")), f.get("error", "")] for f in data["failures"]]
    return ["## Failures", ""] + _table([step_name(data)["column"], "attack", "image", "defense", "status", "error"],
                                        rows)


def _settings_section(data: Dict[str, Any]) -> List[str]:
    lines = ["## Settings, seeds and versions", ""]
    for title in ("defense", "data", "settings", "seeds", "versions", "timing"):
        rows = [[k, v] for k, v in kv_rows(data[title])]
        if rows:
            lines += [f"### {title}", ""] + _table(["key", "value"], rows) + [""]
    return lines


def render_markdown(data: Dict[str, Any]) -> str:
    verdict, name = data["verdict"], step_name(data)
    head = [f"# {data['title']}", "",
            f"**Verdict: {overall_text(verdict, name['column'])}**",
            "",
            f"Status: {data['status']}, {progress_text(data)}. Run `{data['run_key']}`, "
            f"generated {data['generated']}. "
            f"Reconstruction grids: see `{report_file('audit', 'html')}`.", "",
            f"![PSNR versus {name['title']}]({report_file('audit', 'png')})", ""]
    sections = [_summary_section, _evidence_section, _attack_section, _differences_section, _privacy_section, _definitions,
                _threat_section, _utility_section, _failure_section, _settings_section]
    lines = head
    for section in sections:
        part = section(data)
        if part:
            lines += part + [""]
    return "\n".join(lines).replace("<", "&lt;")  # user strings (names, errors) never become HTML
