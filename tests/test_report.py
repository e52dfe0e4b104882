"""The risk report and the result store, on a hand-made store with known numbers (fast:
no attack runs here; tests/test_audit.py covers the end-to-end audit)."""
import json
import math
import re

import pytest
import torch

from audit.core.errors import ConfigError
from audit.core.records import AccuracySpread, ImageClass, TrainingRun, UtilityResult
from audit.report.audit_report import AuditReport, build_report, render
from audit.report.risk import (INCOMPLETE, INCONCLUSIVE, NOT_JUDGED, PARTIAL, PRIVATE, RECOVERED, default_delta,
                               overall_verdict)
from audit.report.rule import LeakRule
from audit.report.store import ResultStore, settings_key

ATTACKS = [
    {"id": "ig", "name": "ig", "kind": "base", "settings": {}, "reason": "baseline"},
    {"id": "mask-replay", "name": "mask-replay", "kind": "adaptive", "settings": {}, "reason": "sparse"},
]
# (step, attack, image) -> (psnr, ssim, l2, rank among K); the aligned PSNR is the PSNR here
NUMBERS = {
    (0, "ig", 0): (24.0, 0.7, 2.0, 1), (0, "ig", 1): (21.0, 0.6, 3.0, 1),
    (0, "mask-replay", 0): (30.0, 0.9, 1.0, 1), (0, "mask-replay", 1): (19.0, 0.4, 6.0, 2),
    (5, "ig", 0): (12.0, 0.1, 9.0, 30), (5, "ig", 1): (11.0, 0.1, 9.5, 40),
    (5, "mask-replay", 0): (17.0, 0.3, 6.0, 2), (5, "mask-replay", 1): (13.0, 0.2, 8.0, 9),
}
CHANCE = 15.0  # every private image's chance level in these stores


def _null(chance=CHANCE):
    """A hand-made null: three guesses, the best at ``chance`` dB; the second ranks first (LOO)."""
    return {"names": ["unrelated 1", "unrelated 2", "mean colour"], "scores": [chance - 4, chance - 0.5, chance],
            "ranks": [40, 1, 30], "candidates": 64, "pool": 2, "similarity": "test distance"}


def _evidence(psnr, rank, **extra):
    return {"aligned_psnr": psnr, "rank": rank, "candidates": 64, **extra}


def _nulls(images, batch=1):
    return {"images": [[_null()] * batch for _ in range(images)],
            "description": {"pool": 2, "candidates": 64, "guesses": ["mean colour"], "similarity": "test distance",
                            "source": "hand-made"}}


def _store(root, numbers=NUMBERS, steps=(0, 5), failing=()):
    store = ResultStore.create(root, {"defense": "prune", "seed": 0})
    store.update_manifest(
        run_key=store.key, status="complete", defense={"name": "prune", "params": {"ratio": 0.9}},
        attacks=ATTACKS, steps=list(steps), images=2, settings={"images": 2, "steps": list(steps)},
        threat_model={"labels_shared": False}, plan={"traits": {"sparse": True}},
        utility=UtilityResult("prune", {"ratio": 0.9}, {"steps": 100},
                              AccuracySpread((TrainingRun(1, 0.5, 1.5, 1.0),
                                              TrainingRun(2, 0.6, 1.4, 1.0, diverged_at=7, note="diverged at round 7"))),
                              AccuracySpread((TrainingRun(1, 0.6, 1.2, 0.5), TrainingRun(2, 0.6, 1.2, 0.5)))),
        thresholds=LeakRule().to_dict(), null=_nulls(2),
        risk_delta={"delta": 5.0, "description": "l2 over 3x16x16 pixels"})
    gen = torch.Generator().manual_seed(0)
    for i in range(2):
        store.save_original(i, torch.rand(1, 3, 16, 16, generator=gen))
    for (step, attack, image), (psnr, ssim, l2, rank) in numbers.items():
        store.save_result({"step": step, "attack_id": attack, "attack": attack, "image": image,
                           "status": "ok", "metrics": {"psnr": psnr, "ssim": ssim, "lpips": None,
                                                       "label_acc": 1.0, "l2": [l2],
                                                       "evidence": [_evidence(psnr, rank)]},
                           "unavailable": {"lpips": "no pretrained weights"}},
                          torch.rand(1, 3, 16, 16, generator=gen))
    for step, attack, image in failing:
        store.save_result({"step": step, "attack_id": attack, "attack": attack, "image": image,
                           "status": "error", "defense": "prune", "reason": "DefenseError: boom"})
    return store


