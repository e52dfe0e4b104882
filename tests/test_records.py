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


# --------------------------------------------------------------------------- every record, every field
def _records():
    from audit.core.manifest import Manifest
    from audit.core.step_records import AttackSummary, ControlSummary, Risk, StepReport, StepVerdict, WorstCase
    from audit.report.record import Report
    from audit.report.sweep_record import Sweep, SweepCell

    return [AttackSummary, WorstCase, StepVerdict, Risk, ControlSummary, StepReport, Report, Manifest, SweepCell, Sweep]


def _value(name: str, kind: str):
    """A value of annotation ``kind`` for field ``name``, never the field's default."""
    kind = kind[len("Optional["):-1] if kind.startswith("Optional[") else kind
    nested = {cls.__name__: cls for cls in _records()}
    if kind in nested:
        return _sample(nested[kind])
    for outer in ("Dict[str, {}]", "List[{}]"):
        inner = next((n for n in nested if outer.format(n) == kind), None)
        if inner is not None:
            return {"a": _sample(nested[inner])} if kind.startswith("Dict") else [_sample(nested[inner])]
    if kind == "List[AttackResult]":
        return [AttackResult(step=3, attack_id="ig", image=1, status=Status.ERROR, reason="it raised")]
    simple = {"bool": True, "int": 7, "float": 2.5, "str": f"{name} value", "Any": f"{name} value"}
    if kind in simple:
        return simple[kind]
    return {"key": name} if kind.startswith("Dict") else [name]


def _sample(cls):
    """A record of ``cls`` with every field set to a value other than its default."""
    from dataclasses import fields

    return cls(**{f.name: _value(f.name, f.type) for f in fields(cls) if f.name != "extra"})


def _default(f):
    from dataclasses import MISSING

    return f.default_factory() if f.default_factory is not MISSING else f.default


def test_every_record_round_trips_every_field_through_json():
    """Each record of the report, its steps, the manifest and the sweep, with every field set:
    its JSON names every field, and reading it back gives every value (a field that
    ``to_dict`` or ``from_dict`` dropped would come back as its default or in ``extra``)."""
    from dataclasses import fields

    for cls in _records():
        record = _sample(cls)
        typed = [f for f in fields(cls) if f.name != "extra"]
        assert all(getattr(record, f.name) != _default(f) for f in typed), cls.__name__  # the sample sets each one
        data = json.loads(json.dumps(record.to_dict()))
        assert set(data) == {f.name for f in typed}, cls.__name__
        back = cls.from_dict(data)
        assert back.extra == {} and back.to_dict() == data, cls.__name__
        for f in typed:
            assert getattr(back, f.name) == getattr(record, f.name), f"{cls.__name__}.{f.name}"
        # a key a later version writes is kept and written back as it was
        assert cls.from_dict({**data, "written_later": [1, 2]}).to_dict()["written_later"] == [1, 2]


def test_a_stored_reports_step_sections_are_typed_records_with_no_key_left_over():
    from audit.core.step_records import AttackSummary, ControlSummary, Risk, StepVerdict, WorstCase

    report = AuditReport.from_dict(json.loads((STORED / "report.json").read_text()))
    for step in report.step_reports:
        assert isinstance(step.worst_case, WorstCase) and isinstance(step.verdict, StepVerdict)
        assert isinstance(step.risk, Risk) and isinstance(step.control, ControlSummary)
        assert all(isinstance(a, AttackSummary) for a in step.attacks.values())
        sections = [step, step.worst_case, step.verdict, step.risk, step.control, *step.attacks.values()]
        assert [s.extra for s in sections] == [{}] * len(sections)  # every stored key is a typed field
    first = report.step_reports[0]
    assert first.worst_case.psnr == 85.0 and first.verdict.recovered == 2 and first.risk.strongest_attack == "spear"
    assert first.attacks["ig"].unavailable == {"lpips": "no pretrained weights"} and not first.control.available
    assert first["verdict"]["label"] == first.label == "leaks"  # and it reads as the stored JSON object


def test_an_older_report_without_the_later_sections_reads_and_renders():
    """A step stored before controls, risk reasons and not-applicable counts, with a key no
    record knows: it reads, renders, and writes back what it stored."""
    data = json.loads((STORED / "report.json").read_text())
    old = data["steps"][1]
    old.pop("control")
    for summary in old["attacks"].values():
        summary.pop("images_not_applicable")
    old["worst_case"]["psnr_mean_of_batches"] = 13.0
    report = AuditReport.from_dict(data)
    step = report.record.step(5)
    assert step.control is None and step.attacks["ig"].images_not_applicable == 0
    assert step.worst_case.extra == {"psnr_mean_of_batches": 13.0}
    assert report.to_dict()["steps"][1]["worst_case"]["psnr_mean_of_batches"] == 13.0
    assert "| 5 | 13.50 |" in report.to_markdown() and "<html>" in report.to_html()


def test_a_sweep_report_is_a_typed_record_the_formats_render():
    from audit.report.sweep_record import Sweep, SweepCell
    from audit.report.sweep_report import SweepReport, build_sweep, render_markdown

    stored = json.loads((STORED / "report.json").read_text())
    cells = [{"name": "none", "defense": "none", "params": {}, "setting": "defaults", "undefended": True,
              "dir": "cells/none"},
             {"name": "prune-ratio=0.5", "defense": "prune", "params": {"ratio": 0.5}, "setting": "ratio=0.5",
              "undefended": False, "dir": "cells/prune-ratio=0.5"}]
    sweep = build_sweep(cells, [stored, None], settings={"utility_steps": 2}, thresholds={"rule": "the rule"},
                        step=None)
    assert isinstance(sweep, Sweep) and all(isinstance(c, SweepCell) for c in sweep.cells)
    done, pending = sweep.cells
    assert (done.psnr, done.step, done.verdict, done.pareto) == (85.0, 0, "leaks", False)  # no accuracy stored
    assert pending.status == "pending" and pending.psnr is None and sweep.progress == {"done": 0, "total": 2}
    back = SweepReport.from_dict(json.loads(json.dumps(SweepReport(sweep).to_dict())))
    assert back.record == sweep and back.cell("none").params == {}
    assert render_markdown(back.record) == render_markdown(sweep.to_dict())  # the record and its JSON render alike
    assert "| none (undefended) | defaults | 85.00 | 0 | leaks |" in back.to_markdown()
