"""The records at the boundaries: an attack's trace, and a stored audit rendered as it was."""
import json
import re
import shutil
from pathlib import Path

import torch

from audit.core.records import AttackResult, Status
from audit.core.trace import Trace
from audit.core.types import Reconstruction
from audit.engine.scoring import trace_summary
from audit.report.audit_report import AuditReport, render

STORED = Path(__file__).parent / "data" / "stored-audit"


def test_a_trace_round_trips_through_json_with_its_typed_fields_and_extra():
    trace = Trace(attack="ig", gradient_evaluations=120, time_s=2.5, failed_to_optimise=True, failure="flat",
                  certificate_error=1e-7, side_information_used=("bn-upload",),
                  side_information={"bn-upload": "matched"}, extra={"restarts": 4, "final_losses": [0.5, 0.2]})
    data = json.loads(json.dumps(trace.to_dict()))
    assert data["attack"] == "ig" and data["restarts"] == 4 and "extra" not in data  # one flat layout
    again = Trace.from_dict(data)
    assert again == trace and again.extra == {"restarts": 4, "final_losses": [0.5, 0.2]}
    assert again.uses("bn-upload") and again.stalled and again.gradient_evaluations == 120


def test_a_dict_trace_an_attack_builds_becomes_the_record_and_stays_a_mapping():
    rec = Reconstruction(torch.zeros(1, 3, 4, 4), torch.zeros(1), {"attack": "spear", "seconds": 0.3, "layer": "fc"})
    assert isinstance(rec.trace, Trace) and rec.trace.attack == "spear" and rec.trace.seconds == 0.3
    rec.trace["failed_to_optimise"] = True  # attacks add to their traces as to a dict
    rec.trace.setdefault("grouped", "no")
    assert rec.trace.stalled and rec.trace["layer"] == "fc" and rec.trace.extra["grouped"] == "no"
    assert rec.trace.pop("failed_to_optimise") is True and not rec.trace.stalled
    assert "certificate_error" not in rec.trace and rec.trace.get("certificate_error") is None
    assert dict(rec.trace) == {"attack": "spear", "seconds": 0.3, "layer": "fc", "grouped": "no"}


def test_the_store_keeps_the_typed_fields_whole_and_summarises_the_rest():
    summary = trace_summary({"attack": "ig", "side_information_used": ("bn-upload",), "loss_history": [3.0, 2.0, 1.0],
                             "features": torch.zeros(2)})
    assert summary.uses("bn-upload") and summary.attack == "ig"
    assert summary.extra == {"loss_history_first": 3.0, "loss_history_last": 1.0, "loss_history_len": 3}


def test_an_older_stored_result_loads_its_trace_into_the_record():
    stored = json.loads(next((STORED / "runs").glob("*/results/s5__ig__i1.json")).read_text())
    result = AttackResult.from_dict(stored)
    assert result.trace.attack == "ig" and result.trace.time_s == 1.5 and result.trace.extra["loss_history_len"] == 50
    assert result.effective_status is Status.FAILED_TO_OPTIMISE and not result.trace.uses("bn-upload")
    used = AttackResult.from_dict(json.loads(next((STORED / "runs").glob("*/results/s0__ig__i0.json")).read_text()))
    assert used.trace.uses("bn-upload")  # its note, as written then, said so
    assert AttackResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def _undated(markdown: str) -> str:
    return re.sub(r"generated \S+\.", "generated <date>.", markdown)


def test_a_stored_report_json_renders_the_markdown_it_was_written_with():
    report = AuditReport.from_dict(json.loads((STORED / "report.json").read_text()))
    assert report.to_markdown() == (STORED / "report.md").read_text()


def test_a_stored_audit_rerenders_to_the_same_markdown(tmp_path):
    shutil.copytree(STORED, tmp_path / "audit")
    render(tmp_path / "audit")
    assert _undated((tmp_path / "audit" / "report.md").read_text()) == _undated((STORED / "report.md").read_text())


def test_a_manifest_written_and_read_back_is_the_record(tmp_path):
    from audit.core.manifest import Manifest
    from audit.report.store import ResultStore

    store = ResultStore.create(tmp_path, {"defense": "prune", "seed": 0})
    part = Manifest(run_key=store.key, status="running", steps=[0, 5], images=2, defense={"name": "prune"},
                    attacks=[{"id": "ig"}], risk_delta={"delta": 5.0}, failures=[])
    store.update_manifest(part)
    assert store.load_manifest() == part and store.load_manifest().planned
    # later writes merge their keys; keys the record does not know are kept as they were
    store.update_manifest(status="complete", flower_round={"server": 3})
    back = store.load_manifest()
    assert back == Manifest.from_dict({**part.to_dict(), "status": "complete", "flower_round": {"server": 3}})
    assert back.status == "complete" and back.extra == {"flower_round": {"server": 3}}
    assert json.loads(store.manifest_path.read_text()) == back.to_dict()  # the file is the record's JSON object
    assert back.updated(status="interrupted").status == "interrupted" and back.status == "complete"


def test_the_stored_manifest_reads_into_the_record_unchanged():
    from audit.core.manifest import Manifest

    raw = json.loads(next((STORED / "runs").glob("*/manifest.json")).read_text())
    manifest = Manifest.from_dict(raw)
    assert manifest.to_dict() == raw and manifest.extra == {}
    assert manifest.steps == [0, 5] and manifest.threat_model["shares"] == "state"


def test_a_stored_reports_steps_read_into_step_records_with_the_same_json():
    from audit.core.records import StepReport

    data = json.loads((STORED / "report.json").read_text())
    report = AuditReport.from_dict(data)
    assert [s.to_dict() for s in report.step_reports] == data["steps"]
    assert [s.label for s in report.step_reports] == ["leaks", "incomplete"]
    assert "the buffers' statistics used" in report.step_reports[0].verdict["buffers"]
    assert StepReport.from_dict(json.loads(json.dumps(report.step_reports[1].to_dict()))) == report.step_reports[1]