def test_worst_case_risk_and_verdict_follow_the_stated_definitions(tmp_path):
    report = AuditReport.from_store(_store(tmp_path))
    s0, s5 = report.step(0), report.step(5)
    # per image, the most leaking attack; then the mean over images
    assert s0["worst_case"]["psnr"] == pytest.approx((30.0 + 21.0) / 2)
    assert s0["worst_case"]["ssim"] == pytest.approx((0.9 + 0.6) / 2)
    assert [e["best_attack"] for e in s0["worst_case"]["per_image"]] == ["mask-replay", "ig"]
    assert s0["attacks"]["ig"]["psnr"] == pytest.approx(22.5)
    # risk: the strongest single attack's fraction within delta = 5 (ig: 2/2, mask: 1/2)
    assert s0["risk"]["strongest_attack"] == "ig" and s0["risk"]["success"] == 1.0
    assert s0["risk"]["bayes_risk"] == 0.0
    assert s5["risk"]["success"] == 0.0 and s5["risk"]["strongest_attack"] == "mask-replay"
    # verdicts against the chance level of 15 dB: both images recovered at step 0 (rank 1, 6 and
    # 9 dB above chance); at step 5 one partial (17 dB, rank 2), one not recovered (13 dB)
    assert s0["verdict"]["label"] == RECOVERED and s0["verdict"]["recovered"] == 2
    assert [e["best_attack"] for e in s0["worst_case"]["per_image"]] == ["mask-replay", "ig"]
    assert s0["verdict"]["recovery_rate"]["k"] == 2 and s0["verdict"]["recovery_rate"]["low"] == pytest.approx(0.158, abs=1e-3)
    # one partial image of two is what two images carrying nothing private reach in 9% of steps
    # (rank <= 3 of K = 64 each): below the step's bar for "partially"
    assert s5["verdict"]["judged"] == PRIVATE and "fewer than the 2 'partially' needs" in s5["verdict"]["short_of"]
    assert (s5["verdict"]["partially"], s5["verdict"]["not_recovered"]) == (1, 1)
    assert report.verdict == RECOVERED and report.data["verdict"]["leaking_steps"] == [0]
    assert report.psnr(5, "ig") == pytest.approx(11.5)


def test_leak_rule_classifies_at_the_stated_boundaries():
    t = LeakRule()
    assert t.classify(16.0, 1, 15.0) == ImageClass.RECOVERED  # 1 dB above chance and identified
    assert t.classify(15.99, 1, 15.0) == ImageClass.PARTIAL  # above chance, below the margin
    assert t.classify(40.0, 2, 15.0) == ImageClass.PARTIAL  # far above chance but not identified
    assert t.classify(15.0, 3, 15.0) == ImageClass.PARTIAL
    assert t.classify(15.0, 4, 15.0) == ImageClass.NOT_RECOVERED
    assert t.classify(14.99, 1, 15.0) == ImageClass.NOT_RECOVERED  # identified, but below chance
    assert t.classify(None, 1, 15.0) is None and t.classify(20.0, 1, None) is None  # no evidence: not judged
    assert "1 dB" in t.describe() and "rank <= 1" in t.describe()
    assert t.with_text("margin_db=2.5,partial_rank=5") == LeakRule(margin_db=2.5, partial_rank=5)
    with pytest.raises(ConfigError, match="name=value"):
        t.with_text("psnr=20")
    with pytest.raises(ConfigError, match="identify_rank <= partial_rank"):
        LeakRule(identify_rank=4, partial_rank=3)
    assert default_delta(3 * 16 * 16) == pytest.approx(0.1 * math.sqrt(768))


def test_false_positive_rate_is_measured_leave_one_out():
    from audit.core.records import NullEvidence

    null = NullEvidence.from_dict(_null())
    # item 3 (16.5 dB) beats the others' best (15) by 1.5 dB and ranks first: a false positive
    lucky = NullEvidence.from_dict({**_null(), "scores": [11.0, 14.5, 15.0, 16.5], "ranks": [40, 1, 30, 1],
                                    "names": ["a", "b", "c", "d"]})
    recovered, partial = LeakRule().false_positives([null, lucky])
    assert (recovered.k, recovered.n) == (1, 7)
    assert partial.k == 1 + 0  # item 'unrelated 2' of the first null ranks 1 but is below its LOO chance (15)
    assert recovered.high > recovered.rate > recovered.low
    assert LeakRule(margin_db=2.0).false_positives([lucky])[0].k == 0


