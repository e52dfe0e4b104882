"""The sweep's report: one row per cell (worst-case PSNR at the chosen step, or the cell's
worst step, against test accuracy), Pareto-optimal settings marked, written in every
registered format (:mod:`audit.report.formats`: ``sweep.json``, ``sweep.md``, ``sweep.html``
with the frontier inlined, ``frontier.png``); each row links to the cell's own audit report."""
from __future__ import annotations

import datetime as _dt
import math
from dataclasses import replace
from html import escape
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from audit.core.evidence import mean_difference
from audit.core.records import UtilityResult
from audit.core.jsonable import to_jsonable
from audit.report.format import UNAVAILABLE, diverged_text, fmt, kv_rows, spread_text
from audit.report.formats import MAIN_FORMAT, report_file, write_report
from audit.report.record import Report
from audit.report.store import read_json
from audit.report.sweep_record import Sweep, SweepCell


DOMINANCE_RULE = ("a cell is dominated by another that leaks no more (worst-case PSNR lower or equal) and has at "
                  "least its mean test accuracy, and is better in one of them beyond the noise: a lower PSNR, or "
                  "a mean accuracy higher with the 95% Welch interval of the difference over the seeds above 0 "
                  "(with fewer than two seeds in a cell, any higher mean); Pareto-optimal: dominated by no cell")


def dominates(b: Sequence[Any], a: Sequence[Any]) -> bool:
    """Whether point ``b`` dominates point ``a`` under :data:`DOMINANCE_RULE`; a point is
    ``(psnr, accuracy)`` or ``(psnr, accuracy, per-seed accuracies)``."""
    (p, acc, *sa), (q, bcc, *sb) = a, b
    if None in (p, acc, q, bcc):
        return False
    diff = mean_difference(sb[0], sa[0]) if sa and sb and sa[0] and sb[0] else None
    beyond = bcc > acc if diff is None else diff.low > 0
    return q <= p and bcc >= acc and (q < p or beyond)


def pareto_optimal(points: Sequence[Sequence[Optional[float]]]) -> List[bool]:
    """Whether each point (see :func:`dominates`) is dominated by no other point; points
    missing the PSNR or the accuracy are never optimal."""
    known = [i for i, (p, a, *_) in enumerate(points) if p is not None and a is not None]
    return [i in known and not any(dominates(points[j], points[i]) for j in known if j != i)
            for i in range(len(points))]


def cell_point(report: Any, step: Optional[int]) -> Dict[str, Any]:
    """A cell's frontier numbers from its audit report (a :class:`~audit.report.record.Report`
    or its JSON object; None: pending): worst-case PSNR / SSIM and verdict at ``step`` (None:
    the step with the highest worst-case PSNR), and its utility (:func:`utility_point`)."""
    if report is None:
        return {"status": "pending", "psnr": None, "ssim": None, "step": step, "verdict": None,
                **utility_point(UtilityResult.missing("pending"))}
    report = Report.of(report)
    steps = [s for s in report.steps if step is None or s.step == step]
    judged = [s for s in steps if s.worst_case.psnr is not None]
    chosen = max(judged, key=lambda s: s.worst_case.psnr) if judged else (steps[0] if steps else None)
    worst = chosen.worst_case if chosen else None
    return {"status": report.status, "psnr": worst and worst.psnr, "ssim": worst and worst.ssim,
            "step": chosen.step if chosen else step, "verdict": chosen.label if chosen else None,
            **utility_point(UtilityResult.from_dict(report.utility))}


def utility_point(utility: UtilityResult) -> Dict[str, Any]:
    """A cell's utility numbers for the frontier (``accuracy``: the mean over seeds)."""
    d, u = utility.defended, utility.undefended
    return {"accuracy": d and d.mean, "accuracy_std": d and d.std, "accuracies": d.accuracies if d else [],
            "accuracy_min": d and d.min,
            "accuracy_max": d and d.max, "accuracy_text": spread_text(d), "seeds": len(d.runs) if d else 0,
            "diverged": diverged_text(d), "diverged_runs": len(d.diverged) if d else 0,
            "baseline_accuracy": u and u.mean, "relative": utility.relative,
            "utility_note": utility.unavailable or (d.error if d else "")}


