"""The sweep's report: one row per cell (worst-case PSNR at the chosen step, or the cell's
worst step, against test accuracy), Pareto-optimal settings marked, written in every
registered format (:mod:`audit.report.formats`: ``sweep.json``, ``sweep.md``, ``sweep.html``
with the frontier inlined, ``frontier.png``); each row links to the cell's own audit report."""
from __future__ import annotations

import datetime as _dt
import math
from html import escape
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.report.format import UNAVAILABLE, fmt, kv_rows
from audit.report.formats import MAIN_FORMAT, report_file, write_report
from audit.report.store import read_json, to_jsonable


def pareto_optimal(points: Sequence[Tuple[Optional[float], Optional[float]]]) -> List[bool]:
    """Whether each ``(psnr, accuracy)`` point is Pareto-optimal: no other point leaks less or
    as much (lower PSNR) with at least as much accuracy, better in one. Points missing
    either number are never optimal."""
    known = [(i, p, a) for i, (p, a) in enumerate(points) if p is not None and a is not None]
    out = [False] * len(points)
    for i, p, a in known:
        out[i] = not any(q <= p and b >= a and (q < p or b > a) for j, q, b in known if j != i)
    return out


def cell_point(report: Optional[Dict[str, Any]], step: Optional[int]) -> Dict[str, Any]:
    """A cell's frontier numbers from its audit report: worst-case PSNR / SSIM and verdict at
    ``step`` (None: the step with the highest worst-case PSNR), accuracy and relative accuracy."""
    if report is None:
        return {"status": "pending", "psnr": None, "ssim": None, "step": step, "verdict": None,
                "accuracy": None, "baseline_accuracy": None, "relative": None}
    steps = [s for s in report["steps"] if step is None or s["step"] == step]
    judged = [s for s in steps if s["worst_case"]["psnr"] is not None]
    chosen = max(judged, key=lambda s: s["worst_case"]["psnr"]) if judged else (steps[0] if steps else None)
    utility = report.get("utility") or {}
    wc = chosen["worst_case"] if chosen else {}
    return {"status": report["status"], "psnr": wc.get("psnr"), "ssim": wc.get("ssim"),
            "step": chosen["step"] if chosen else step, "verdict": chosen["verdict"]["label"] if chosen else None,
            "accuracy": utility.get("accuracy"), "baseline_accuracy": utility.get("baseline_accuracy"),
            "relative": utility.get("relative"), "utility_note": utility.get("unavailable") or utility.get("error")}