def test_written_report_is_complete_self_contained_and_nan_free(tmp_path):
    _store(tmp_path)
    render(tmp_path)
    for name in ("report.json", "report.md", "report.html", "psnr_vs_step.png"):
        assert (tmp_path / name).stat().st_size > 0

    def no_nan(token):
        raise AssertionError(f"{token} in report.json")

    data = json.loads((tmp_path / "report.json").read_text(), parse_constant=no_nan)
    assert data["verdict"]["label"] == "leaks" and len(data["results"]) == 8
    assert data["thresholds"]["margin_db"] == 1.0 and data["risk_delta"]["delta"] == 5.0
    assert data["false_positive_rate"]["recovered"]["n"] == 6  # 3 null items x 2 private images
    html = (tmp_path / "report.html").read_text()
    sources = re.findall(r'src="([^"]*)"', html)
    # plot + 2 originals x 2 steps + 8 reconstructions, all embedded
    assert len(sources) == 1 + 4 + 8 and all(s.startswith("data:image/png;base64,") for s in sources)
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)
    assert not re.search(r"\bnan\b", text, re.IGNORECASE)
    md = (tmp_path / "report.md").read_text()
    assert "| 0 | 25.50 |" in md  # worst-case PSNR of step 0
    assert "LPIPS unavailable: no pretrained weights" in md
    assert md.count("n/a") >= 4
    assert "| test accuracy: mean ± std (min-max) | 55.0% ± 7.1 (50.0-60.0%, 2 seeds) | 60.0% ± 0.0 (60.0-60.0%, 2 seeds) |" in md
    assert "| diverged | seed 2 at round 7 | no |" in md and "mean defended / mean undefended): 0.92" in md


def test_failures_and_pending_work_are_reported_not_hidden(tmp_path):
    numbers = {k: v for k, v in NUMBERS.items() if k[0] == 0}
    store = _store(tmp_path, numbers, steps=(0, 5, 20), failing=[(5, "ig", 0)])
    report = AuditReport.from_store(store)
    assert report.data["progress"] == {"done": 5, "total": 12}
    assert report.step(5)["attacks"]["ig"]["status"] == "error"
    assert report.step(20)["attacks"]["ig"]["status"] == "pending"
    assert report.step(20)["verdict"]["images"] == 0
    assert report.step(20)["verdict"]["label"] == INCOMPLETE  # pending work never reads as private
    assert report.failures == [{"step": 5, "attack": "ig", "image": 0, "defense": "prune", "status": "error",
                                "error": "DefenseError: boom"}]
    md = report.to_markdown()
    assert "## Failures" in md and "DefenseError: boom" in md


def test_store_keys_resume_and_errors(tmp_path):
    a = settings_key({"seed": 0, "defense": "prune"})
    assert a == settings_key({"defense": "prune", "seed": 0})
    assert a != settings_key({"defense": "prune", "seed": 1})
    store = _store(tmp_path)
    assert store.has(0, "ig", 1) and not store.has(20, "ig", 0)
    store.save_result({**_ok(1, "eot", 0, 20.0, 0.5), "settings": {"samples": 8}})
    assert store.has(1, "eot", 0, settings={"samples": 8})
    assert not store.has(1, "eot", 0, settings={"samples": 4})  # a changed attack is redone
    assert ResultStore.open_latest(tmp_path).key == store.key
    assert not list(tmp_path.rglob("*.tmp"))  # atomic writes leave nothing behind
    with pytest.raises(ConfigError, match="holds no audit"):
        ResultStore.open_latest(tmp_path / "empty")
    with pytest.raises(ConfigError, match="not found"):
        ResultStore.open_latest(tmp_path, "deadbeef")
    early = ResultStore.create(tmp_path / "early", {"interrupted": "while planning"})
    early.update_manifest(status="interrupted")
    with pytest.raises(ConfigError, match="rerun the same audit command"):
        render(tmp_path / "early")


# --------------------------------------------------------------------------- fail closed
def _rec(step, attack, image, status="ok", **fields):
    return {"step": step, "attack_id": attack, "attack": attack, "image": image, "status": status, **fields}