def build_sweep(cells: Sequence[Dict[str, Any]], reports: Sequence[Any], *, settings: Dict[str, Any],
                thresholds: Dict[str, Any], step: Optional[int], invocation: Optional[Dict[str, Any]] = None) -> Sweep:
    """Every number of the sweep report as one :class:`~audit.report.sweep_record.Sweep`
    (``cells``: each cell's description; ``reports``: its audit report, None when pending)."""
    rows = [SweepCell.from_dict({**cell, **cell_point(report, step),
                                 "report": f"{cell['dir']}/{report_file('audit', MAIN_FORMAT)}"})
            for cell, report in zip(cells, reports)]
    rows = [replace(r, pareto=optimal) for r, optimal in zip(rows, pareto_optimal([r.point for r in rows]))]
    undefended = next((r for r in rows if r.undefended), None)
    return Sweep(
        title="gia-audit sweep: privacy-utility frontier", generated=_dt.datetime.now().isoformat(timespec="seconds"),
        step="worst" if step is None else step,
        progress={"done": sum(r.status == "complete" for r in rows), "total": len(rows)},
        defenses=list(dict.fromkeys(r.defense for r in rows if not r.undefended)),
        undefended=undefended and {k: undefended[k] for k in ("name", "psnr", "step", "accuracy", "accuracy_std")},
        dominance_rule=DOMINANCE_RULE, pareto=[r.name for r in rows if r.pareto], thresholds=thresholds,
        settings=settings, invocation=invocation or {}, cells=rows)