def build_sweep(cells: Sequence[Dict[str, Any]], reports: Sequence[Optional[Dict[str, Any]]], *,
                settings: Dict[str, Any], thresholds: Dict[str, Any], step: Optional[int],
                invocation: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Every number of the sweep report as one JSON-able dictionary (``sweep.json``)."""
    rows = [{**cell, **cell_point(report, step), "report": f"{cell['dir']}/{report_file('audit', MAIN_FORMAT)}"}
            for cell, report in zip(cells, reports)]
    for row, optimal in zip(rows, pareto_optimal([(r["psnr"], r["accuracy"]) for r in rows])):
        row["pareto"] = optimal
    undefended = next((r for r in rows if r["undefended"]), None)
    return to_jsonable({
        "title": "gia-audit sweep: privacy-utility frontier",
        "generated": _dt.datetime.now().isoformat(timespec="seconds"),
        "step": "worst" if step is None else step,
        "progress": {"done": sum(r["status"] == "complete" for r in rows), "total": len(rows)},
        "defenses": list(dict.fromkeys(r["defense"] for r in rows if not r["undefended"])),
        "undefended": undefended and {k: undefended[k] for k in ("name", "psnr", "step", "accuracy")},
        "pareto": [r["name"] for r in rows if r["pareto"]],
        "thresholds": thresholds,
        "settings": settings,
        "invocation": invocation or {},
        "cells": rows,
    })


class SweepReport:
    """The result of a sweep: ``data`` holds every number (the content of ``sweep.json``)."""

    def __init__(self, data: Dict[str, Any], out: Optional[Path] = None):
        self.data, self.out = data, Path(out) if out is not None else None

    @classmethod
    def from_cells(cls, out: Path, cells: Sequence[Dict[str, Any]], **kwargs: Any) -> "SweepReport":
        """Read each cell's ``report.json`` under ``out`` (missing: the cell is pending)."""
        paths = [Path(out) / c["dir"] / report_file("audit", "json") for c in cells]
        return cls(build_sweep(cells, [read_json(p) if p.is_file() else None for p in paths], **kwargs), out)

    @property
    def cells(self) -> List[Dict[str, Any]]:
        return self.data["cells"]

    def cell(self, name: str) -> Dict[str, Any]:
        for row in self.cells:
            if row["name"] == name:
                return row
        raise KeyError(f"no cell {name!r}; cells: {', '.join(r['name'] for r in self.cells)}")

    def to_markdown(self) -> str:
        return render_markdown(self.data)

    def to_html(self, frontier_png: bytes) -> str:
        return render_html(self.data, frontier_png)

    def write(self, out: Optional[Path] = None) -> Dict[str, Path]:
        """Write the report in every registered format; the paths by file name."""
        out = Path(out) if out is not None else self.out
        paths = write_report("sweep", self, out)
        self.out = out
        return paths

    def summary(self) -> str:
        """A few lines for the terminal: one per cell."""
        lines = [f"{self.data['title']}  [{self.data['progress']['done']}/{self.data['progress']['total']} cells]"]
        for r in self.cells:
            lines.append(f"  {r['name']:<28} PSNR {fmt('psnr', r['psnr']):>6} dB at step {r['step']} "
                         f"({r['verdict'] or r['status']}), accuracy {_num(r['accuracy'], '.1%')}"
                         f"{'  Pareto-optimal' if r['pareto'] else ''}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SweepReport(cells={len(self.cells)}, pareto={self.data['pareto']}, out={self.out})"


# --------------------------------------------------------------------------- rendering
HEADER = ["defense", "setting", "worst-case PSNR (dB)", "at step", "verdict", "test accuracy", "relative",
          "Pareto-optimal", "report"]


def _num(value: Optional[float], spec: str) -> str:
    return UNAVAILABLE if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _rows(data: Dict[str, Any], link) -> List[List[str]]:
    """One row per cell (the columns of ``HEADER``); ``link(row)`` renders the report column."""
    return [[f"{r['defense']}{' (undefended)' if r['undefended'] else ''}", r["setting"], fmt("psnr", r["psnr"]),
             str(r["step"]), r["verdict"] or r["status"], _num(r["accuracy"], ".1%"), _num(r["relative"], ".2f"),
             "yes" if r["pareto"] else "", link(r)] for r in data["cells"]]


def _definitions(data: Dict[str, Any]) -> List[str]:
    thr = data["thresholds"]
    step = data["step"]
    where = "each cell's worst audited step" if step == "worst" else f"training step {step}"
    return [f"Worst-case PSNR: per private image the most leaking attack, averaged over images, at {where}.",
            f"Test accuracy: after {data['settings'].get('utility_steps')} FL rounds trained with the defended "
            "updates; relative = defended / undefended (one undefended run shared by all cells).",
            "Pareto-optimal: no other cell has a lower (or equal) PSNR and a higher (or equal) accuracy, "
            "better in one of them.",
            f"Verdicts (each cell's report): {thr.get('rule', '')}"]


def render_markdown(data: Dict[str, Any]) -> str:
    lines = [f"# {data['title']}", "", f"![frontier]({report_file('sweep', 'png')})", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(data, lambda r: f"[report]({r['report']})")]
    lines += ["", *[f"- {d}" for d in _definitions(data)], "", "## Settings (every cell)", ""]
    lines += [f"- {k}: {v}" for k, v in kv_rows(data["settings"])]
    return "\n".join(lines) + "\n"


def render_html(data: Dict[str, Any], png: bytes) -> str:
    from audit.report.html import CSS, html_table
    from audit.report.images import data_uri

    rows = [[escape(c) for c in row[:-1]] + [row[-1]]
            for row in _rows(data, lambda r: f'<a href="{escape(r["report"])}">{escape(r["name"])}</a>')]
    settings = html_table(["key", "value"], [[k, v] for k, v in kv_rows(data["settings"])])
    defs = "".join(f"<li>{escape(d)}</li>" for d in _definitions(data))
    body = f"""
<h1>{escape(data['title'])}</h1>
<p class="muted">{data['progress']['done']}/{data['progress']['total']} cells audited &middot;
generated {escape(data['generated'])}</p>
<p><img alt="privacy-utility frontier" src="{data_uri(png)}"></p>
{html_table(HEADER, rows, raw=True)}
<ul>{defs}</ul>
<h2>Settings (every cell)</h2>{settings}
"""
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{escape(data['title'])}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>")