def _ok(step, attack, image, psnr, ssim, rank=1, **extra):
    """An ok record whose aligned PSNR is ``psnr`` (no evidence when ``psnr`` is None)."""
    evidence = {} if psnr is None else {"evidence": [_evidence(psnr, rank)]}
    return _rec(step, attack, image, metrics={"psnr": psnr, "ssim": ssim, "lpips": None, "label_acc": 1.0,
                                              "l2": [9.0], **evidence, **extra})


def _control(steps=(0,), images=1, psnr=30.0, budget=200, batch=1):
    """A positive control (the manifest's entry and its records) whose ``ig`` reaches ``psnr`` on
    every image: recovered at 30 dB (chance 15), not at 12; None leaves it out."""
    info = {"dir": "control", "run_key": "k", "same_run": False, "budget": budget, "attacks": ["ig"]}
    if psnr is None:
        return info, []
    def metrics():
        return {"psnr": psnr, "ssim": 0.9, "lpips": None, "label_acc": 1.0, "l2": [1.0] * batch,
                "evidence": [_evidence(psnr, 1)] * batch}

    return info, [_rec(s, "ig", i, metrics=metrics()) for s in steps for i in range(images)]


def _report(records, steps=(0,), images=1, attacks=("ig", "mask-replay"), batch=1, rule=None, control="recovers",
            **manifest):
    """A report of ``records``; ``control``: "recovers" (every image, at 30 dB), "recovers none",
    None (no control stored) or ``(info, records)``."""
    if control in ("recovers", "recovers none"):
        control = _control(steps, images, 30.0 if control == "recovers" else 12.0, batch=batch)
    info, found = control if control is not None else (None, None)
    base = {"defense": {"name": "prune"}, "attacks": [{"id": a, "name": a} for a in attacks], "steps": list(steps),
            "images": images, "thresholds": LeakRule().to_dict(), "status": "complete", "null": _nulls(images, batch),
            "risk_delta": {"delta": 5.0, "description": "l2"}, **({"control": info} if info else {}), **manifest}
    return AuditReport(build_report(base, records, rule, found))


def test_missing_evidence_never_reads_as_private():
    private = _ok(0, "ig", 0, 12.0, 0.1)  # judged: no recovered image
    cases = {  # what the other attack left -> the step's verdict is incomplete, naming it
        "raised": _rec(0, "mask-replay", 0, "error", reason="DefenseError: boom"),
        "failed to optimise": _rec(0, "mask-replay", 0, "failed_to_optimise"),
        "failed to optimise (trace)": {**_ok(0, "mask-replay", 0, 11.0, 0.1), "trace": {"failed_to_optimise": True}},
        "no evidence": _ok(0, "mask-replay", 0, None, None),
        "unknown status": _rec(0, "mask-replay", 0, "weird"),
    }
    for case, other in cases.items():
        report = _report([private, other])
        verdict = report.step(0)["verdict"]
        assert verdict["label"] == INCOMPLETE and report.verdict == INCOMPLETE, case
        assert verdict["failed_attacks"][0]["attack"] == "mask-replay" and verdict["judged"] == PRIVATE, case
        assert report.data["status"].startswith("incomplete (mask-replay"), case
        assert "mask-replay" in report.summary().splitlines()[-2 if report.failures else -1], case
    pending = _report([private])  # mask-replay has not run yet
    assert pending.verdict == INCOMPLETE and "pending" in pending.step(0)["verdict"]["reason"]
    # a leak found by the finished attacks stands whatever failed
    assert _report([_ok(0, "ig", 0, 25.0, 0.8), cases["raised"]]).verdict == RECOVERED
    # nothing applies: not judged, with the reason; never private
    na = _report([_rec(0, a, 0, "not_applicable", reason="needs an MLP") for a in ("ig", "mask-replay")])
    assert na.verdict == NOT_JUDGED and "not applicable" in na.data["verdict"]["reason"]
    assert _report([private, _rec(0, "mask-replay", 0, "not_applicable")]).verdict == PRIVATE


