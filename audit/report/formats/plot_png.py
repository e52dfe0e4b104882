"""PNG: the report's plot (PSNR against the training step; the sweep's frontier)."""
from __future__ import annotations

from audit.report.formats.registry import REPORT_FORMATS, ReportFormat
from audit.report.store import atomic_write_bytes


def frontier(report, cache) -> bytes:
    """The sweep's frontier plot, rendered once per write (the HTML page inlines it too)."""
    if "frontier" not in cache:
        from audit.report.frontier import frontier_png

        cache["frontier"] = frontier_png(report.record)
    return cache["frontier"]


def _audit(report, path, cache) -> None:
    atomic_write_bytes(path, report.plot_png())


def _sweep(report, path, cache) -> None:
    atomic_write_bytes(path, frontier(report, cache))


REPORT_FORMATS.add("png", ReportFormat({"audit": "psnr_vs_step.png", "sweep": "frontier.png"},
                                       {"audit": _audit, "sweep": _sweep}), "the report's plot")
