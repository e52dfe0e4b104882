"""Report formats: a small registry, one file per format.

Each module of this package registers one :class:`ReportFormat` in :data:`REPORT_FORMATS`:
per report kind (``"audit"``, ``"sweep"``) the file it writes and its writer. Writing a
report, the CLI's messages and the sweep's links to its cells' reports all read the file
names from here, so a new format is one new module (imported below).
"""
from __future__ import annotations

import contextlib

from pathlib import Path
from typing import Any, Dict

from audit.report.formats import html_page, json_data, markdown_tables, plot_png  # noqa: F401  (register)
from audit.report.formats.registry import (KINDS, MAIN_FORMAT, REPORT_FORMATS, ReportFormat, Writer, report_file,
                                           report_files)

__all__ = ["KINDS", "MAIN_FORMAT", "REPORT_FORMATS", "ReportFormat", "Writer", "files_message", "report_file",
           "report_files", "write_report"]


def write_report(kind: str, report: Any, out: Path) -> Dict[str, Path]:
    """Write ``report`` in every registered format into ``out``; the paths by file name."""
    out.mkdir(parents=True, exist_ok=True)
    cache: Dict[str, Any] = {}
    paths = {}
    for name in REPORT_FORMATS.names():
        fmt = REPORT_FORMATS.get(name)
        if kind in fmt.writers:
            path = out / fmt.files[kind]
            fmt.writers[kind](report, path, cache)
            paths[fmt.files[kind]] = path
    return paths


def remove_report(kind: str, out: Path) -> None:
    """Delete ``out``'s report files of ``kind`` as far as the disk allows: a run that stopped
    must not leave an older report claiming more than what is stored."""
    for name in report_files(kind):
        with contextlib.suppress(OSError):
            (Path(out) / name).unlink(missing_ok=True)


def files_message(kind: str, out: Path) -> str:
    """``report: OUT/report.html (also report.json, ...)``: what the CLI prints after writing."""
    main, *rest = report_files(kind)
    return f"report: {Path(out) / main} (also {', '.join(rest)})"