def test_an_attack_that_does_not_apply_reads_not_applicable_and_counts_as_neither_done_nor_missing():
    why = "analytic inversion needs a fully connected first layer; the model starts with Conv2d"
    records = [_ok(0, "ig", i, 12.0, 0.1) for i in range(2)] + [
        _rec(0, "analytic", i, "not_applicable", reason=why) for i in range(2)]
    report = _report(records, images=2, attacks=("ig", "analytic"))
    summary = report.step(0)["attacks"]["analytic"]
    assert summary["status"] == "not applicable" and summary["reason"] == why
    assert (summary["images_done"], summary["images_ok"], summary["images_not_applicable"]) == (0, 0, 2)
    assert report.data["progress"] == {"done": 2, "total": 2, "not_applicable": 2}
    assert report.data["status"] == "complete" and report.verdict == PRIVATE  # ig's evidence judges the step
    assert report.data["not_applicable"] == [{"attack": "analytic", "steps": [0], "reason": why}]
    md, html = report.to_markdown(), report.to_html()
    assert f"| 0 | 12.00 | not applicable ({why}) |" in md  # the PSNR-per-attack table
    assert f"| n/a | n/a | not applicable ({why}) |" in md and "| 0/2 |" not in md  # its ok/done column
    assert f"Status: complete, 2/2 (step, attack, image) results; not applicable: analytic at step 0 ({why})." in md
    assert f"2/2 (step, attack, image) results; not applicable: analytic at step 0 ({why})" in html
    assert "not applicable: analytic" in report.summary().splitlines()[0]
    # one image it does not apply to, one it ran on: counted apart, never a failure
    mixed = _report([_ok(0, "ig", 0, 12.0, 0.1), _rec(0, "analytic", 0, "not_applicable", reason=why),
                     _ok(0, "analytic", 1, 11.0, 0.1), _ok(0, "ig", 1, 12.0, 0.1)], images=2,
                    attacks=("ig", "analytic"))
    assert mixed.step(0)["attacks"]["analytic"]["status"] == "partly not applicable"
    assert mixed.data["progress"] == {"done": 3, "total": 3, "not_applicable": 1} and mixed.data["status"] == "complete"
    assert mixed.data["not_applicable"] == [] and "| 1/1 (1 not applicable) |" in mixed.to_markdown()
    # not applicable and still pending elsewhere: the pending work stays to do
    pending = _report([_rec(0, "analytic", 0, "not_applicable", reason=why)], images=1, attacks=("ig", "analytic"))
    assert pending.data["progress"] == {"done": 0, "total": 1, "not_applicable": 1} and pending.verdict == INCOMPLETE


def test_the_psnr_figure_plots_its_curves_and_the_chance_level_in_the_same_aligned_psnr():
    from audit.report.plots import psnr_vs_step_png, psnr_vs_step_series

    def aligned(attack, image, raw, value):  # raw PSNR below chance, aligned above it (a gain the gradient misses)
        rec = _ok(0, attack, image, raw, 0.1)
        rec["metrics"]["evidence"] = [_evidence(value, 1)]
        return rec

    records = [aligned("ig", 0, 10.0, 16.0), aligned("ig", 1, 9.0, 14.0),
               aligned("mask-replay", 0, 8.0, 12.0), aligned("mask-replay", 1, 7.0, 17.0)]
    report = _report(records, images=2)
    series = psnr_vs_step_series(report.data)
    assert series["quantity"] == "aligned PSNR" and series["chance"] == [(0, CHANCE)]
    assert series["curves"] == {"ig": [(0, 15.0)], "mask-replay": [(0, 14.5)]}
    assert series["worst"] == [(0, 16.5)]  # per image the best attack (16 and 17), then the mean
    assert report.step(0)["attacks"]["ig"]["psnr"] == 9.5  # the tables keep the raw PSNR
    assert report.verdict == RECOVERED  # the plotted worst case is above the plotted chance line, as judged
    assert psnr_vs_step_png(report.data).startswith(b"\x89PNG")


def test_overall_is_the_worst_judged_step_and_names_the_steps_not_judged():
    records = [_ok(0, "ig", 0, 12.0, 0.1), _ok(5, "ig", 0, 17.0, 0.2, rank=2), _rec(9, "ig", 0, "not_applicable")]
    report = _report(records, steps=(0, 5, 9), attacks=("ig",))
    verdict = report.data["verdict"]
    assert verdict["label"] == PARTIAL and verdict["worst_step"] == 5
    assert verdict["not_judged_steps"] == [{"step": 9, "reason": report.step(9)["verdict"]["reason"]}]
    assert "not judged: step 9" in report.to_markdown() and "not judged: step 9" in report.to_html()
    assert overall_verdict([])["label"] == NOT_JUDGED


