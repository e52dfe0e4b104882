"""The registry of report formats: what a format declares, and the file names it writes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping

from audit.core.errors import ConfigError
from audit.core.registry import Registry

KINDS = ("audit", "sweep")
#: ``writer(report, path, cache)``: write ``report`` (an AuditReport or SweepReport) to
#: ``path``; ``cache`` is shared by the formats of one write (e.g. a plot rendered once)
Writer = Callable[[Any, Path, Dict[str, Any]], None]


@dataclass(frozen=True)
class ReportFormat:
    """One output format: the file it writes for each report kind, and the writers."""

    files: Mapping[str, str]
    writers: Mapping[str, Writer]

    def __post_init__(self):
        if set(self.files) != set(self.writers) or not set(self.files) <= set(KINDS):
            raise ConfigError(f"a report format needs a file and a writer for each of its kinds (of {KINDS})")


REPORT_FORMATS = Registry("report format")

#: the format a report is opened in (the CLI names its file first)
MAIN_FORMAT = "html"


def report_file(kind: str, fmt: str) -> str:
    """The file ``fmt`` writes for a ``kind`` report, e.g. ``report_file("audit", "json")``."""
    return REPORT_FORMATS.get(fmt).files[kind]


def report_files(kind: str) -> List[str]:
    """Every file a ``kind`` report is written as, the main format's first."""
    names = sorted(REPORT_FORMATS.names(), key=lambda n: n != MAIN_FORMAT)
    return [REPORT_FORMATS.get(n).files[kind] for n in names if kind in REPORT_FORMATS.get(n).files]
