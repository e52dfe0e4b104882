"""JSON: every number of the report (``report.json``, ``sweep.json``)."""
from __future__ import annotations

from audit.report.formats.registry import REPORT_FORMATS, ReportFormat
from audit.report.store import atomic_write_json


def _write(report, path, cache) -> None:
    atomic_write_json(path, report.to_dict())


REPORT_FORMATS.add("json", ReportFormat({"audit": "report.json", "sweep": "sweep.json"},
                                        {"audit": _write, "sweep": _write}), "every number of the report")