def test_batches_are_judged_per_image_worst_and_mean_shown():
    # one image of the batch recovered exactly (200 dB), the other not at all: the mean (102.5)
    # and the worst image both show, and the verdict counts one recovered and one private image
    rec = _ok(0, "ig", 0, 102.5, 0.5, psnr_per_image=[200.0, 5.0], ssim_per_image=[1.0, 0.0], l2=[0.0, 20.0],
              evidence=[_evidence(200.0, 1), _evidence(5.0, 50)])
    report = _report([rec], attacks=("ig",), batch=2)
    step = report.step(0)
    assert [e["image_class"] for e in step["worst_case"]["per_image"]] == ["recovered", "not recovered"]
    assert step["worst_case"]["psnr"] == pytest.approx(102.5) and step["worst_case"]["psnr_max"] == 200.0
    assert step["risk"]["success"] == 0.5 and step["attacks"]["ig"]["psnr_max"] == 200.0
    low = _ok(0, "ig", 0, 16.0, 0.3, psnr_per_image=[21.0, 11.0], ssim_per_image=[0.3, 0.3],
              evidence=[_evidence(21.0, 1), _evidence(11.0, 9)])
    assert _report([low], attacks=("ig",), batch=2).verdict == RECOVERED  # the batch mean would say partially
    assert "200.00" in report.to_markdown()  # the worst-image column


def test_input_transform_scored_against_both_and_judged_on_the_worse():
    rec = _ok(0, "ig", 0, 8.0, 0.05, rank=20)
    rec["metrics_trained"] = {"psnr": 31.0, "ssim": 0.9, "lpips": None, "label_acc": 1.0, "l2": [0.5],
                              "evidence": [_evidence(31.0, 1, chance_level=24.0)]}
    report = _report([rec], attacks=("ig",), differences=["Operations run on float tensors."])
    summary = report.step(0)["attacks"]["ig"]
    assert (summary["psnr_original"], summary["psnr_trained"]) == (8.0, 31.0)
    assert report.verdict == RECOVERED and report.step(0)["risk"]["success"] == 1.0
    assert report.step(0)["worst_case"]["per_image"][0]["chance_level"] == 24.0  # the trained batch's own
    rec["metrics_trained"]["evidence"] = [_evidence(31.0, 1, chance_level=30.5)]  # 0.5 dB above its chance
    assert _report([rec], attacks=("ig",)).verdict == PARTIAL
    md = report.to_markdown()
    assert "| 8.00 | 31.00 |" in md and "- Operations run on float tensors." in md
    assert "Operations run on float tensors." in report.to_html()


def test_privacy_section_shows_epsilon_or_says_not_applicable():
    privacy = {"applicable": True, "accountant": "rdp", "delta": 1e-5, "description": "RDP",
               "per_step": [{"step": 0, "rounds": 0, "epsilon": 0.0, "delta": 1e-5},
                            {"step": 5, "rounds": 5, "epsilon": 1.234, "delta": 1e-5}]}
    md = _report([_ok(0, "ig", 0, 12.0, 0.1)], attacks=("ig",), privacy=privacy).to_markdown()
    assert "| 5 | 5 | 1.23 | 1e-05 | n/a |" in md
    none = _report([_ok(0, "ig", 0, 12.0, 0.1)], attacks=("ig",)).to_markdown()
    assert "## Privacy spent" in none and "not applicable" in none


def test_a_no_recovered_image_verdict_states_what_it_excludes_and_rerendering_rejudges(tmp_path):
    records = [_ok(0, "ig", i, 15.5, 0.2, rank=1) for i in range(4)]  # 0.5 dB above chance, identified
    report = _report(records, images=4, attacks=("ig",))
    verdict = report.step(0)["verdict"]
    assert verdict["label"] == PARTIAL and verdict["recovered"] == 0
    assert verdict["excludes_rate_above"] == pytest.approx(1 - 0.05 ** 0.25)  # 53% with 0 of 4
    assert verdict["images_to_exclude"] == {"rate": 0.05, "images": 59}
    assert "excludes a recovery rate above 53%" in report.summary() and "59 images" in report.summary()
    # the same evidence under a smaller margin: recovered, without recomputing anything
    looser = _report(records, images=4, attacks=("ig",), rule=LeakRule(margin_db=0.5))
    assert looser.verdict == RECOVERED and looser.step(0)["verdict"]["recovered"] == 4
    store = _store(tmp_path)
    assert render(tmp_path, thresholds="margin_db=16").verdict == PARTIAL  # the best is 15 dB above chance
    assert render(tmp_path).verdict == RECOVERED and store.load_manifest()["thresholds"]["margin_db"] == 1.0


