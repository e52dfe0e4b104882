"""The positive control of the audit engine: every verdict beside the same attacks, budget and
seeds on the undefended client; the budget found on it; the sweep reusing its undefended cell."""
import json

import pytest

import audit
from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.engine.control import base_form, control_specs
from audit.engine.audit import AttackSpec

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model="mlp", model_args={"hidden": 32}, image_size=16, utility=False, progress=False)


def test_an_undefended_dlg_lenet_the_attacks_cannot_recover_is_inconclusive_never_private(tmp_path):
    """DLG's own undefended LeNet, at a budget too small for the attacks: the step says so."""
    report = audit.run(defense="none", model="lenet", image_size=16, steps=[0], images=2, attacks=["ig"], budget=4,
                       utility=False, progress=False, out=tmp_path)
    step = report.step(0)
    assert step["verdict"]["recovered"] == 0 and step["control"]["recovered"] == 0
    assert report.verdict == "inconclusive" and step["verdict"]["label"] == "inconclusive"
    assert "without the defense at budget 4" in step["verdict"]["reason"]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["control"]["same_run"] is True and saved["steps"][0]["control"]["images"] == 2
    assert not (tmp_path / "control").exists()  # undefended: the audit is its own control


def test_a_decoy_reads_no_recovered_image_beside_a_control_that_recovers_every_image(tmp_path):
    report = audit.run(defense="decoy", steps=[0], attacks=["analytic"], images=4, budget=5, out=tmp_path, **TINY)
    step = report.step(0)
    assert report.verdict == "no recovered image" and step["control"]["recovered"] == 4
    effect = step["verdict"]["defense_effect"]
    assert (effect["stopped"], effect["let_through"]) == (4, 0) and effect["p_value"] == pytest.approx(1 / 16)
    assert "the defense stops 4 of the 4 image(s) its control recovered" in report.summary()
    assert (tmp_path / "control" / "runs").is_dir()
    # the stored control resumes: a rerun computes nothing and gives the same verdict
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "control").rglob("*.json")}
    again = audit.run(defense="decoy", steps=[0], attacks=["analytic"], images=4, budget=5, out=tmp_path, **TINY)
    assert again.verdict == report.verdict
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_the_budget_search_doubles_on_the_control_until_half_the_images_or_the_ceiling(tmp_path):
    # the planner's analytic inversion recovers the undefended mlp at the first budget
    found = audit.run(defense="gaussian", defense_args={"sigma": 1.0}, steps=[0], images=2, budget="auto",
                      attacks=["auto"], out=tmp_path / "found", **TINY)
    search = found.data["control"]["search"]
    assert [t["budget"] for t in search["tried"]] == [200] and search["budget"] == 200
    assert found.data["settings"]["budget"]["value"] == 200
    # a rule nothing can pass: the control never recovers, the search stops at the ceiling
    never = dict(TINY, thresholds="margin_db=500")
    capped = audit.run(defense="gaussian", defense_args={"sigma": 1.0}, steps=[0], images=1, budget="auto",
                       max_budget=400, attacks=["ig"], out=tmp_path / "capped", **never)
    search = capped.data["control"]["search"]
    assert [t["budget"] for t in search["tried"]] == [200, 400] and search["budget"] == 400
    assert capped.verdict == "inconclusive" and "largest budget tried, 400" in search["reason"]


def test_bad_budget_searches_are_one_line_errors_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="below the budget search's start 200"):
        audit.run(defense="none", steps=[0], images=1, budget="auto", max_budget=100, out=tmp_path, **TINY)
    for closed_form in ("analytic", "spear"):
        with pytest.raises(ConfigError, match=f"{closed_form} spends none"):
            audit.run(defense="none", steps=[0], images=1, budget="auto", attacks=[closed_form], out=tmp_path, **TINY)
    with pytest.raises(ConfigError, match="positive integer or 'auto'"):
        audit.run(defense="none", steps=[0], images=1, budget="lots", out=tmp_path, **TINY)
    assert not any(tmp_path.iterdir())


def test_the_budget_is_searched_by_default_except_for_closed_form_attacks_alone():
    from audit.engine.settings import AttackSettings

    assert AttackSettings().budget == "auto" and AttackSettings(names=["ig", "analytic"]).budget == "auto"
    assert AttackSettings(names=["analytic"]).budget == 200  # doubling cannot give a closed form power
    assert AttackSettings(names=["analytic"], budget=50).budget == 50


def test_the_control_runs_each_attacks_base_form_once():
    base, planned = Reason("attack-base"), Reason("attack-requested")
    specs = [AttackSpec("portfolio", {}, base), AttackSpec("ig", {"restarts": 2}, base),
             AttackSpec("through-defense", {"samples": 8}, planned, "adaptive"),
             AttackSpec("mask-replay", {}, planned, "adaptive"), AttackSpec("analytic", {}, planned, "adaptive")]
    mine = control_specs(specs, {"ig": {"restarts": 3}})
    assert [(s.name, s.settings) for s in mine] == [("portfolio", {}), ("ig", {"restarts": 2}), ("analytic", {})]
    assert base_form("through-defense", {"base": "gi"}) == "gi" and base_form("learned-inverter", {}) == "ig"
    alone = control_specs([AttackSpec("mask-replay", {}, planned, "adaptive")], {"ig": {"restarts": 3}})
    assert [(s.name, s.settings) for s in alone] == [("ig", {"restarts": 3})]
    assert alone[0].why == Reason("attack-base-form", of="mask-replay")


