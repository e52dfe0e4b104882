"""The papers page (bench/bench_papers.py): cells pooled from stored audit records, and the
conclusions decided by the identification interval, failing closed."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from audit.core.records import AttackResult, ImageEvidence, NullEvidence, Scores, Status  # noqa: E402
from bench import bench_papers as bp  # noqa: E402
from bench import papers_verdict as pv  # noqa: E402

K = 64


def _record(step, attack, image, psnr, rank, status=Status.OK):
    metrics = Scores(psnr=psnr, ssim=0.5, lpips=0.2, label_acc=1.0, psnr_per_image=[psnr], ssim_per_image=[0.5],
                     lpips_per_image=[0.2], l2=[1.0], evidence=[ImageEvidence(psnr, rank, K)])
    return AttackResult(step=step, attack_id=attack, image=image, attack=attack, status=status,
                        metrics=metrics if status == Status.OK else None).to_dict()


def _manifest(images, chance=15.0):
    null = NullEvidence(["mean", "other"], [chance, chance - 3], [30, 40], K, 127, "lpips")
    return {"images": images, "thresholds": {}, "null": {"images": [[null.to_dict()] for _ in range(images)]}}


def test_a_cell_takes_each_image_at_its_most_leaking_attack_and_counts_identification():
    # image 0: ig misses, the adaptive attack identifies it; image 1: nobody does
    records = [_record(0, "ig", 0, 12.0, 20), _record(0, "mask-replay", 0, 30.0, 1),
               _record(0, "ig", 1, 11.0, 9), _record(0, "mask-replay", 1, 13.0, 5)]
    cell = pv.cell_evidence(_manifest(2), records, ["ig", "mask-replay"], [0])
    assert (cell.images, cell.identified, cell.recovered, cell.candidates) == (2, 1, 1, K)
    assert cell.psnr == pytest.approx((30.0 + 13.0) / 2)
    assert cell.strongest == "mask-replay" and cell.complete
    alone = pv.cell_evidence(_manifest(2), records, ["ig"], [0])
    assert (alone.identified, alone.recovered) == (0, 0)
    assert alone.psnr == pytest.approx(11.5)


def test_missing_evidence_is_never_read_as_protection():
    records = [_record(0, "ig", 0, 12.0, 20), _record(0, "ig", 1, 0.0, 0, status=Status.ERROR)]
    cell = pv.cell_evidence(_manifest(2), records, ["ig"], [0])
    assert cell.missing and not cell.complete
    assert pv.conclude_protects([cell], at_paper_budget=True).outcome == pv.INCONCLUSIVE
    pending = pv.cell_evidence(_manifest(2), records[:1], ["ig"], [0])  # image 1 has not run
    assert pv.conclude_protects([pending], at_paper_budget=True).outcome == pv.INCONCLUSIVE


def _cell(identified, images=16, missing=()):
    c = pv.CellEvidence(["ig"], [0], images=images, identified=identified, recovered=identified, candidates=K,
                        psnr=20.0, strongest="ig", missing=list(missing))
    c.per_image_identified = {(0, i, 0): i < identified for i in range(images)}
    return c


def test_protection_fails_only_when_identification_is_above_chance():
    # 2 of 16: the interval's lower end (0.2%) is below chance (1/64), 3 of 16 is above it
    assert pv.conclude_protects([_cell(2)], True).outcome == pv.HOLDS
    failed = pv.conclude_protects([_cell(0), _cell(3)], True)
    assert failed.outcome == pv.FAILS and "3 of 16 recovered" in failed.detail
    # below the paper's budget no recovered image is not evidence that the defense holds
    assert pv.conclude_protects([_cell(0)], False).outcome == pv.INCONCLUSIVE
    assert pv.conclude_protects([_cell(16)], False).outcome == pv.FAILS
    assert pv.conclude_protects([None], True).outcome == pv.NOT_RUN


def test_a_leak_claim_holds_above_chance_and_fails_only_at_the_paper_budget():
    assert pv.conclude_leaks(_cell(12), False).outcome == pv.HOLDS
    assert pv.conclude_leaks(_cell(0), False).outcome == pv.INCONCLUSIVE
    assert pv.conclude_leaks(_cell(0), True).outcome == pv.FAILS
    assert pv.conclude_leaks(_cell(0, missing=["step 0: ig failed"]), True).outcome == pv.INCONCLUSIVE


def test_a_leak_shown_by_another_cell_confirms_the_leak_claim_and_is_named():
    # the paper's attack at chance, the planner's above it: the defense leaks, by the planner
    held = pv.conclude_leaks(_cell(1), False, [("the planner's", _cell(13))])
    assert held.outcome == pv.HOLDS and "by the planner's ig, 13 of 16 recovered" in held.detail
    assert "the paper's attack: 1 of 16 identified" in held.detail
    # another cell at chance changes nothing; a missing one neither
    assert pv.conclude_leaks(_cell(0), True, [("the planner's", _cell(2)), ("x", None)]).outcome == pv.FAILS


def test_exact_mcnemar():
    assert pv.mcnemar_exact(0, 0) == 1.0
    assert pv.mcnemar_exact(6, 0) == pytest.approx(2 / 64)  # 2 * 0.5^6
    assert pv.mcnemar_exact(3, 3) == 1.0


def test_the_order_of_attacks_is_tested_pair_by_pair_on_the_same_images():
    bayes, weak = _cell(8), _cell(0)
    gaps = {"l2": 3.0}
    assert pv.conclude_order(bayes, {"l2": weak}, gaps).outcome == pv.HOLDS  # 8 wins, 0 losses
    assert pv.conclude_order(weak, {"l2": bayes}, gaps).outcome == pv.FAILS
    assert pv.conclude_order(_cell(0), {"l2": _cell(0)}, {"l2": 0.2}).outcome == pv.INCONCLUSIVE
    assert pv.conclude_order(_cell(5), {"l2": _cell(5)}, {"l2": 0.2}).outcome == pv.HOLDS  # a tie, as claimed
    assert pv.conclude_order(bayes, {"l2": weak}, {"l2": 0.2}).outcome == pv.FAILS  # a difference the paper has not


def test_utility_gaps_are_judged_against_the_spread_over_seeds():
    def spread(mean, std):
        return {"mean": mean, "std": std, "runs": [{}, {}, {}]}

    assert pv.conclude_utility({"defended": spread(0.5, 0.02), "undefended": spread(0.6, 0.02)},
                               "not-worse").outcome == pv.FAILS
    assert pv.conclude_utility({"defended": spread(0.58, 0.02), "undefended": spread(0.6, 0.02)},
                               "not-worse").outcome == pv.HOLDS
    assert pv.conclude_utility({"defended": spread(0.45, 0.02), "undefended": spread(0.6, 0.02)},
                               "ratio", 0.9).outcome == pv.FAILS  # 0.45 < 0.9 * 0.6 - 0.04
    assert pv.conclude_utility({"defended": spread(0.52, 0.02), "undefended": spread(0.6, 0.02)},
                               "ratio", 0.9).outcome == pv.HOLDS  # within the noise of 0.54
    assert pv.conclude_utility({"unavailable": "off"}, "not-worse").outcome == pv.NOT_RUN


def test_every_row_follows_its_paper_and_states_its_deviation():
    ids = [r.id for r in bp.ROWS]
    assert len(ids) == len(set(ids))
    for paper in bp.PAPERS:
        assert any(r.paper == paper for r in bp.ROWS)
    for row in bp.ROWS:
        if row.claim != "utility":
            assert row.attacks and all(a.label for a in row.attacks)
        call = bp.audit_call(row, bp.Profile("default", 16), "embedded", {}, Path("/tmp/x"))
        assert call["images"] >= 16 or row.claim == "utility"
        dev = bp.deviation_text(row, None, "default", "embedded")
        if row.budget("default") < max([a.paper_budget for a in row.attacks] or [0]):
            assert "iterations" in dev, row.id
        assert bp.budget_full_is_paper(row)
    censor = bp.BY_ID["censor-censor"]
    assert censor.attacks[0].args["restarts"] == 4 and censor.attacks[0].args["tv"] == 1e-4
    assert bp.deviation_text(censor, None, "default", "embedded").startswith(f"{bp.R18_BUDGET // 4} of 15,000 iterations x 4")


def test_the_page_marks_rows_not_yet_run_and_renders_stored_ones(tmp_path):
    row = bp.BY_ID["censor-none"]
    page = bp.render([row], tmp_path, bp.Profile("default", 16), "embedded", {})
    assert "not yet run" in page and "| Table II, CIFAR-10, IG, no defense |" in page
    call = bp.audit_call(row, bp.Profile("default", 16), "embedded", {}, tmp_path)
    records = [_record(0, "ig", i, 25.0, 1) for i in range(16)] + [_record(0, "portfolio", i, 20.0, 2)
                                                                     for i in range(16)]
    manifest = _manifest(16)
    cells = {"paper:ig": pv.cell_evidence(manifest, records, ["ig"], [0]).to_dict(),
             "planner": pv.cell_evidence(manifest, records, ["portfolio", "ig"], [0]).to_dict()}
    summary = {"row": row.id, "call": json.loads(json.dumps(call)), "cells": cells, "seconds": 1.0}
    path = bp.summary_path(tmp_path, row, "default", "embedded")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(summary))
    page = bp.render([row], tmp_path, bp.Profile("default", 16), "embedded", {})
    assert "not yet run" not in page and "16 of 16 identified" in page
    assert "the claim holds" in page  # the undefended model leaks, as the paper says


def test_the_planner_cell_is_what_auto_ran_and_the_paper_cell_only_the_papers_attack():
    manifest = {"attacks": [{"id": "ig", "reason": bp.USER}, {"id": "portfolio", "reason": "naive baseline"},
                            {"id": "mask-replay", "reason": "sparse"}, {"id": "dlg", "reason": bp.USER}]}
    assert bp.planner_attacks(manifest) == ["ig", "portfolio", "mask-replay"]  # auto always runs ig
    row = bp.BY_ID["svd-censor"]  # the paper's IG at round 0, its adaptive attack at round 5
    records = [_record(s, "ig", i, 20.0, 1 if s == 5 else 30) for s in (0, 5) for i in range(2)]
    cells = bp.row_cells(row, {"steps": [0, 5]}, {**_manifest(2), **manifest}, records)
    assert cells["paper:ig"]["steps"] == [0] and cells["paper:ig"]["identified"] == 0
    assert cells["adaptive"]["steps"] == [5] and cells["adaptive"]["identified"] == 2
    assert bp.conclude(row, {"call": {"budget": 200, "model_args": {"width": 16}}, "cells": cells}).outcome == pv.HOLDS


def test_svdefense_appendix_attacks_need_no_new_attack_here():
    """The page's reasons: a hidden learning rate only scales a FedSGD update, to which IG's
    cosine objective is blind; ``quantize`` shares dequantised values, so each tensor's range
    (what mixed quantisation hides) is read off the observation exactly."""
    import torch

    from attacks.objectives import OBJECTIVES
    from defenses import build_defense

    gen = torch.Generator().manual_seed(0)
    target = [torch.randn(4, 3, generator=gen), torch.randn(4, generator=gen)]
    dummy = [torch.randn(4, 3, generator=gen), torch.randn(4, generator=gen)]
    cosine = OBJECTIVES.build("cosine")
    assert float(cosine(dummy, [0.37 * t for t in target])) == pytest.approx(float(cosine(dummy, target)), rel=1e-5)
    l2 = OBJECTIVES.build("l2")
    assert float(l2(dummy, [0.37 * t for t in target])) != pytest.approx(float(l2(dummy, target)), rel=1e-3)
    shared = build_defense("quantize", bits=4).transform(target)
    for s, g in zip(shared, target):
        assert float(s.min()) == pytest.approx(float(g.min())) and float(s.max()) == pytest.approx(float(g.max()))
        assert len(torch.unique(s)) <= 16


def test_every_row_builds_its_defense_model_and_attacks():
    """A row whose defense, model or attack settings the registries reject would fail only
    after hours of the bench: they are built here, in both profiles."""
    import adaptive  # noqa: F401  (registers the adaptive attacks)
    from attacks import ATTACKS
    from audit.core.models import MODELS
    from defenses import build_defense

    for row in bp.ROWS:
        build_defense(row.defense, **row.defense_args)
        for profile in ("default", "full"):
            MODELS.build(row.model, (3, 32, 32), 10, **row.run_model_args(profile))
        call = bp.audit_call(row, bp.Profile("default", 16), "embedded", {}, Path("/tmp/x"))
        for name, kw in (call["attack_args"] or {}).items():
            ATTACKS.build(name, **kw)
        for name in call["attacks"]:
            assert name == "auto" or name in ATTACKS, (row.id, name)


def test_rows_sharing_a_result_store_run_each_attack_with_the_same_settings():
    """Stored results are reused only under the same attack settings: two rows of one store
    asking one attack with different settings would redo each other's results forever."""
    seen = {}
    for row in bp.ROWS:
        call = bp.audit_call(row, bp.Profile("default", 16), "embedded", {}, Path("/tmp/x"))
        key = (call["out"], json.dumps(call["defense_args"], sort_keys=True), call["budget"], call["utility"])
        for name, kw in (call["attack_args"] or {}).items():
            previous = seen.setdefault((key, name), (row.id, kw))
            assert previous[1] == kw, f"{row.id} and {previous[0]} run {name} differently in one store"