class SweepReport:
    """The result of a sweep: ``record`` holds every number (a
    :class:`~audit.report.sweep_record.Sweep`); ``data`` is its JSON object (``sweep.json``)."""

    def __init__(self, record: Any, out: Optional[Path] = None):
        self.record, self.out = Sweep.from_dict(record), Path(out) if out is not None else None
        self._data: Optional[Dict[str, Any]] = None

    @property
    def data(self) -> Dict[str, Any]:
        """The report's JSON object (what ``sweep.json`` holds), made once."""
        if self._data is None:
            self._data = to_jsonable(self.record.to_dict())
        return self._data

    def to_dict(self) -> Dict[str, Any]:
        """The sweep's report as one JSON-able record (what ``sweep.json`` holds)."""
        return self.data

    @classmethod
    def from_dict(cls, data: Dict[str, Any], out: Optional[Path] = None) -> "SweepReport":
        return cls(Sweep.from_dict(data), out)

    @classmethod
    def from_cells(cls, out: Path, cells: Sequence[Dict[str, Any]], **kwargs: Any) -> "SweepReport":
        """Read each cell's ``report.json`` under ``out`` (missing: the cell is pending)."""
        paths = [Path(out) / c["dir"] / report_file("audit", "json") for c in cells]
        return cls(build_sweep(cells, [read_json(p) if p.is_file() else None for p in paths], **kwargs), out)

    @property
    def cells(self) -> List[SweepCell]:
        return self.record.cells

    def cell(self, name: str) -> SweepCell:
        return self.record.cell(name)

    def to_markdown(self) -> str:
        return render_markdown(self.record)

    def to_html(self, frontier_png: bytes) -> str:
        return render_html(self.record, frontier_png)

    def write(self, out: Optional[Path] = None) -> Dict[str, Path]:
        """Write the report in every registered format; the paths by file name."""
        out = Path(out) if out is not None else self.out
        paths = write_report("sweep", self, out)
        self.out = out
        return paths

    def summary(self) -> str:
        """A few lines for the terminal: one per cell."""
        sweep = self.record
        lines = [f"{sweep.title}  [{sweep.progress['done']}/{sweep.progress['total']} cells]"]
        for r in sweep.cells:
            lines.append(f"  {r.name:<28} PSNR {fmt('psnr', r.psnr):>6} dB at step {r.step} "
                         f"({r.verdict or r.status}), accuracy {r.accuracy_text}{'  Pareto-optimal' if r.pareto else ''}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"SweepReport(cells={len(self.cells)}, pareto={self.record.pareto}, out={self.out})"


# --------------------------------------------------------------------------- rendering
HEADER = ["defense", "setting", "worst-case PSNR (dB)", "at step", "verdict",
          "test accuracy: mean ± std (min-max)", "diverged", "relative", "Pareto-optimal", "report"]


def _num(value: Optional[float], spec: str) -> str:
    return UNAVAILABLE if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _rows(sweep: Sweep, link) -> List[List[str]]:
    """One row per cell (the columns of ``HEADER``); ``link(cell)`` renders the report column."""
    return [[f"{r.defense}{' (undefended)' if r.undefended else ''}", r.setting, fmt("psnr", r.psnr), str(r.step),
             r.verdict or r.status, r.accuracy_text, r.diverged, _num(r.relative, ".2f"), "yes" if r.pareto else "",
             link(r)] for r in sweep.cells]


def _definitions(sweep: Sweep) -> List[str]:
    where = "each cell's worst audited step" if sweep.step == "worst" else f"training step {sweep.step}"
    settings = sweep.settings
    return [f"Worst-case PSNR: per private image the most leaking attack, averaged over images, at {where}.",
            f"Test accuracy: after {settings.get('utility_steps')} FL rounds trained with the defended "
            f"updates ({settings.get('utility_recipe', 'recipe not recorded')}), on "
            f"{settings.get('utility_seeds')} seeds: mean ± sample standard deviation "
            "(percentage points) and min-max; relative = mean defended / mean undefended (the undefended runs, "
            "on the same seeds, are shared by all cells). A run that diverged (non-finite loss, update or "
            "parameters) is scored on the model it left, outputs that are not finite counting as a constant "
            "guess (1/classes).",
            f"Pareto-optimal: {sweep.dominance_rule or DOMINANCE_RULE}.",
            f"Verdicts (each cell's report): {sweep.thresholds.get('rule', '')}"]


def render_markdown(sweep: Any) -> str:
    """``sweep.md`` of ``sweep`` (a :class:`Sweep`, or its JSON object)."""
    sweep = Sweep.from_dict(sweep)
    lines = [f"# {sweep.title}", "", f"![frontier]({report_file('sweep', 'png')})", "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(sweep, lambda r: f"[report]({r.report})")]
    lines += ["", *[f"- {d}" for d in _definitions(sweep)], "", "## Settings (every cell)", ""]
    lines += [f"- {k}: {v}" for k, v in kv_rows(sweep.settings)]
    return "\n".join(lines) + "\n"


def render_html(sweep: Any, png: bytes) -> str:
    """``sweep.html`` of ``sweep`` (a :class:`Sweep`, or its JSON object) with the frontier ``png`` inlined."""
    from audit.report.html import CSS, html_table
    from audit.report.images import data_uri

    sweep = Sweep.from_dict(sweep)
    rows = [[escape(c) for c in row[:-1]] + [row[-1]]
            for row in _rows(sweep, lambda r: f'<a href="{escape(r.report)}">{escape(r.name)}</a>')]
    settings = html_table(["key", "value"], [[k, v] for k, v in kv_rows(sweep.settings)])
    defs = "".join(f"<li>{escape(d)}</li>" for d in _definitions(sweep))
    body = f"""
<h1>{escape(sweep.title)}</h1>
<p class="muted">{sweep.progress['done']}/{sweep.progress['total']} cells audited &middot;
generated {escape(sweep.generated)}</p>
<p><img alt="privacy-utility frontier" src="{data_uri(png)}"></p>
{html_table(HEADER, rows, raw=True)}
<ul>{defs}</ul>
<h2>Settings (every cell)</h2>{settings}
"""
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{escape(sweep.title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>")
