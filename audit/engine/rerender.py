"""What ``gia-audit report`` runs: the report of a finished (or interrupted) audit, rendered
again from its stored results in every registered format."""
from __future__ import annotations

import os
from typing import Any, Optional

from audit.report.audit_report import AuditReport, render


def render_report(directory: os.PathLike | str, run: Optional[str] = None, thresholds: Any = None) -> AuditReport:
    """Re-render and write the report of the audit stored in ``directory`` (``run``: a run key
    under ``directory/runs``; default the latest), judged under ``thresholds`` when given."""
    return render(directory, run, thresholds)