def test_rerun_retries_stored_errors_unless_told_not_to(tmp_path):
    store = ResultStore.create(tmp_path, {"seed": 0})
    store.save_result(_rec(0, "ig", 0, "error", reason="TimeoutError"))
    store.save_result(_rec(0, "ig", 1, "not_applicable"))
    assert not store.has(0, "ig", 0) and store.has(0, "ig", 1)
    assert ResultStore.create(tmp_path, {"seed": 0}, retry_errors=False).has(0, "ig", 0)


# --------------------------------------------------------------------------- the positive control
def test_no_recovered_image_needs_a_control_that_recovers_the_same_images():
    unrecovered = [_ok(0, "ig", i, 12.0, 0.1) for i in range(3)]  # the defended run: nothing recovered
    held = _report(unrecovered, images=3, attacks=("ig",))
    verdict = held.step(0)["verdict"]
    assert held.verdict == PRIVATE and held.step(0)["control"]["recovered"] == 3
    assert verdict["defense_effect"]["stopped"] == 3 and verdict["defense_effect"]["p_value"] == pytest.approx(1 / 8)
    assert "the defense stops 3 of the 3 image(s) its control recovered" in held.summary()
    # the same attacks recover none of the images without the defense: attack power, never private
    weak = _report(unrecovered, images=3, attacks=("ig",), control="recovers none")
    assert weak.verdict == INCONCLUSIVE and weak.step(0)["verdict"]["label"] == INCONCLUSIVE
    assert "recover none of these 3 images without the defense at budget 200" in weak.step(0)["verdict"]["reason"]
    assert "--budget" in weak.summary() and "no recovered image" not in weak.summary().splitlines()[-1]
    # an attack that does not apply to the model is named apart, never as one that recovered none
    info, none = _control(images=3, psnr=12.0)
    info["attacks"] = ["ig", "analytic"]
    skipped = none + [_rec(0, "analytic", i, "not_applicable") for i in range(3)]
    reason = _report(unrecovered, images=3, attacks=("ig",), control=(info, skipped)).step(0)["verdict"]["reason"]
    assert reason.startswith("attack power: ig (analytic: not applicable to this model) recover none of these 3")
    # no control stored, or a control that failed: incomplete
    assert _report(unrecovered, images=3, attacks=("ig",), control=None).verdict == INCOMPLETE
    info, records = _control(images=3)
    failed = [_rec(0, "ig", i, "error", reason="RuntimeError: boom") for i in range(3)]
    assert _report(unrecovered, images=3, attacks=("ig",), control=(info, failed)).verdict == INCOMPLETE
    # a control that recovered two images and failed on the third still shows the defense stopping two
    partial = records[:2] + failed[2:]
    stopped = _report(unrecovered, images=3, attacks=("ig",), control=(info, partial)).step(0)["verdict"]
    assert stopped["label"] == PRIVATE and stopped["defense_effect"]["stopped"] == 2
    # a leak stands whatever the control found, and the control is shown beside it
    leak = _report([_ok(0, "ig", 0, 30.0, 0.9)], attacks=("ig",), control="recovers none")
    assert leak.verdict == RECOVERED and leak.step(0)["control"]["recovered"] == 0
    assert leak.data["steps"][0]["control"]["recovery_rate"]["n"] == 1  # report.json carries it


def test_a_partly_recovering_control_is_paired_image_by_image():
    info, records = _control(images=4)
    records[1]["metrics"]["evidence"] = [_evidence(12.0, 30)]  # the control misses image 1
    defended = [_ok(0, "ig", i, 30.0 if i == 1 else 12.0, 0.5) for i in range(4)]  # ... which the defended run gets
    effect = _report(defended, images=4, attacks=("ig",), control=(info, records)).step(0)["verdict"]["defense_effect"]
    assert (effect["stopped"], effect["let_through"], effect["control_recovered"]) == (3, 1, 3)
    from scipy.stats import binomtest

    assert effect["p_value"] == pytest.approx(binomtest(3, 4, 0.5, alternative="greater").pvalue)


