"""What an audit leaves on disk when it stops early. Interrupted (Ctrl-C): the manifest says so
and the report of what is stored is written (every finished result is on disk already). Failed
(a full disk, a broken store, a defense error): the manifest names the error, never "running",
and an older report is removed, as it would claim more than is stored."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from audit.report.audit_report import AuditReport
from audit.report.formats import remove_report
from audit.report.store import ResultStore


@dataclass
class RunGuard:
    """The run's result store, once the run has one (a budget search runs before it)."""

    store: Optional[ResultStore] = None


@contextlib.contextmanager
def stop_safely(out: Any) -> Iterator[RunGuard]:
    """Run the block; when it stops early, leave ``out`` as the module docstring says."""
    guard = RunGuard()
    try:
        yield guard
    except KeyboardInterrupt:
        if guard.store is not None:
            guard.store.update_manifest(status="interrupted")
            if guard.store.load_manifest().planned:
                AuditReport.from_store(guard.store).write(out)
        raise
    except Exception as err:
        if guard.store is not None:
            guard.store.record_stop(err)
        remove_report("audit", out)
        raise
