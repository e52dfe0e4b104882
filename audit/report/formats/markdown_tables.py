"""Markdown: the report's tables (``report.md``, ``sweep.md``)."""
from __future__ import annotations

from audit.report.formats.registry import REPORT_FORMATS, ReportFormat
from audit.report.store import atomic_write_bytes


def _audit(report, path, cache) -> None:
    atomic_write_bytes(path, report.to_markdown().encode())


def _sweep(report, path, cache) -> None:
    atomic_write_bytes(path, report.to_markdown().encode())


REPORT_FORMATS.add("markdown", ReportFormat({"audit": "report.md", "sweep": "sweep.md"},
                                            {"audit": _audit, "sweep": _sweep}), "the report's tables")
