"""``report.html``: one self-contained page (CSS inline, every PNG embedded as base64)."""
from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any, List, Optional

from audit.core.records import StepReport
from audit.report.format import (SETTINGS_SECTIONS, attack_cell, attack_header, attack_row, evidence_header,
                                 evidence_notes, evidence_rows, failure_header, failure_rows, fmt, kv_rows,
                                 overall_text, plan_traits, privacy_header, privacy_rows, progress_text, step_name,
                                 summary_header, summary_row, unavailable_notes, utility_rows)
from audit.report.images import file_data_uri
from audit.report.reasons import word
from audit.report.record import Report

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:14px}
th{background:#f3f3f3}.verdict{display:inline-block;padding:.3em .8em;border-radius:4px;color:#fff;font-weight:bold}
.v-leaks{background:#c0392b}.v-partially{background:#d68910}.v-no{background:#1e8449}.v-na{background:#777}
.v-incomplete{background:#7d3c98}
.grid img{image-rendering:pixelated;height:72px}.grid td{text-align:center;font-size:12px}
pre{background:#f7f7f7;padding:.6em;overflow:auto;font-size:12px}.muted{color:#777}
"""


def _verdict_badge(label: str) -> str:
    cls = {"leaks": "v-leaks", "partially": "v-partially", "no recovered image": "v-no",
           "incomplete": "v-incomplete"}.get(label, "v-na")
    return f'<span class="verdict {cls}">{escape(label)}</span>'


def html_table(header: List[str], rows: List[List[str]], raw: bool = False) -> str:
    """An HTML table (cells escaped unless ``raw``); shared by the audit and sweep reports."""
    def cell(v: Any) -> str:
        return str(v) if raw else escape(str(v))

    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(run_dir: Optional[Path], rel: Optional[str], alt: str) -> str:
    if run_dir is None or not rel or not (run_dir / rel).is_file():
        return '<span class="muted">no image</span>'
    return f'<img alt="{escape(alt)}" src="{file_data_uri(run_dir / rel)}">'


def _grid(report: Report, step: StepReport, run_dir: Optional[Path]) -> str:
    """Rows: the private batches, then each attack; columns: the audited images. The private
    batches' pictures are in the step's ``originals`` (default ``originals``) under ``run_dir``."""
    images = range(int(report.settings.get("images", 0)))
    records = {(r.attack_id, r.image): r for r in report.results_at(step.step)}
    originals = step.originals or "originals"
    rows = [["original"] + [_img(run_dir, f"{originals}/i{i}.png", f"private image {i}") for i in images]]
    for aid in report.attack_ids:
        row = [escape(aid)]
        for i in images:
            rec = records.get((aid, i))
            status = None if rec is None else getattr(rec.status, "value", rec.status)
            if rec is None:
                row.append('<span class="muted">pending</span>')
            elif status != "ok":
                why = rec.not_applicable_reason if status == "not_applicable" else rec.reason
                row.append(f'<span class="muted" title="{escape(word(why) if why else "")}">'
                           f'{escape(str(status).replace("_", " "))}</span>')
            else:
                caption = f"{fmt('psnr', rec.metrics.psnr if rec.metrics else None)} dB"
                row.append(_img(run_dir, rec.png, f"{aid} image {i}") + f"<br>{caption}")
        rows.append(row)
    header = [""] + [f"image {i}" for i in images]
    return f'<div class="grid">{html_table(header, rows, raw=True)}</div>'


def _summary(report: Report) -> str:
    return html_table(summary_header(step_name(report)["column"]), [summary_row(s) for s in report.steps])


def _per_attack(report: Report) -> str:
    ids, column = report.attack_ids, step_name(report)["column"]
    parts = [html_table([column] + ids, [[s.step] + [attack_cell(s.attacks[a]) for a in ids] for s in report.steps])]
    for aid in ids:
        parts.append(f"<h3>{escape(aid)}</h3>"
                     + html_table(attack_header(column), [attack_row(s, aid) for s in report.steps]))
    notes = unavailable_notes(report)
    if notes:
        parts.append("<ul>" + "".join(f"<li>{escape(m.upper())} unavailable: {escape(why)}</li>"
                                      for m, why in notes.items()) + "</ul>")
    return "".join(parts)


def _differences(report: Report) -> str:
    if not report.differences:
        return '<p class="muted">none declared</p>'
    return "<ul>" + "".join(f"<li>{escape(d)}</li>" for d in report.differences) + "</ul>"


def _privacy(report: Report) -> str:
    rows, note = privacy_rows(report.privacy, report.steps)
    if rows is None:
        return f"<p>{escape(note)}</p>"
    return html_table(privacy_header(step_name(report)["column"]), rows) + f"<p>{escape(note)}</p>"


def _kv(obj: Any) -> str:
    rows = [[k, v if isinstance(v, str) else json.dumps(v)] for k, v in kv_rows(obj)]
    return html_table(["key", "value"], rows) if rows else '<p class="muted">none</p>'


def _attacks(report: Report) -> str:
    rows = [[a["id"], a.get("kind", ""), json.dumps(a.get("settings", {})), a.get("reason", "")]
            for a in report.attacks]
    traits = plan_traits(report.plan)
    extra = f"<h3>Defense traits found by probing</h3>{_kv(traits)}" if traits else ""
    side = report.plan.get("side_information") or {}
    if side:
        extra += f"<h3>Side information the attacks use beyond the shared weights</h3>{_kv(side)}"
    return html_table(["attack", "kind", "settings", "reason"], rows) + extra


def _utility(report: Report) -> str:
    rows, note = utility_rows(report.utility)
    if rows is None:
        return f"<p>unavailable: {escape(note)}</p>"
    return html_table(["", "with the defense", "without"], rows) + f"<p>{escape(note)}</p>"


def _failures(report: Report) -> str:
    if not report.failures:
        return "<p>none</p>"
    return html_table(failure_header(report), failure_rows(report))


def _evidence(report: Report) -> str:
    rows = [row for s in report.steps for row in evidence_rows(s)]
    notes = "".join(f"<li>{escape(n)}</li>" for n in evidence_notes(report))
    return html_table(evidence_header(step_name(report)["column"]), rows) + f"<ul>{notes}</ul>"


def render_html(report: Any, run_dir: Optional[Path]) -> str:
    """``report.html`` of ``report`` (a :class:`Report`, or its JSON object); the pictures are
    read from ``run_dir``."""
    from audit.report.images import data_uri
    from audit.report.plots import psnr_vs_step_png

    report = Report.of(report)
    name, delta = step_name(report), report.risk_delta
    worst = f" &mdash; {escape(overall_text(report.verdict, name['column']))}"
    notes = "".join(f"<li>{escape(n)}</li>" for n in report.metric_notes)
    grids = "".join(f"<h3>{name['column']} {s.step}</h3>{_grid(report, s, run_dir)}" for s in report.steps)
    settings = "".join(f"<h3>{title}</h3>{_kv(getattr(report, title))}" for title in SETTINGS_SECTIONS)
    body = f"""
<h1>{escape(report.title)}</h1>
<p>{_verdict_badge(report.label)}{worst}</p>
<p class="muted">Status: {escape(report.status)}, {escape(progress_text(report))}
&middot; run {escape(str(report.run_key))} &middot; generated {escape(report.generated)}</p>
<h2>Leakage per {name['title']}</h2>{_summary(report)}
<h2>Evidence per private image (against chance)</h2>{_evidence(report)}
<p><img alt="PSNR versus {name['title']}" src="{data_uri(psnr_vs_step_png(report))}"></p>
<h2>Reconstructions</h2>{grids}
<h2>Metrics per attack</h2>{_per_attack(report)}
<h2>Where this defense differs from its paper / the authors' code</h2>{_differences(report)}
<h2>Privacy spent ((epsilon, delta))</h2>{_privacy(report)}
<h2>Definitions</h2>
<ul><li><b>Leak rule</b>: {escape(report.thresholds['rule'])}</li>
<li><b>Worst case</b>: per private image, the most leaking attack for each metric; averaged over images.</li>
<li><b>Within delta</b> (the Bayes paper's empirical adversarial risk): the fraction of private images the
strongest attack reconstructs within l2 distance delta = {delta['delta']:.3f} ({escape(delta['description'])});
the paper's risk R = 1 - this fraction.</li>{notes}</ul>
<h2>Threat model (what the attacker was given)</h2>{_kv(report.threat_model)}
<h2>Attacks and why they were chosen</h2>{_attacks(report)}
<h2>Utility (defense against no defense)</h2>{_utility(report)}
<h2>Failures</h2>{_failures(report)}
<h2>Settings, seeds and versions</h2>{settings}
"""
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{escape(report.title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>")
