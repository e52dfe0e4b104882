"""HTML: one self-contained page (``report.html``, ``sweep.html``; images inlined)."""
from __future__ import annotations

from audit.report.formats.registry import REPORT_FORMATS, ReportFormat
from audit.report.store import atomic_write_bytes


def _audit(report, path, cache) -> None:
    atomic_write_bytes(path, report.to_html().encode())


def _sweep(report, path, cache) -> None:
    from audit.report.formats.plot_png import frontier

    atomic_write_bytes(path, report.to_html(frontier(report, cache)).encode())


REPORT_FORMATS.add("html", ReportFormat({"audit": "report.html", "sweep": "sweep.html"},
                                        {"audit": _audit, "sweep": _sweep}), "one self-contained page")