def test_a_sweep_cell_takes_its_control_from_the_undefended_cell(tmp_path):
    report = audit.sweep({"decoy": {}}, out=tmp_path, steps=[0], images=2, attacks=["analytic"], budget=5, **TINY)
    cells = {c["name"]: c for c in report.data["cells"]}
    decoy = json.loads((tmp_path / "cells" / "decoy" / "report.json").read_text())
    none = json.loads((tmp_path / "cells" / "none" / "report.json").read_text())
    assert decoy["control"]["dir"] == "../none" and decoy["control"]["run_key"] == none["run_key"]
    assert not (tmp_path / "cells" / "decoy" / "control").exists()
    assert decoy["steps"][0]["control"]["recovered"] == none["steps"][0]["verdict"]["recovered"] == 2
    assert decoy["verdict"]["label"] == "no recovered image" and "decoy" in cells
    # the single audit of the same setting shows the same control, from a store of its own
    single = audit.run(defense="decoy", out=tmp_path / "single", steps=[0], images=2, attacks=["analytic"], budget=5,
                       **TINY)
    assert single.data["control"]["run_key"] == decoy["control"]["run_key"]
    assert single.step(0)["control"]["per_image"] == decoy["steps"][0]["control"]["per_image"]


def test_the_budget_search_stops_at_max_minutes_and_says_so(tmp_path):
    never = dict(TINY, thresholds="margin_db=500")
    timed = audit.run(defense="gaussian", defense_args={"sigma": 1.0}, steps=[0], images=1, budget="auto",
                      max_budget=25600, max_minutes=1e-6, attacks=["ig"], out=tmp_path, **never)
    search = timed.data["control"]["search"]
    assert [t["budget"] for t in search["tried"]] == [200] and search["stopped_by"] == "max_minutes"
    assert "max_minutes 1e-06" in search["reason"]


def test_the_control_is_built_from_the_config_without_the_defense_and_keeps_no_audit(tmp_path):
    import gc
    import weakref

    from audit.engine.audit import Audit
    from audit.engine.config import make_config
    from audit.engine.control import PositiveControl, control_inputs
    from audit.report.store import settings_key

    config = make_config(defense="gaussian", defense_args={"sigma": 0.1}, steps=[0, 2], images=2, attacks=["ig"],
                         budget=8, out=str(tmp_path), **TINY)
    audited = Audit.from_config(config)
    control = PositiveControl(control_inputs(audited))
    assert control.inputs.config.sections() == config.undefended().sections()
    assert control.out() == tmp_path / "control" and not control.same_run
    gone = weakref.ref(audited)
    del audited
    gc.collect()
    assert gone() is None  # nothing of the audit is kept: the control is its config and shared parts
    at = control.audit_at(16, (0,))
    alone = Audit.from_config(config.undefended().replace(steps=(0,), budget=16, out=str(tmp_path / "control")))
    assert at.config.sections() == alone.config.sections() and at.progress_label == "control"
    assert at.null is control.inputs.null  # handed over when the control's audit is built, not patched in
    assert settings_key(at.key_settings()) == settings_key(alone.key_settings())


def test_the_control_and_its_budget_search_are_codes_the_report_words(tmp_path):
    from audit.report.audit_report import AuditReport
    from audit.report.control import CONTROL_KINDS, control_entry, search_text

    never = dict(TINY, thresholds="margin_db=500")
    capped = audit.run(defense="gaussian", defense_args={"sigma": 1.0}, steps=[0], images=1, budget="auto",
                       max_budget=400, attacks=["ig"], out=tmp_path, **never)
    stored = json.loads(next(tmp_path.glob("runs/*/manifest.json")).read_text())["control"]
    assert stored["kind"] == "simulated" and "description" not in stored  # the engine stores codes and numbers
    assert stored["search"]["stopped_by"] == "max_budget" and "reason" not in stored["search"]
    words = capped.data["control"]
    assert words["description"] == CONTROL_KINDS["simulated"]
    assert words["search"]["reason"] == search_text(stored["search"]) == (
        "the control recovered 0 of 1 images of step 0 at the largest budget tried, 400 (max_budget 400); steps "
        "where it recovers none are inconclusive")
    assert f"Positive control at budget 400: {CONTROL_KINDS['simulated']}" in capped.to_markdown()
    # a manifest stored with the engine's own words (before the codes) reads as it was
    older = {"budget": 200, "description": "the old words", "search": {"reason": "found at 200", "tried": []}}
    assert control_entry(older)["description"] == "the old words"
    assert control_entry(older)["search"]["reason"] == "found at 200"
    # the report is one record: through JSON and back, it renders the same
    again = AuditReport.from_dict(json.loads((tmp_path / "report.json").read_text()))
    assert again.to_dict() == json.loads(json.dumps(capped.to_dict()))
    assert again.to_markdown() == capped.to_markdown() and again.summary() == capped.summary()