def test_a_resumed_row_counts_the_earlier_invocations_of_the_same_run_only(tmp_path):
    path = tmp_path / "row.json"
    assert bp.earlier_seconds(path, "abc") == 0.0  # nothing stored yet
    path.write_text(json.dumps({"run_key": "abc", "seconds": 250.0}))
    assert bp.earlier_seconds(path, "abc") == 250.0
    assert bp.earlier_seconds(path, "other") == 0.0  # changed settings: a new run


def test_the_default_profile_runs_the_rows_planner_subset_and_says_so():
    """ConvBig's Soteria row: the default profile names a subset of the planner's attacks
    instead of ``auto`` and the deviation says which; ``--full`` runs ``auto``."""
    row = bp.BY_ID["bayes-soteria"]
    default = bp.audit_call(row, bp.Profile("default", 16), "embedded", {}, Path("/tmp/x"))
    full = bp.audit_call(row, bp.Profile("full", 16), "embedded", {}, Path("/tmp/x"))
    assert "auto" not in default["attacks"] and {"ig", "portfolio", "mask-replay"} <= set(default["attacks"])
    assert "through-defense" not in default["attacks"] and "auto" in full["attacks"]
    assert "of the planner's attacks only ig, portfolio" in bp.deviation_text(row, None, "default", "embedded")
    assert "of the planner's attacks only" not in bp.deviation_text(row, None, "full", "embedded")
    assert bp.audit_call(bp.BY_ID["censor-none"], bp.Profile("default", 16), "embedded", {},
                         Path("/tmp/x"))["attacks"] == ["ig", "auto"]


def test_a_page_written_while_running_some_rows_shows_every_row(tmp_path, monkeypatch):
    """``--rows`` chooses what runs; the page keeps every row and names the whole command."""
    written = {}
    monkeypatch.setattr(bp, "write_table", lambda page, name, command, table, setting: written.update(
        command=command, table=table))
    bp.main(["--rows", "bayes-precode", "--render", "--docs", "papers", "--out", str(tmp_path)])
    assert written["command"] == f"python bench/bench_papers.py --docs papers --out {tmp_path}"
    for row in bp.selected(None, None, "default"):
        assert row.figure in written["table"]
    assert bp.page_command(["--paper=CENSOR", "--rows", "x", "--full"]) == ["--full"]
