"""Report formats are a registry: a new format is one registration, and writing a report, the
CLI's message and the sweep's links to its cells all follow it."""
import json

import pytest

from audit.core.registry import Entry
from audit.report.audit_report import AuditReport
from audit.report.formats import REPORT_FORMATS, ReportFormat, files_message, report_file, report_files
from audit.report.store import atomic_write_bytes
from audit.report.sweep_report import SweepReport


def _audit_data():
    return {"title": "gia-audit report: prune", "status": "complete", "progress": {"done": 0, "total": 0},
            "verdict": {"label": "not judged"}, "steps": [], "failures": []}


@pytest.fixture
def text_format(monkeypatch):
    """A new format, registered the way a format module registers itself."""
    def write(report, path, cache):
        atomic_write_bytes(path, report.data["title"].encode())

    fmt = ReportFormat({"audit": "report.txt", "sweep": "sweep.txt"}, {"audit": write, "sweep": write})
    monkeypatch.setitem(REPORT_FORMATS._entries, "text", Entry("text", fmt, "the title"))
    return fmt


def test_a_registered_format_is_written_and_named(tmp_path, text_format):
    assert "report.txt" in report_files("audit") and report_files("audit")[0] == "report.html"
    report = AuditReport(_audit_data())
    report.to_markdown = lambda: "# md"
    report.to_html = lambda: "<html></html>"
    report.plot_png = lambda: b"png"
    paths = report.write(tmp_path)
    assert sorted(paths) == sorted(report_files("audit"))
    assert (tmp_path / "report.txt").read_text() == "gia-audit report: prune"
    assert json.loads((tmp_path / "report.json").read_text())["title"] == "gia-audit report: prune"
    assert files_message("audit", tmp_path) == (f"report: {tmp_path / 'report.html'} "
                                                "(also report.json, report.md, psnr_vs_step.png, report.txt)")


def test_the_sweep_reads_its_cells_reports_by_the_registered_names(tmp_path, monkeypatch):
    cell = {"name": "prune", "defense": "prune", "params": {}, "setting": "defaults", "undefended": False,
            "dir": "cells/prune"}
    (tmp_path / "cells/prune").mkdir(parents=True)
    monkeypatch.setitem(REPORT_FORMATS.get("json").files, "audit", "numbers.json")
    (tmp_path / "cells/prune/numbers.json").write_text(json.dumps({
        "status": "complete", "steps": [{"step": 0, "worst_case": {"psnr": 21.0, "ssim": 0.5},
                                         "verdict": {"label": "leaks"}}], "utility": {"accuracy": 0.4}}))
    report = SweepReport.from_cells(tmp_path, [cell], settings={}, thresholds={}, step=None)
    assert report.cell("prune")["psnr"] == 21.0 and report.cell("prune")["status"] == "complete"
    assert report.cell("prune")["report"] == f"cells/prune/{report_file('audit', 'html')}"