def test_the_overall_verdict_is_the_worst_step_including_those_not_judged():
    def step(n, label):
        return {"step": n, "verdict": {"label": label, "reason": f"why {n}"},
                "worst_case": {"psnr": 10.0, "above_chance_max": -3.0}}

    assert overall_verdict([step(1, PRIVATE), step(2, NOT_JUDGED)])["label"] == NOT_JUDGED
    assert overall_verdict([step(1, PRIVATE), step(2, INCONCLUSIVE)])["label"] == INCONCLUSIVE
    assert overall_verdict([step(1, INCONCLUSIVE), step(2, INCOMPLETE)])["label"] == INCOMPLETE
    assert overall_verdict([step(1, NOT_JUDGED), step(2, RECOVERED)])["label"] == RECOVERED
    assert overall_verdict([step(1, PRIVATE), step(2, PRIVATE)])["label"] == PRIVATE
    assert overall_verdict([step(1, PRIVATE), step(2, "a label from elsewhere")])["label"] == NOT_JUDGED


def test_a_reason_stored_as_a_code_is_worded_by_the_report_and_an_older_sentence_as_it_was():
    from audit.core.reasons import Reason

    coded = Reason("analytic-one-image", batch=4)
    unused = Reason("bn-upload-unused", why=Reason("buffers-eval-mode").to_dict())
    records = [_ok(0, "ig", 0, 12.0, 0.1), _rec(0, "analytic", 0, "not_applicable", why=coded.to_dict())]
    report = _report(records, attacks=("ig", "analytic"), plan={"side_information": {"bn-upload": unused.to_dict()}},
                     settings={"images": 1})
    text = "analytic inversion is exact for one image; the batch has 4"
    assert report.record.results[1].why == coded and report.record.results[1].reason == ""  # the code is stored
    assert report.step(0)["attacks"]["analytic"]["reason"] == text  # the report words it
    md, html = report.to_markdown(), report.to_html()
    assert f"| 0 | 12.00 | not applicable ({text}) |" in md and f'title="{text}"' in html
    assert "- bn-upload: not used: the client trains in eval mode: its BatchNorm buffers do not change" in md
    # report.json read back renders the same, its results still holding the code
    again = AuditReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again.record.results[1].why == coded and again.to_markdown() == md
    # a sentence stored before codes, and a code without a template, still render
    older = _report([_ok(0, "ig", 0, 12.0, 0.1), _rec(0, "analytic", 0, "not_applicable", reason="needs an MLP")],
                    attacks=("ig", "analytic"))
    assert older.step(0)["attacks"]["analytic"]["reason"] == "needs an MLP"
    unknown = _report([_ok(0, "ig", 0, 12.0, 0.1),
                       _rec(0, "analytic", 0, "not_applicable", why={"code": "my-attack-no-conv", "params": {"k": 2}})],
                      attacks=("ig", "analytic"))
    assert unknown.step(0)["attacks"]["analytic"]["reason"] == "my-attack-no-conv (k=2)"


def test_every_reason_code_the_toolkit_stores_has_the_reports_template():
    """Each ``Reason("code", ...)`` written in the attacks, priors, adaptive attacks and the
    ground floor has a template in the report's registry, and each template words its values."""
    import pathlib
    import pickle

    from audit.core.errors import NotApplicable
    from audit.core.reasons import Reason
    from audit.report.reasons import REASONS, word

    root = pathlib.Path(__file__).resolve().parents[1]
    codes = {m for folder in ("attacks", "adaptive", "priors", "audit") for path in (root / folder).rglob("*.py")
             for m in re.findall(r'Reason\(\s*"([a-z0-9-]+)"', path.read_text())}
    assert len(codes) > 40 and not codes - set(REASONS.names()), sorted(codes - set(REASONS.names()))
    assert word(Reason("spear-too-few-rows", rows=1, layer="fc1", batch=2)) == (
        "only 1 rows of 'fc1''s gradient are non-zero, fewer than the batch of 2")
    err = pickle.loads(pickle.dumps(NotApplicable(Reason("idlg-one-image", batch=3))))  # a Ray task's error
    assert err.reason == Reason("idlg-one-image", batch=3) and "batch has 3" in word(err.reason)
    from cli import error_text  # the command line prints it in the report's words

    assert error_text(err) == "not applicable: " + word(err.reason)
