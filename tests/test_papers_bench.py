"""The papers page (bench/papers/): cells pooled from stored audit records, and the
conclusions decided by the identification interval, failing closed."""
import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from audit.core.records import AttackResult, ImageEvidence, NullEvidence, Scores, Status
from audit.engine import schedule
from bench.papers import cells as pcells
from bench.papers import cli as pcli
from bench.papers import evidence as pevidence
from bench.papers import gpu as pgpu
from bench.papers import health as phealth
from bench.papers import judge as pjudge
from bench.papers import render as prender
from bench.papers import rows as prows
from bench.papers import run as prun
from bench.papers import search as psearch
from bench.papers import slices as pslices
from bench.papers import spec as pspec
from bench.papers import stale as pstale
from bench.papers import store as pstore
from bench.papers import verdict as pverdict

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
    cell = pevidence.cell_evidence(_manifest(2), records, ["ig", "mask-replay"], [0])
    assert (cell.images, cell.identified, cell.recovered, cell.candidates) == (2, 1, 1, K)
    assert cell.psnr == pytest.approx((30.0 + 13.0) / 2)
    assert cell.strongest == "mask-replay" and cell.complete
    alone = pevidence.cell_evidence(_manifest(2), records, ["ig"], [0])
    assert (alone.identified, alone.recovered) == (0, 0)
    assert alone.psnr == pytest.approx(11.5)


def test_missing_evidence_is_never_read_as_protection():
    records = [_record(0, "ig", 0, 12.0, 20), _record(0, "ig", 1, 0.0, 0, status=Status.ERROR)]
    cell = pevidence.cell_evidence(_manifest(2), records, ["ig"], [0])
    assert cell.missing and not cell.complete
    assert pverdict.conclude_protects([cell], at_paper_budget=True).outcome == pverdict.INCONCLUSIVE
    pending = pevidence.cell_evidence(_manifest(2), records[:1], ["ig"], [0])  # image 1 has not run
    assert pverdict.conclude_protects([pending], at_paper_budget=True).outcome == pverdict.INCONCLUSIVE


def _cell(identified, images=16, missing=(), control=None):
    """A cell identifying and recovering its first ``identified`` images; ``control``: the number
    of the first images its positive control recovers (None: no control stored)."""
    c = pevidence.CellEvidence(["ig"], [0], images=images, identified=identified, recovered=identified, candidates=K,
                        psnr=20.0, strongest="ig", missing=list(missing))
    c.per_image_identified = {(0, i, 0): i < identified for i in range(images)}
    c.per_image_recovered = dict(c.per_image_identified)
    if control is not None:
        c.control = {(0, i, 0): i < control for i in range(images)}
    return c


def test_the_power_column_names_each_cells_control():
    power = prender._power({"paper:ig": _cell(0, control=5), "planner": _cell(2), "adaptive": None})
    assert power == "ig 5/16; planner none stored"
    assert prender._power({"paper:ig": None}) == "-"
    older = _cell(0, control=5)
    older.per_image_recovered = {}  # a cell stored before it kept per-image recoveries: its control still counts
    assert prender._power({"planner": older}) == "planner 5/16"


def test_protection_holds_only_where_the_control_recovers_what_the_defense_significantly_stops():
    # nothing above chance but no control stored: never "holds"
    bare = pverdict.conclude_protects([_cell(0)], True)
    assert bare.outcome == pverdict.INCONCLUSIVE and pevidence.NO_CONTROL in bare.text()
    # the control recovers nothing: attack power, inconclusive
    weak = pverdict.conclude_protects([_cell(0, control=0)], True)
    assert weak.outcome == pverdict.INCONCLUSIVE and "attack power" in weak.detail
    # an attack that applies to none of the defended uploads, beside a powerless one: both named
    unread = pevidence.CellEvidence(["conv-span"], [0], images=0, identified=0, recovered=0, candidates=K)
    unread.control = {(0, i, 0): True for i in range(8)}
    both = pverdict.conclude_protects([_cell(0, images=8, control=0), unread], True)
    assert both.outcome == pverdict.INCONCLUSIVE, both.text()
    assert "the control of ig recovers none of 8 images" in both.detail, both.detail
    assert "conv-span applies to none of the defended uploads (its control recovers 8 of 8 without the defense)" \
        in both.detail, both.detail
    # the control recovers 8 and the defense stops all 8: p = 0.5^8, holds, with its power stated
    held = pverdict.conclude_protects([_cell(0, control=8)], True)
    assert held.outcome == pverdict.HOLDS and "8 of 16 recovered without the defense" in held.detail
    assert "stops 8 of 8" in held.detail
    # the control recovers 3, the defense stops 2 of them (not above chance): p = 0.5, not significant
    partial = _cell(1, control=3)
    assert pverdict.conclude_protects([partial], True).outcome == pverdict.INCONCLUSIVE
    assert "not significant" in pverdict.conclude_protects([partial], True).detail
    # every cell must show it: one cell without its control keeps the row inconclusive
    assert pverdict.conclude_protects([_cell(0, control=8), _cell(0)], True).outcome == pverdict.INCONCLUSIVE
    # an incomplete control is not a control
    broken = _cell(0, control=8)
    broken.control_missing = "step 0: the control is incomplete"
    assert pverdict.conclude_protects([broken], True).outcome == pverdict.INCONCLUSIVE


def test_a_cells_control_survives_storage_and_restriction_to_steps():
    c = _cell(0, control=8)
    back = pevidence.CellEvidence.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back.control == c.control and back.control_effect() == c.control_effect()
    assert back.control_effect().stopped == 8 and back.control_effect().p_value == pytest.approx(0.5 ** 8)
    assert pevidence.CellEvidence.from_dict(_cell(0).to_dict()).control is None
    report = [{"step": 0, "control": {"available": True, "per_image": [{"image": i, "index": 0, "recovered": i < 2}
                                                                      for i in range(4)]}},
              {"step": 1, "control": {"available": False, "reason": "incomplete", "per_image": []}}]
    control, why = pevidence.control_from_report(report, [0])
    assert control == {(0, 0, 0): True, (0, 1, 0): True, (0, 2, 0): False, (0, 3, 0): False} and why == ""
    assert "step 1: incomplete" in pevidence.control_from_report(report, [0, 1])[1]
    assert pevidence.control_from_report([{"step": 0}], [0]) == (None, "")


def test_protection_fails_only_when_identification_is_above_chance():
    # 2 of 16: the interval's lower end (0.2%) is below chance (1/64), 3 of 16 is above it
    assert pverdict.conclude_protects([_cell(2, control=10)], True).outcome == pverdict.HOLDS
    failed = pverdict.conclude_protects([_cell(0), _cell(3)], True)
    assert failed.outcome == pverdict.FAILS and "3 of 16 recovered" in failed.detail
    # below the paper's budget no recovered image is not evidence that the defense holds
    assert pverdict.conclude_protects([_cell(0)], False).outcome == pverdict.INCONCLUSIVE
    assert pverdict.conclude_protects([_cell(16)], False).outcome == pverdict.FAILS
    assert pverdict.conclude_protects([None], True).outcome == pverdict.NOT_RUN


def test_a_leak_claim_holds_above_chance_and_fails_only_at_the_paper_budget():
    assert pverdict.conclude_leaks(_cell(12), False).outcome == pverdict.HOLDS
    assert pverdict.conclude_leaks(_cell(0), False).outcome == pverdict.INCONCLUSIVE
    assert pverdict.conclude_leaks(_cell(0), True).outcome == pverdict.INCONCLUSIVE  # no control: never a verdict
    assert pverdict.conclude_leaks(_cell(0, control=0), True).outcome == pverdict.INCONCLUSIVE  # no attack power
    assert pverdict.conclude_leaks(_cell(0, control=6), True).outcome == pverdict.FAILS
    assert pverdict.conclude_leaks(_cell(0, missing=["step 0: ig failed"]), True).outcome == pverdict.INCONCLUSIVE


def test_a_leak_shown_by_another_cell_confirms_the_leak_claim_and_is_named():
    # the paper's attack at chance, the planner's above it: the defense leaks, by the planner
    held = pverdict.conclude_leaks(_cell(1), False, [("the planner's", _cell(13))])
    assert held.outcome == pverdict.HOLDS and "by the planner's ig, 13 of 16 recovered" in held.detail
    assert "the paper's attack: 1 of 16 identified" in held.detail
    # another cell at chance changes nothing; a missing one neither
    assert pverdict.conclude_leaks(_cell(0, control=6), True, [("the planner's", _cell(2)), ("x", None)]).outcome == pverdict.FAILS
    # a leak decides before the paper's attack has run; no leak yet leaves the claim not run
    early = pverdict.conclude_leaks(None, True, [("the planner's", _cell(13))])
    assert early.outcome == pverdict.HOLDS and early.decided and "the paper's attack: not run yet" in early.detail
    assert pverdict.conclude_leaks(None, True, [("the planner's", _cell(2))]).outcome == pverdict.NOT_RUN


def test_a_claim_about_early_steps_is_judged_on_those_steps_alone():
    # 6 images: identified at step 1 by ig, at chance at step 50 where ig failed on image 5
    records = [_record(1, "ig", i, 25.0, 1) for i in range(6)]
    records += [_record(50, "ig", i, 11.0, 30) for i in range(5)]
    records += [_record(50, "ig", 5, 0.0, 0, status=Status.FAILED_TO_OPTIMISE)]
    coin = NullEvidence(["mean", "other"], [15.0, 12.0], [1, 40], K, 127, "lpips")  # chance 1/2
    manifest = {"images": 6, "thresholds": {}, "null": {"images": [[coin.to_dict()] for _ in range(6)]}}
    cell = pevidence.cell_evidence(manifest, records, ["ig"], [1, 50])
    # pooled over the steps, 6 of 11 is not above a chance of 1/2, and step 50 misses evidence
    assert cell.chance == pytest.approx(0.5) and pverdict.conclude_leaks(cell, True).outcome == pverdict.INCONCLUSIVE
    assert cell.missing and cell.per_step_recovered == {1: 6, 50: 0}
    early = pevidence.CellEvidence.from_dict(cell.to_dict()).at_steps([1])
    assert (early.images, early.identified, early.recovered, early.missing) == (6, 6, 6, [])
    assert early.psnr == pytest.approx(25.0)
    assert pverdict.conclude_leaks(early, True).outcome == pverdict.HOLDS
    # the ATS row judges its leak claim at its early steps only
    row = prows.BY_ID["bayes-ats"]
    early_and_late = pevidence.cell_evidence(manifest, [dict(r, step=2 if r["step"] == 1 else r["step"]) for r in records],
                                      ["ig"], [2, 50])
    run = pcells.run_setting(row, pcells.Profile("cpu"))
    healthy = {"trained": True, "images": 6, "logit_std": 0.05, "finite": 6, "zero": 0}
    health = {"health": {"steps": {"2": healthy}}}  # steps 1, 5 and 10 not measured: not judged
    assert pjudge.conclude(row, {"paper:ig": early_and_late, "planner": None}, run, stored=health).outcome == pverdict.HOLDS
    # a claim step no cell has run leaves the claim open, whatever the other steps show
    health = {"health": {"steps": {str(s): healthy for s in (1, 2, 5, 10)}}}
    said = pjudge.conclude(row, {"paper:ig": early_and_late, "planner": None}, run, stored=health)
    assert said.outcome == pverdict.SO_FAR and "step 1: not complete (no cell has run this step yet)" in said.detail
    late = cell.at_steps([50])
    assert (late.images, late.identified, len(late.missing)) == (5, 0, 1)
    assert pverdict.conclude_leaks(late, True).outcome == pverdict.INCONCLUSIVE
    # a stored cell without per-step counts cannot be restricted silently
    old = cell.to_dict()
    del old["per_step_recovered"]
    with pytest.raises(ValueError, match="rerun the cell"):
        pevidence.CellEvidence.from_dict(old).at_steps([1])


def test_exact_mcnemar():
    assert pverdict.mcnemar_exact(0, 0) == 1.0
    assert pverdict.mcnemar_exact(6, 0) == pytest.approx(2 / 64)  # 2 * 0.5^6
    assert pverdict.mcnemar_exact(3, 3) == 1.0


def _arm(mean, std, seeds=3):
    """Stored runs whose accuracies have this mean and sample standard deviation (3 seeds)."""
    accs = [mean - std, mean, mean + std] if seeds == 3 else [mean]
    return {"mean": mean, "std": std if seeds > 1 else None,
            "runs": [{"seed": k, "accuracy": a} for k, a in enumerate(accs)]}


def test_a_utility_claim_holds_only_beyond_the_noise_of_the_seeds():
    def conclude(defended, undefended, claim="not-worse", ratio=None, **kw):
        return pverdict.conclude_utility({"defended": _arm(*defended), "undefended": _arm(*undefended)}, claim, ratio, **kw)

    # a 9-point gap with stds of 7.5 and 9.7 over 3 seeds: the interval spans -29.6 to +10.8 points
    noisy = conclude((0.258, 0.075), (0.352, 0.097))
    assert noisy.outcome == pverdict.INCONCLUSIVE and "-29.6 to +10.8" in noisy.detail and "noise" in noisy.detail
    assert conclude((0.40, 0.104), (0.406, 0.091)).outcome == pverdict.INCONCLUSIVE  # equal means, wide noise
    assert conclude((0.50, 0.01), (0.80, 0.01)).outcome == pverdict.FAILS  # 30 points below, std 1
    assert conclude((0.795, 0.005), (0.785, 0.005)).outcome == pverdict.HOLDS  # +1 point, interval -0.1 to +2.1
    # the tolerance is what a holds needs: with none, the same interval (reaching -0.1) is inconclusive
    assert conclude((0.795, 0.005), (0.785, 0.005), tolerance=0.0).outcome == pverdict.INCONCLUSIVE
    # a ratio claim: defended >= 0.9 x undefended (54%)
    assert conclude((0.55, 0.005), (0.60, 0.005), "ratio", 0.9).outcome == pverdict.HOLDS
    assert conclude((0.45, 0.005), (0.60, 0.005), "ratio", 0.9).outcome == pverdict.FAILS
    assert conclude((0.52, 0.02), (0.60, 0.02), "ratio", 0.9).outcome == pverdict.INCONCLUSIVE  # 2 points short, std 2
    one = conclude((0.5, 0.0, 1), (0.6, 0.0, 1))
    assert one.outcome == pverdict.INCONCLUSIVE and "one seed" in one.detail
    assert pverdict.conclude_utility({"unavailable": "off"}, "not-worse").outcome == pverdict.NOT_RUN



SHARED = ROOT.parent / "shared"
PAPER_FILES = {"CENSOR": "001_a946083aed09131d.txt", "SVDefense": "002_31aca050d439877c.txt",
               "Bayes framework": "003_bd2ad8760a0a52cc.txt", "Refiner": "004_3d6825e50b60a12a.txt"}
NOTES = {"CENSOR": "censor.md", "SVDefense": "svdefense.md", "Bayes framework": "bayes.md", "Refiner": "refiner.md"}
#: table captions the text extraction of the CENSOR paper lost (its tables survive, their captions
#: do not); the rows' anchors locate the numbers instead
LOST_CAPTIONS = {"CENSOR": {"Table I", "Table V"}}


def _source_text(paper):
    import re

    papers = SHARED / "papers"
    text = (papers / PAPER_FILES[paper]).read_text() + "\n" + (SHARED / "notes" / NOTES[paper]).read_text()
    return re.sub(r"\s+", " ", text)


def _numbers(text):
    import re

    return [m.group(0) for m in re.finditer(r"(?<![\w.])\d*\.\d+|(?<![\w.])\d+(?:,\d{3})*", text)]


def _cited(row):
    return "SVDefense" if row.setting.source.startswith("SVDefense") else row.paper


@pytest.mark.skipif(not (SHARED / "papers").is_dir(), reason="checks each row's paper number against the seed papers' text, "
                    "which is not checked out beside this repository (../shared/papers)")
def test_every_rows_paper_number_and_source_are_in_the_paper_text_or_notes():
    """Each number of a row's paper figure is one of the paper's (or the notes') numbers at the
    row's precision; its anchor is verbatim text there; its table / figure label is there
    (or known lost in extraction); and an iteration count the row attributes to the paper is
    the paper's or the notes'."""
    import re

    for row in prows.ROWS:
        paper = _cited(row)
        text = _source_text(paper)
        found = [float(n.replace(",", "")) for n in _numbers(text)]
        for number in _numbers(row.paper_number):
            digits = len(number.split(".")[1]) if "." in number else 0
            value = float(number.replace(",", ""))
            assert any(abs(f - value) <= 0.5 * 10 ** -digits + 1e-9 for f in found), (row.id, number)
        assert " ".join(row.setting.anchor.split()) in text, (row.id, row.setting.anchor)
        for ref in re.findall(r"(?:Table|Fig\.) [0-9IVX]+[ab]?", row.setting.source + " " + row.figure):
            ref = ref.replace("SVDefense ", "")
            if ref in LOST_CAPTIONS.get(paper, ()):
                continue
            base = re.sub(r"[ab]$", "", ref)
            assert base in text or base.replace("Fig.", "Figure") in text, (row.id, ref)
        if row.setting.iterations is not None and row.setting.iterations > 1:
            its = row.setting.iterations
            assert re.search(rf"(?<![\d.,]){its}(?![\d])|(?<![\d.,]){its:,}(?![\d])", text), (row.id, its)


def test_the_transcription_errors_stay_fixed():
    assert all("Table II" not in r.figure and "Table II" not in r.setting.source for r in prows.ROWS if r.paper == "CENSOR")
    assert prows.BY_ID["censor-rounds"].setting.source.startswith("Table V")
    assert all(r.setting.iterations is None for r in prows.ROWS if r.paper == "SVDefense")
    ats = prows.BY_ID["bayes-ats"]
    assert (ats.model, ats.setting.iterations, ats.setting.train_batch) == ("convnet9", 2000, 32)
    assert ats.attacks[0].args["tv"] == 1e-5
    assert ats.attacks[0].args["signed"] is True  # the authors' comm.py: inversefed's signed, boxed Adam
    assert ats.claim_steps == (1, 2, 5, 10)  # App. A.2: high-quality inputs "during the first 10 to 20 steps"


def test_each_row_is_labelled_by_how_far_it_is_from_the_paper():
    cpu, gpu = pcells.Profile("cpu"), pcells.Profile("gpu")
    for row in pcli.selected(None, None, "cpu"):
        run = pcells.run_setting(row, cpu)
        lab = pcells.label(row, run)
        assert lab == pspec.AT_PAPER or lab.startswith("scaled: "), row.id
        if row.model == "resnet18":
            # every ResNet-18 row names its width; the CPU runs narrower ones (8; 32 where conv-span decides
            # the row in eval mode) and says so in its label, and train-mode conv-span rows at the paper's 64
            width = row.scales["cpu"].model_args["width"]
            assert row.setting.model_args == {"width": 64}, row.id
            assert (f"width={width}" in lab) == (width != 64), (row.id, lab)
    assert prows.BY_ID["censor-none"].scales["cpu"].model_args == {"width": 32}
    assert pcells.run_setting(prows.BY_ID["svd-soteria"], cpu)["model_args"] == {"width": 64}
    for row in (r for r in prows.ROWS if r.id.startswith("bayes-") and r.claim == "order"):
        run = pcells.run_setting(row, cpu)
        assert pcells.label(row, run) == pspec.AT_PAPER and run["budget"] == 200 and run["images"] == 100
    assert pcells.label(prows.BY_ID["bayes-soteria"], pcells.run_setting(prows.BY_ID["bayes-soteria"], cpu)) == pspec.AT_PAPER
    censor = prows.BY_ID["censor-none"]
    ats_row = prows.BY_ID["bayes-ats"]  # the claim's steps of Fig. 6 at 2,000 iterations, 8 of its 100 images
    ats = pcells.run_setting(ats_row, cpu)
    assert pcells.label(ats_row, ats) == "scaled: steps 1, 2, 5, 10 of 1, 2, 5, 10, 20, 50; 8 of 100 images"
    assert ats["steps"] == [1, 2, 5, 10] and pcells.run_setting(ats_row, gpu)["steps"] == [1, 2, 5, 10, 20, 50]
    # the authors' code attacks the model in eval mode and trains it between steps with
    # inversefed's SGD: every cell of the row runs its client and its training so
    ats_cells = pcells.plan_cells(ats_row, cpu, "embedded", {}, Path("/x"))
    assert {c.call.get("client_mode") for c in ats_cells} == {"eval"}
    assert {c.call.get("server_optimizer") for c in ats_cells} == {"sgd:momentum=0.9,nesterov=1,weight_decay=5e-4"}
    assert "momentum=0.9" in pcells.own_text(ats_row, ats, "embedded")
    # so does CENSOR's (its run_rec.py); the rows from SVDefense's experiments keep train mode
    for row_id in ("censor-none", "censor-soteria", "censor-censor", "censor-rounds"):
        cells = pcells.plan_cells(prows.BY_ID[row_id], cpu, "embedded", {}, Path("/x"))
        assert {c.call.get("client_mode") for c in cells} == {"eval"}, row_id
    for row_id in ("censor-later", "svd-prune"):
        assert all("client_mode" not in c.call for c in pcells.plan_cells(prows.BY_ID[row_id], cpu, "embedded", {}, Path("/x")))
    assert pcells.label(censor, pcells.run_setting(censor, gpu)) == pspec.AT_PAPER  # width 64, 15,000 x 4
    assert "100 of 15,000 iterations x 4 restarts" in pcells.label(censor, pcells.run_setting(censor, cpu))
    svd = prows.BY_ID["svd-prune"]
    assert "the paper states no iteration count" in pcells.label(svd, pcells.run_setting(svd, gpu))


def test_the_pages_title_counts_the_rows_at_and_below_the_papers_setting():
    at, scaled = prender.counts(pcli.selected(None, None, "cpu"), pcells.Profile("cpu"))
    title = (ROOT / "docs" / "papers.md").read_text().splitlines()[0]
    assert f"{at} at the paper's setting" in title and f"{scaled} scaled" in title


def test_the_gpu_profile_runs_resnet18_at_width_64_in_slices_that_each_fit_a_call(tmp_path):
    gpu = pcells.Profile("gpu")
    rows = pcli.selected(None, None, "gpu")
    resnets = [r for r in rows if r.model == "resnet18"]
    assert len(resnets) == 10
    for row in resnets:
        assert pcells.run_setting(row, gpu)["model_args"] == {"width": 64}  # the paper's
        slices = pgpu.gpu_slices(row, gpu, "embedded", {}, tmp_path, tmp_path)
        assert slices and all(s.minutes <= pslices.GPU_SLICE_MINUTES + 1e-9 for s in slices), row.id


def test_the_gpu_profile_runs_ats_and_refiner_on_the_papers_images(tmp_path):
    """The rows the CPU runs on fewer images run at the paper's setting on a GPU, over many calls."""
    gpu, cpu = pcells.Profile("gpu"), pcells.Profile("cpu")
    others = {r.id: r for r in pcli.selected(None, None, "gpu") if r.model != "resnet18"}
    assert set(others) == {"bayes-ats", "refiner-alpha-0.0", "refiner-alpha-0.5", "refiner-alpha-0.9",
                           "refiner-order"}
    for row in others.values():
        run = pcells.run_setting(row, gpu)
        assert run["images"] == row.setting.images in (100, 1000) and pcells.label(row, run) == pspec.AT_PAPER, row.id
        assert pcells.label(row, pcells.run_setting(row, cpu)).endswith(f"{pcells.run_setting(row, cpu)['images']} of "
                                                               f"{row.setting.images:,} images"), row.id
    ats = pgpu.gpu_slices(others["bayes-ats"], gpu, "embedded", {}, tmp_path, tmp_path)
    # 100 images at each of six steps, each beside its positive control (the same attacks again,
    # undefended): 11 a slice of IG, 18 of the planner's
    assert len(ats) == 6 * 10 + 6 * 6
    assert pslices.calls_needed(ats) == len(ats)  # no two of its slices fit one call


def test_the_planner_cell_runs_its_attacks_at_their_presets_in_an_audit_of_its_own():
    for row in prows.ROWS:
        if row.claim in ("utility", "chain"):
            continue
        plans = {p.name: p for p in pcells.plan_cells(row, pcells.Profile("cpu"), "embedded", {}, Path("/x"))}
        planner = plans["planner"]
        assert planner.call["out"] != plans[f"paper:{row.attacks[0].name}"].call["out"], row.id
        for a in row.attacks:
            assert (planner.call["attack_args"] or {}).get(a.name) in (None, {}) or a.name == "learned-inverter", row.id
        paper = plans[f"paper:{row.attacks[0].name}"]
        assert paper.call["attacks"] == [row.attacks[0].name]


def test_the_papers_ig_runs_without_igs_own_features_term_and_the_planners_ig_keeps_it():
    """The paper's cell runs Inverting Gradients as the papers do: the features term ``ig`` adds
    by default is off in every paper attack built on ``ig``; the planner's ``ig`` keeps its preset."""
    import torch

    from attacks import ATTACKS, observe
    from audit.core.models import build_model

    model = build_model("convnet", (3, 16, 16), 10, seed=0, batchnorm=False)
    obs = observe(model, torch.rand(2, 3, 16, 16), torch.tensor([3, 6]), seed=0)
    seen = set()
    for row in prows.ROWS:
        for ref in (*row.attacks, *((row.adaptive,) if row.adaptive else ())):
            if ref.args.get("objective") != "cosine" or (ref.name, ref.label) in seen:
                continue  # an IG of a paper's: the cosine objective is what it names
            seen.add((ref.name, ref.label))
            if ref.name in ("ig", "through-defense"):
                args = {k: v for k, v in ref.args.items() if k not in ("restarts", "samples")}
                rec = ATTACKS.build("ig", **args).reconstruct(obs, 2, 0)
                assert "features" not in rec.trace["prior_weights"], (row.id, ref.label)
            assert ref.args["features"] == 0.0, (row.id, ref.label)
    assert {"ig", "layer-drop", "mask-replay", "through-defense"} <= {name for name, _ in seen}
    assert ATTACKS.build("ig").reconstruct(obs, 2, 0).trace["prior_weights"]["features"] > 0


def _null_manifest(images, identified_items):
    """A manifest whose null has 64 items per image, ``identified_items`` of them ranked first."""
    ranks = [1] * identified_items + [30] * (64 - identified_items)
    null = NullEvidence(["other"] * 64, [10.0] * 64, ranks, K, 127, "lpips")
    return {"images": images, "thresholds": {}, "null": {"images": [[null.to_dict()] for _ in range(images)]}}


def test_the_chance_of_a_best_of_m_cell_is_the_nulls_best_of_m():
    assert pevidence.best_of_chance([1] + [9] * 63, 1) == pytest.approx(1 / 64)
    assert pevidence.best_of_chance([1] + [9] * 63, 6) == pytest.approx(6 / 64)
    assert pevidence.best_of_chance([1, 1] + [9] * 62, 6) > pevidence.best_of_chance([1] + [9] * 63, 6)
    attacks = [f"a{k}" for k in range(6)]
    # 3 of 16 identified: above a one-attack chance of 1/64, not above the best of six attacks'
    records = [_record(0, a, i, 20.0, 1 if (i < 3 and a == "a0") else 9) for a in attacks for i in range(16)]
    six = pevidence.cell_evidence(_null_manifest(16, 1), records, attacks, [0])
    one = pevidence.cell_evidence(_null_manifest(16, 1), records, ["a0"], [0])
    assert (six.identified, six.members, one.members) == (3, 6, 1)
    assert one.chance == pytest.approx(1 / 64) and six.chance == pytest.approx(6 / 64)
    assert one.above_chance() and not six.above_chance()
    assert "best of 6" in pverdict.identification_text(six)


def _psnr_cell(values, identified=0):
    c = _cell(identified, images=len(values))
    c.per_image_psnr = {(0, i, 0): v for i, v in enumerate(values)}
    return c


def test_the_order_is_tested_on_per_image_psnr_with_its_power():
    import random

    rng = random.Random(0)
    base = [15 + rng.gauss(0, 2) for _ in range(100)]
    bayes = _psnr_cell([b + 3 + rng.gauss(0, 1) for b in base])
    l2 = _psnr_cell(base)
    held = pverdict.conclude_order(bayes, {"l2": l2}, {"l2": 3.0})
    assert held.outcome == pverdict.HOLDS  # nothing identified, yet 3 dB on every image is decided
    assert "Wilcoxon p=" in held.detail and "power 100%" in held.detail and "McNemar" in held.detail
    assert pverdict.conclude_order(l2, {"l2": bayes}, {"l2": 3.0}).outcome == pverdict.FAILS
    # the paper has the two within 1 dB: 3 dB apart does not hold, 0.1 dB apart holds
    assert pverdict.conclude_order(bayes, {"l2": l2}, {"l2": 0.2}).outcome == pverdict.FAILS
    near = _psnr_cell([b + 0.1 + rng.gauss(0, 0.1) for b in base])
    assert pverdict.conclude_order(near, {"l2": l2}, {"l2": 0.2}).outcome == pverdict.HOLDS
    # four images cannot show a 0.5 dB gap: inconclusive, and the power says so
    few = pverdict.conclude_order(_psnr_cell([10, 11, 12, 13]), {"l2": _psnr_cell([10.4, 10.2, 12.9, 12.1])}, {"l2": 0.5})
    assert few.outcome == pverdict.INCONCLUSIVE and "power" in few.detail


def test_at_this_budget_is_said_only_below_the_papers_budget():
    a, b = _psnr_cell([10, 11, 12, 13]), _psnr_cell([10.4, 10.2, 12.9, 12.1])
    assert "at this budget" not in pverdict.conclude_order(a, {"l2": b}, {"l2": 0.5}).text()
    assert "at this budget" in pverdict.conclude_order(a, {"l2": b}, {"l2": 0.5}, below_budget=True).text()
    assert "at this budget" in pverdict.conclude_protects([_cell(0, control=8)], False).text()
    assert "at this budget" not in pverdict.conclude_protects([_cell(0, missing=["x"])], True).text()
    # a paper that states no iteration count is never said to have a budget ours is below
    svd = prows.BY_ID["svd-svdefense"]
    note = pjudge.budget_note(svd, pcells.run_setting(svd, pcells.Profile("cpu")))
    assert "states no iteration count" in note and "below the paper's budget" not in note
    said = pverdict.conclude_protects([_cell(0, control=8)], False, note).text()
    assert "states no iteration count" in said and "below the paper's budget" not in said


def test_a_lower_end_below_chance_never_prints_above_it():
    c = _cell(2, images=16)  # 95% CI 1.55%-38.3%, chance 1/64 = 1.56%
    text = pverdict.identification_text(c)
    assert "CI 1.5%-38.4%" in text and "not above chance" in text


def test_cells_persist_resume_and_a_changed_row_reruns_only_its_own(tmp_path, monkeypatch):
    import dataclasses

    runs = []

    def fake_run_cell(row, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None, on_step=None, stepped=(), until_step=None):
        runs.append((row.id, plan.name))
        return _finished_cell(plan, plan.call["attacks"], _cell(2))

    monkeypatch.setattr(prun, "run_cell", fake_run_cell)
    _one_engine_key(monkeypatch)
    rows = [prows.BY_ID["censor-none"], prows.BY_ID["svd-prune"]]
    profile = pcells.Profile("cpu")
    for row in rows:
        prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    first = list(runs)
    assert ("censor-none", "paper:ig") in first and ("svd-prune", "adaptive") in first
    assert pstore.load_results(pstore.results_path(tmp_path / "results", "cpu", "embedded", rows[0]))
    for row in rows:  # a rerun resumes: every cell is stored under its key
        prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    assert runs == first
    changed = dataclasses.replace(rows[0], scales={"cpu": dataclasses.replace(rows[0].scale("cpu"), budget=300)})
    monkeypatch.setitem(prows.BY_ID, "censor-none", changed)
    prun.run_row(changed, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    assert {r for r, _ in runs[len(first):]} == {"censor-none"}
    page = prender.render([changed, rows[1]], profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    assert "2 of 16 identified" in page and "not yet run" not in page


def test_the_page_marks_cells_not_yet_run(tmp_path):
    page = prender.render([prows.BY_ID["censor-none"]], pcells.Profile("cpu"), "embedded", {}, tmp_path, tmp_path)
    assert "not yet run" in page and "Table I, CIFAR-10, IG, no defense" in page


def test_refiners_alpha_changes_the_upload_only_where_the_projection_does_not_bind():
    """Refiner uploads ``g + eps (g* - g) / ||g* - g||`` when the robust gradient lies farther
    than eps from the clean one: on LeNet (||g|| about 30) eps = 0.1 binds for every alpha."""
    import torch

    from audit.core.data import load_dataset
    from audit.core.models import build_model
    from audit.core.types import clean_gradients, default_loss_fn
    from defenses import build_defense

    data = load_dataset("embedded")
    model = build_model("lenet", data.input_shape, data.num_classes, mean=data.mean, std=data.std)
    x, y = data.test_images[:1], data.test_labels[:1]
    clean = clean_gradients(model, x, y, default_loss_fn)

    torch.manual_seed(0)
    evaluator = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 1), torch.nn.Sigmoid())

    def upload(alpha, eps):
        d = build_defense("refiner", eps=eps, alpha=alpha, iota=2, evaluator=evaluator)
        return d(model, x, y, generator=torch.Generator().manual_seed(0))

    def dist(a, b):
        return float(torch.sqrt(sum(((u - v) ** 2).sum() for u, v in zip(a, b))))

    loose = [upload(a, 1e6) for a in (0.5, 0.9)]
    assert dist(*loose) > 1.0  # unprojected, alpha moves the robust data's gradient
    tight = [upload(a, 0.1) for a in (0.5, 0.9)]
    for t in tight:  # the robust gradient lies farther than 0.1: each upload is cut back to the ball
        assert dist(t, clean) == pytest.approx(0.1, rel=1e-3)
    assert dist(*tight) <= 0.2 + 1e-6 < 0.05 * dist(*loose)


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

    for row in prows.ROWS:
        build_defense(row.defense, **row.defense_args)
        for profile in row.profiles:
            MODELS.build(row.model, (3, 32, 32), 10, **pcells.run_setting(row, pcells.Profile(profile))["model_args"])
            for plan in pcells.plan_cells(row, pcells.Profile(profile), "embedded", {}, Path("/tmp/x")):
                for name, kw in (plan.call.get("attack_args") or {}).items():
                    ATTACKS.build(name, **kw)
                for name in plan.call["attacks"]:
                    assert name == "auto" or name in ATTACKS, (row.id, name)



def test_rows_sharing_an_engine_store_run_each_attack_with_the_same_settings():
    """The engine reuses a stored result only under the same attack settings: two cells of
    one store asking one attack differently would redo each other's results forever."""
    seen = {}
    for row in prows.ROWS:
        for plan in pcells.plan_cells(row, pcells.Profile("cpu"), "embedded", {}, Path("/tmp/x")):
            call = plan.call
            key = (call["out"], json.dumps(call["defense_args"], sort_keys=True), call["budget"],
                   json.dumps(call["model_args"], sort_keys=True))
            for name, kw in (call.get("attack_args") or {}).items():
                previous = seen.setdefault((key, name), (row.id, kw))
                assert previous[1] == kw, f"{row.id} and {previous[0]} run {name} differently in one store"


def test_the_gpu_profile_runs_on_a_cpu_at_a_tiny_budget(tmp_path):
    """``--profile gpu --tiny``: a gpu-profile row's paper cell runs end to end on the CPU with
    the width-64 ResNet-18 at the quick check's budget, and is stored with its evidence."""
    row = prows.BY_ID["censor-none"]
    profile = pcells.Profile("gpu", images=1, tiny=True)
    paper = pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out")[0]
    assert paper.name == "paper:ig" and paper.call["model_args"] == {"width": 64}
    assert paper.call["budget"] == pspec.QUICK["budget"]
    assert paper.call["device"] == "cpu"
    cell = prun.run_cell(row, paper)
    evidence = cell["evidence"]
    assert evidence["images"] == 1 and len(evidence["per_image_psnr"]) == 1
    assert cell["call"]["model"] == "resnet18" and cell["key"] == paper.key
    assert "scaled" in pcells.label(row, pcells.run_setting(row, profile))


def test_a_search_whose_best_is_at_the_grids_edge_extends_it():
    """A best value at the grid's edge is measured a decade further that way until it is
    bracketed or the extensions run out; the row then says the choice is at the edge."""
    def run(peak):
        rows = []
        psearch.searched_grid((0.1, 1.0, 10.0), lambda v: rows.append([v, 0.1, -abs(math.log10(v) - peak)]), rows,
                         extend=2)
        return sorted({r[0] for r in rows}), max(rows, key=lambda r: r[2])[0], rows

    tried, best, _ = run(0.0)
    assert tried == [0.1, 1.0, 10.0] and best == 1.0  # bracketed: no extension
    tried, best, _ = run(2.0)
    assert tried == [0.1, 1.0, 10.0, 100.0, 1000.0] and best == 100.0  # bracketed once 1000 is tried
    tried, best, rows = run(5.0)
    assert tried[-1] == 1000.0 and best == 1000.0  # two extensions, still at the edge
    search = {"table": {"bayes-optimal": rows}, "chosen": {"bayes-optimal": {"prior_weight": best, "lr": 0.1}}}
    assert "edge" in psearch.search_edge(search, "bayes-optimal")
    tried, best, _ = run(-2.0)
    assert best == pytest.approx(0.01) and tried[0] == pytest.approx(0.001) and len(tried) == 5


def test_cells_run_with_a_stale_search_are_not_shown_as_current(tmp_path):
    """A Bayes row's paper cells run with weights from a search whose key is no longer the
    current one (other search settings or code) read "not yet run" until the row reruns."""
    row, profile = prows.BY_ID["bayes-gauss-0"], pcells.Profile("cpu")
    chosen = {name: {knob: values[1], "lr": 0.1} for name, (knob, values) in psearch.SEARCH.items()}
    plans = pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out", chosen)
    cells = {p.name: {"key": p.key, "evidence": _cell(2).to_dict()} for p in plans}
    path = pstore.results_path(tmp_path / "results", "cpu", "embedded", row)
    current = pcells.current_search_key(row, profile, "embedded", {}, tmp_path / "out")
    for key, shown in ((current, True), ("an older search", False)):
        pstore.save_results(path, {"row": row.id, "search": {"key": key, "chosen": chosen, "table": {}, "held_out": 8},
                               "cells": cells})
        _, evidence, _ = pcells.stored_cells(row, profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
        paper = [v for k, v in evidence.items() if k.startswith("paper:")]
        assert paper and all((v is not None) == shown for v in paper)


def test_a_row_with_cells_missing_counts_as_unfinished_whatever_its_cells_say(tmp_path, monkeypatch):
    def fake_run_cell(row, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None, on_step=None, stepped=(), until_step=None):
        return _finished_cell(plan, plan.call["attacks"], _cell(2))

    monkeypatch.setattr(prun, "run_cell", fake_run_cell)
    _one_engine_key(monkeypatch)
    row, profile = prows.BY_ID["censor-none"], pcells.Profile("cpu")
    prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    whole = prender.render([row], profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    assert "1 unfinished" not in whole
    path = pstore.results_path(tmp_path / "results", "cpu", "embedded", row)
    stored = pstore.load_results(path)
    stored["cells"].pop("planner")
    pstore.save_results(path, stored)
    page = prender.render([row], profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    summary = page.splitlines()[0]
    assert summary.endswith("1 unfinished") and "hold" not in summary
    assert "**unfinished (planner not yet run): " in page


def test_a_long_cell_runs_in_slices_of_steps_and_images():
    call = {"images": 16, "steps": [1, 50], "budget": 2000, "utility": False}
    slices = pslices.cell_slices(call)
    per = pslices.SLICE_EVALUATIONS // 2000
    assert slices[:2] == [([1], per), ([1], 2 * per)] and slices[-1] == ([1, 50], 16)
    assert ([50], 16 - per) in slices and ([1], 16) in slices and ([50], 16) in slices  # no slice spans steps
    assert all(len(steps) == 1 for steps, _ in slices[:-1])
    single = pslices.cell_slices({**call, "steps": [1]})
    assert single[-1] == ([1], 16) and all(n < 16 for _, n in single[:-1])  # the whole call is the last slice
    assert pslices.cell_slices({**call, "budget": 200}) == [([1], 16), ([50], 16), ([1, 50], 16)]  # a step a slice
    assert pslices.cell_slices({**call, "budget": 200, "steps": [1]}) == [([1], 16)]  # 20 images a slice: one call
    planner = pslices.cell_slices({**call, "budget": 200, "attacks": ["auto"]})  # sized as PLANNER_ATTACKS attacks
    assert planner[0] == ([1], pslices.SLICE_EVALUATIONS // (200 * pslices.PLANNER_ATTACKS)) and planner[-1] == ([1, 50], 16)
    four = pslices.cell_slices({**call, "budget": 200, "attacks": ["ig", "portfolio", "mask-replay", "layer-drop"]})
    assert four[0] == ([1], pslices.SLICE_EVALUATIONS // 800) and four[-1] == ([1, 50], 16)  # each attack spends 200
    assert pslices.cell_slices({**call, "utility": True}) == [([1, 50], 16)]


def test_an_interrupted_cell_resumes_from_the_repositorys_partial_results(tmp_path, monkeypatch):
    """Each slice's results are kept in the repository; a fresh engine store (a new clone)
    restores them and attacks nothing already finished."""
    from audit.engine.audit import Audit

    row, profile = prows.BY_ID["bayes-gauss-0"], pcells.Profile("quick", images=2)
    paper = pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out")[0]
    monkeypatch.setattr(pslices, "SLICE_EVALUATIONS", paper.call["budget"])  # one image a slice
    partial = pstore.partial_dir(tmp_path / "results" / "cpu-embedded" / "row", paper.name)
    attacked = []
    real = schedule.attack_claimed
    monkeypatch.setattr(schedule, "attack_claimed", lambda run, store, spec, obs, step, images, bar:
                        (attacked.append(list(images)), real(run, store, spec, obs, step, images, bar)))
    first = prun.run_cell(row, paper, partial)
    assert attacked == [[0], [0], [1], [1]]  # slice by slice (the control, then the cell), then the whole call
    kept = sorted(p.name for p in partial.glob("*/*.json"))
    assert len(kept) == 2 and all(p.startswith("s0__") for p in kept)
    assert len(list((partial / pstore.CONTROL_PARTIAL).glob("*/*.json"))) == 2  # the positive control is kept too
    shutil.rmtree(tmp_path / "out")  # a fresh clone: the engine's store is gone, the repository's kept
    attacked.clear()
    record = sorted(partial.glob("*/*.json"))[0]
    kept_record = json.loads(record.read_text())
    record.write_text(json.dumps({**kept_record, "time_s": 1000.0}))  # an image the earlier run spent long on
    again = prun.run_cell(row, paper, partial)
    assert attacked == [] and again["evidence"]["per_image_psnr"] == first["evidence"]["per_image_psnr"]
    assert again["seconds"] >= 1000.0  # the finished cell counts the earlier runs' time, not only its own


def test_a_result_the_run_redid_replaces_the_one_kept_in_the_repository(tmp_path):
    """A kept result run with other settings (the engine redoes it under the same name) must not
    outlive its redo, else a fresh clone restores the stale one and runs the image again."""
    results, partial = tmp_path / "out" / "runs" / "k" / "results", tmp_path / "partial"
    results.mkdir(parents=True)
    (partial / "k").mkdir(parents=True)
    (partial / "k" / "s1__ig__i0.json").write_text('{"settings": ["tv"]}')
    (results / "s1__ig__i0.json").write_text('{"settings": ["tv", "features"]}')
    (results / "s1__ig__i1.json").write_text('{"settings": ["tv", "features"]}')
    pstore.keep_partial(tmp_path / "out", "k", partial)
    assert (partial / "k" / "s1__ig__i0.json").read_text() == '{"settings": ["tv", "features"]}'
    assert (partial / "k" / "s1__ig__i1.json").exists()


def test_a_cell_run_with_an_attack_default_since_changed_is_rerun_and_marked_stale(tmp_path, monkeypatch):
    from attacks import ATTACKS
    from bench.papers.stale import planned_now

    runs = []

    def fake_run_cell(row, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None, on_step=None, stepped=(), until_step=None):
        runs.append(plan.name)
        ran = planned_now(plan.call) if plan.name == "planner" else ["ig"]  # what the planner plans today
        return _finished_cell(plan, ran, _cell(2), fingerprints=pstale.cell_fingerprints(plan.call, ran))

    monkeypatch.setattr(prun, "run_cell", fake_run_cell)
    _one_engine_key(monkeypatch)
    row, profile = prows.BY_ID["censor-none"], pcells.Profile("cpu")
    prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    first = list(runs)
    assert "planner" in first and "paper:ig" in first
    # the planner runs ig at its preset, the paper's cell with its schedule set: only the planner is stale
    monkeypatch.setitem(ATTACKS.get("ig").defaults, "schedule", "exp")
    page = prender.render([row], profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    assert "**stale (the defaults of ig, portfolio changed since these cells ran" in page  # the portfolio runs ig
    assert page.splitlines()[0].endswith("1 stale")
    prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    assert runs[len(first):] == ["planner"]
    page = prender.render([row], profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    assert "stale" not in page


def test_a_leak_the_current_cells_decide_alone_does_not_rest_on_a_stale_planner_cell(tmp_path, monkeypatch):
    from attacks import ATTACKS
    from bench.papers.stale import planned_now

    def cell_run(paper_identifies):
        def fake_run_cell(row, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None,
                          on_step=None, stepped=(), until_step=None):
            ran = planned_now(plan.call) if plan.name == "planner" else ["ig"]
            found = _cell(paper_identifies if plan.name == "paper:ig" else 0, control=12)
            return _finished_cell(plan, ran, found, fingerprints=pstale.cell_fingerprints(plan.call, ran))
        return fake_run_cell

    row, profile = prows.BY_ID["censor-none"], pcells.Profile("cpu")
    for identified, folder in ((12, "leak"), (0, "none")):
        monkeypatch.setattr(prun, "run_cell", cell_run(identified))
        _one_engine_key(monkeypatch)
        prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / folder)
    # the planner runs ig at its preset, the paper's cell with its schedule set: only the planner goes stale
    monkeypatch.setitem(ATTACKS.get("ig").defaults, "schedule", "exp")
    page = prender.render([row], profile, "embedded", {}, tmp_path / "leak", tmp_path / "out")
    assert "**the claim holds (12 of 16 recovered" in page and "**stale" not in page
    assert "Stale: the defaults of ig, portfolio changed since these cells ran" in page  # beside the planner's cell
    assert page.splitlines()[0].endswith("1 holds")
    # where the paper's cell shows no leak, the verdict rests on the stale cell: the row reads stale
    page = prender.render([row], profile, "embedded", {}, tmp_path / "none", tmp_path / "out")
    assert page.splitlines()[0].endswith("1 stale") and "**stale (the defaults of ig, portfolio changed" in page


def test_an_attacks_fingerprint_follows_the_defaults_it_relies_on(monkeypatch):
    import adaptive  # noqa: F401  (registers mask-replay)
    from attacks import ATTACKS
    from attacks.presets import defaults_fingerprint, settings_fingerprint

    before = {"ig": settings_fingerprint("ig"), "ig step": settings_fingerprint("ig", {"schedule": "step"}),
              "replay": settings_fingerprint("mask-replay"), "replay default": defaults_fingerprint("mask-replay"),
              "dlg": settings_fingerprint("dlg")}
    monkeypatch.setitem(ATTACKS.get("ig").defaults, "schedule", "exp")
    after = {"ig": settings_fingerprint("ig"), "ig step": settings_fingerprint("ig", {"schedule": "step"}),
             "replay": settings_fingerprint("mask-replay"), "replay default": defaults_fingerprint("mask-replay"),
             "dlg": settings_fingerprint("dlg")}
    changed = {k for k in before if before[k] != after[k]}
    # ig's own and the attack built on it change; an explicit schedule and another preset do not
    assert changed == {"ig", "replay", "replay default"}


def test_an_adaptive_cell_run_at_its_own_budget_says_so():
    cpu = pcells.Profile("cpu")
    eot = prows.BY_ID["censor-censor"]  # 4 draws per iteration: 2x the row's budget on the cpu
    run = pcells.run_setting(eot, cpu)
    cells = {c.name: c for c in pcells.plan_cells(eot, cpu, "embedded", {}, Path("/x"))}
    assert cells["adaptive"].call["budget"] == 2 * run["budget"] == 2 * cells["paper:ig"].call["budget"]
    assert prender.adaptive_head(eot, run).endswith(f"at budget {2 * run['budget']:,}")
    refiner = prows.BY_ID["refiner-alpha-0.5"]  # EOT at 200 of the row's 4,000
    assert prender.adaptive_head(refiner, pcells.run_setting(refiner, cpu)).endswith("at budget 200")
    replay = prows.BY_ID["svd-prune"]  # same budget as the row: no budget named
    assert prender.adaptive_head(replay, pcells.run_setting(replay, cpu)) == replay.adaptive.label


def test_a_cell_under_way_shows_what_the_repository_keeps_and_judges_nothing_from_it(tmp_path, monkeypatch):
    row, profile = prows.BY_ID["bayes-ats"], pcells.Profile("cpu")
    results = tmp_path / "results"
    plan = next(p for p in pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out") if p.name == "paper:ig")
    kept = pstore.partial_dir(pstore.results_path(results, "cpu", "embedded", row), plan.name) / "somekey"
    kept.mkdir(parents=True)
    from attacks.presets import defaults_fingerprint

    current = json.dumps({"settings": plan.call["attack_args"]["ig"], "defaults": defaults_fingerprint("ig")})
    for step, image in [(1, 0), (1, 1), (2, 0)]:
        (kept / f"s{step}__ig__i{image}.json").write_text(current)
    stale = dict(plan.call["attack_args"]["ig"], signed=not plan.call["attack_args"]["ig"]["signed"])
    (kept / "s5__ig__i0.json").write_text(json.dumps({"settings": stale}))  # run with other settings
    (kept / "s10__ig__i0.json").write_text(current.replace(defaults_fingerprint("ig"), "older"))  # other defaults
    (kept / "s20__ig__i0.json").write_text(current[:-1] + ', "status": "error"}')  # an error the engine retries
    (kept / "s3__ig__i0.json").write_text(current)  # a step the cell does not run
    (kept / "s1__ig__i99.json").write_text(current)  # an image beyond the cell's
    total = len(plan.call["steps"]) * plan.call["images"]
    monkeypatch.setattr(pstale, "run_key", lambda call: "oldkey")  # the engine's inputs changed since: none reused
    assert prender.kept_progress(pstore.results_path(results, "cpu", "embedded", row), plan) == ""
    monkeypatch.setattr(pstale, "run_key", lambda call: "otherkey" if "auto" in call["attacks"] else "somekey")
    assert prender.kept_progress(pstore.results_path(results, "cpu", "embedded", row), plan).startswith(
        f"under way: 3 of {total} image-steps kept in ")
    planner = next(p for p in pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out") if p.name == "planner")
    picks = pstore.partial_dir(pstore.results_path(results, "cpu", "embedded", row), planner.name) / "otherkey"
    picks.mkdir(parents=True)
    for attack, image in [("ig", 0), ("bayes-optimal", 0), ("ig", 1)]:  # image 1 lacks the planner's second pick
        (picks / f"s1__{attack}__i{image}.json").write_text(json.dumps({"defaults": defaults_fingerprint(attack)}))
    assert prender.kept_progress(pstore.results_path(results, "cpu", "embedded", row), planner).startswith(
        f"under way: 1 of {total} image-steps kept in ")
    page = prender.render([row], profile, "embedded", {}, results, tmp_path / "out")
    assert f"under way: 3 of {total} image-steps" in page
    assert "**unfinished (paper:ig under way, planner under way)**" in page
    assert page.splitlines()[0].endswith("1 unfinished")


def test_the_steps_of_a_claim_run_first_and_are_gathered_on_their_own():
    call = {"images": 8, "steps": [1, 2, 5, 10, 20, 50], "budget": 2000, "attacks": ["ig"], "utility": False}
    slices = pslices.cell_slices(call, [1, 2, 5, 10])
    gather = slices.index(([1, 2, 5, 10], 8))
    assert {s for steps, _ in slices[:gather] for s in steps} == {1, 2, 5, 10}  # every claim step before it
    assert ([10], 8) in slices[:gather] and ([20], 2) == slices[gather + 1] and slices[-1] == (call["steps"], 8)
    assert pslices.cell_slices(call, [1, 2, 5, 10, 20, 50]) == pslices.cell_slices(call)  # the claim is every step
    row = prows.BY_ID["bayes-ats"]  # the gpu profile runs steps 20 and 50 beside the claim's
    plans = {p.name: p for p in pcells.plan_cells(row, pcells.Profile("gpu"), "embedded", {}, Path("/x"))}
    assert pslices.claim_of(row, plans["paper:ig"]) == pslices.claim_of(row, plans["planner"]) == [1, 2, 5, 10]
    cpu = {p.name: p for p in pcells.plan_cells(row, pcells.Profile("cpu"), "embedded", {}, Path("/x"))}
    assert pslices.claim_of(row, cpu["paper:ig"]) == []  # the cpu profile runs the claim's steps alone
    assert pslices.claim_of(prows.BY_ID["censor-none"], plans["paper:ig"]) == []


def _claim_evidence(identified, steps=(1, 2, 5, 10), images=8):
    c = pevidence.CellEvidence(["ig"], list(steps), images=images * len(steps), candidates=K, psnr=20.0, strongest="ig")
    c.per_image_identified = {(s, i, 0): i < identified for s in steps for i in range(images)}
    c.per_image_psnr = {k: 20.0 for k in c.per_image_identified}
    c.per_step_recovered = {s: identified for s in steps}
    c.per_step_psnr = {s: 20.0 for s in steps}
    c.identified = c.recovered = identified * len(steps)
    c.per_image_recovered = dict(c.per_image_identified)
    c.control = {k: k[1] < 6 for k in c.per_image_identified}  # the control recovers 6 of 8 a step
    return c


def _healthy_model(call):
    """A stand-in for the model's measured health: every step trained, finite and alive."""
    return {str(s): {"trained": True, "images": 8, "logit_std": 0.05, "finite": 8, "zero": 0} for s in call["steps"]}


def _finished_cell(plan, attacks, evidence, **extra):
    """A cell as ``run_cell`` returns it once finished, under the fakes' one engine run key "k"."""
    return {"key": plan.key, "call": json.loads(json.dumps(plan.call)), "seconds": 1.0, "status": "complete",
            "run_key": "k", "attacks": attacks, "evidence": evidence.to_dict(), **extra}


def _one_engine_key(monkeypatch):
    """Every call's engine run key is "k", the key the fake cells record."""
    monkeypatch.setattr(pstale, "run_key", lambda call: "k")
    monkeypatch.setattr("bench.papers.stale._KEYS", {})


def _fake_cells(monkeypatch, run_cell):
    """Cells run by ``run_cell`` on a healthy model, one engine run key "k", the planner planning ig."""
    monkeypatch.setattr(prun, "run_cell", run_cell)
    monkeypatch.setattr(phealth, "model_health", _healthy_model)
    _one_engine_key(monkeypatch)
    monkeypatch.setattr("bench.papers.stale.planned_now", lambda call: ["ig"])


def test_a_claim_whose_steps_are_complete_is_judged_while_the_other_steps_run(tmp_path, monkeypatch):
    """A cell stores its claim's evidence as soon as those steps finish; a leak shown there is
    the verdict (nothing still to come undoes a leak), a cell at chance waits for the others."""
    row, profile = prows.BY_ID["bayes-ats"], pcells.Profile("gpu")
    identified = {"n": 3}

    def interrupted(row_, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None, on_step=None, stepped=(), until_step=None):
        on_claim(pcells.claim_record(plan, ["ig"], _claim_evidence(identified["n"])))
        raise KeyboardInterrupt  # the sitting ends while steps 20 and 50 run

    monkeypatch.setattr(prun, "run_cell", interrupted)
    monkeypatch.setattr(phealth, "model_health", _healthy_model)
    monkeypatch.setattr("bench.papers.stale.planned_now", lambda call: ["ig"])  # the plan these cells record
    with pytest.raises(KeyboardInterrupt):
        prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    stored = pstore.load_results(pstore.results_path(tmp_path / "results", "gpu", "embedded", row))
    assert set(stored["cells"]) == {"paper:ig"} and "claim_evidence" in stored["cells"]["paper:ig"]
    page = prender.render([row], profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    assert "**judged at steps 1, 2, 5, 10: the claim holds (" in page
    assert "(decided; paper:ig not yet run, planner not yet run)**" in page
    assert page.splitlines()[0].endswith("1 holds")
    assert "identified per step 1: 3/8, 2: 3/8, 5: 3/8, 10: 3/8" in page
    # the same cell at chance decides nothing while the planner has not run
    identified["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "at-chance")
    page = prender.render([row], profile, "embedded", {}, tmp_path / "at-chance", tmp_path / "out")
    assert page.splitlines()[0].endswith("1 unfinished") and "**unfinished (paper:ig not yet run, planner" in page
    with pytest.raises(KeyboardInterrupt):  # the planner's claim steps next, at chance too: judged
        prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "at-chance")
    page = prender.render([row], profile, "embedded", {}, tmp_path / "at-chance", tmp_path / "out")
    assert page.splitlines()[0].endswith("1 does not hold")
    assert "(decided at the claim's steps; the other steps of paper:ig and planner under way)**" in page
    # a claim record is not a finished cell: the next run runs the cell again
    ran = []

    def finished(row_, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None, on_step=None, stepped=(), until_step=None):
        ran.append((plan.name, claim_only, until_step))
        if claim_only or until_step is not None:
            return None
        return _finished_cell(plan, ["ig"], _claim_evidence(0, steps=(1, 2, 5, 10, 20, 50)))

    monkeypatch.setattr(prun, "run_cell", finished)
    _one_engine_key(monkeypatch)
    monkeypatch.setattr(phealth, "model_health", _healthy_model)
    prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    # every claim step is decided by the paper's cell's leak: no step pass runs
    assert ran == [("planner", True, None), ("paper:ig", False, None), ("planner", False, None)]  # every claim first
    page = prender.render([row], profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    assert page.splitlines()[0].endswith("1 does not hold") and "decided" not in page


def test_a_cell_hands_over_its_claims_evidence_when_those_steps_are_complete(monkeypatch):
    import audit

    row = prows.BY_ID["bayes-ats"]
    plan = next(p for p in pcells.plan_cells(row, pcells.Profile("gpu"), "embedded", {}, Path("/x")) if p.name == "paper:ig")
    calls, handed = [], []

    class Report:
        data = {"run_key": "k", "status": "complete"}

    monkeypatch.setattr(audit, "run", lambda **call: (calls.append((call["steps"], call["images"])), Report())[1])
    monkeypatch.setattr(prun, "_stored_evidence", lambda plan_, key, steps: ({}, ["ig"], _claim_evidence(2, tuple(steps))))
    assert prun.run_cell(row, plan, None, handed.append, claim_only=True) is None
    images = plan.call["images"]  # the paper's 100
    assert calls[-1] == ([1, 2, 5, 10], images) and all(s[0] in (1, 2, 5, 10) for s, _ in calls)
    assert len(handed) == 1 and handed[0]["key"] == plan.key
    assert pevidence.CellEvidence.from_dict(handed[0]["claim_evidence"]).steps == [1, 2, 5, 10]
    calls.clear()
    whole = prun.run_cell(row, plan, None, handed.append)
    assert calls[-1] == ([1, 2, 5, 10, 20, 50], images) and ([50], images) in calls and len(handed) == 2
    assert whole["key"] == plan.key and "claim_evidence" not in whole and whole["evidence"]["steps"] == [1, 2, 5, 10, 20, 50]


def test_a_step_whose_model_collapsed_is_not_judged_and_never_evidence():
    row = prows.BY_ID["bayes-ats"]
    run = pcells.run_setting(row, pcells.Profile("cpu"))
    cell = _claim_evidence(4, steps=(1, 2))  # 4 of 8 identified at steps 1 and 2
    healthy = {"trained": True, "images": 8, "logit_std": 0.05, "finite": 8, "zero": 0}
    diverged = dict(healthy, logit_std=5.9e9)
    flat = dict(healthy, zero=4)
    # step 2's model diverged: step 1 alone decides, step 2 says why it is not judged
    stored = {"health": {"steps": {"1": healthy, "2": diverged}}}
    said = pjudge.conclude(row, {"paper:ig": cell, "planner": None}, run, stored=stored)
    assert said.outcome == pverdict.HOLDS and "step 2: not judged (the model diverged" in said.detail
    # every step collapsed: nothing is judged, whatever the cells identify
    stored = {"health": {"steps": {"1": flat, "2": diverged}}}
    said = pjudge.conclude(row, {"paper:ig": cell, "planner": None}, run, stored=stored)
    assert said.outcome == pverdict.INCONCLUSIVE and "exactly zero gradients on 4 of 8" in said.detail
    # the model's health not measured: not judged either
    assert pjudge.conclude(row, {"paper:ig": cell, "planner": None}, run).outcome == pverdict.INCONCLUSIVE
    assert phealth.collapsed(dict(healthy, finite=7)).startswith("non-finite") and not phealth.collapsed(healthy)


def test_a_claim_over_steps_says_why_its_chance_is_a_bound_once():
    bound = "chance 5.5% (best of 2, a hypergeometric bound, which errs high: running each attack on null uploads would cost the cell again)"
    judged = {s: pverdict.Conclusion(pverdict.HOLDS, f"8 of 8 identified, {bound}, above chance", decided=True) for s in (1, 2, 5)}
    said = pverdict.conclude_steps(judged, {}).text()
    assert said.count("a hypergeometric bound") == 1 and said.count("(best of 2)") == 2
    assert said.index("step 1: ") < said.index("hypergeometric") < said.index("step 2: ")


def test_evidence_kept_step_by_step_joins_into_the_cells_evidence():
    whole = _claim_evidence(3, steps=(1, 2))
    whole.per_image_identified[(2, 7, 0)] = True  # step 2 identifies one more
    whole.identified, whole.null_chance, whole.ssim = 7, 0.02, 0.5
    joined = pevidence.CellEvidence.joined([whole.at_steps([2]), whole.at_steps([1])])
    assert joined.steps == [1, 2] and (joined.images, joined.identified) == (16, 7)
    assert joined.per_image_identified == whole.per_image_identified and joined.control == whole.control
    assert joined.per_step_recovered == {1: 3, 2: 3} and joined.psnr == pytest.approx(20.0)
    assert joined.null_chance == pytest.approx(0.02)
    with pytest.raises(ValueError, match="shares steps"):
        pevidence.CellEvidence.joined([whole.at_steps([1]), whole.at_steps([1])])
    without = whole.at_steps([1])
    without.control = None
    assert pevidence.CellEvidence.joined([without, whole.at_steps([2])]).control is None  # a step without a control


def test_a_row_judged_step_by_step_hands_over_each_step_as_its_images_complete(monkeypatch):
    import audit

    row = prows.BY_ID["bayes-ats"]
    plan = next(p for p in pcells.plan_cells(row, pcells.Profile("cpu"), "embedded", {}, Path("/x")) if p.name == "paper:ig")
    assert pslices.claim_of(row, plan) == []  # the cpu cell runs the claim's steps alone: no claim record
    calls, handed = [], []

    class Report:
        data = {"run_key": "k", "status": "complete"}

    monkeypatch.setattr(audit, "run", lambda **call: (calls.append((call["steps"], call["images"])), Report())[1])
    monkeypatch.setattr(prun, "_stored_evidence", lambda plan_, key, steps: ({}, ["ig"], _claim_evidence(2, tuple(steps))))

    def hand(record):
        handed.append((record["step_evidence"].copy(), len(calls)))

    prun.run_cell(row, plan, None, on_step=hand)
    assert [list(e) for e, _ in handed] == [["1"], ["2"], ["5"], ["10"]]
    for evidence, ran in handed:  # each handed over right after its step's last images
        step = int(next(iter(evidence)))
        assert calls[ran - 1] == ([step], 8) and pevidence.CellEvidence.from_dict(evidence[str(step)]).steps == [step]
    calls.clear(), handed.clear()
    prun.run_cell(row, plan, None, on_step=hand, stepped=[1, 2])  # steps 1 and 2 already stored
    assert [list(e) for e, _ in handed] == [["5"], ["10"]]
    # a call that attacks nothing new is still made where its step's evidence is not stored
    kept = {(s, i) for s in (1, 2, 5, 10) for i in range(8)}
    needed = [(c.steps, c.images) for c in pslices.cell_calls(row, plan, kept, stepped=[1]) if c.needed]
    assert needed == [([2], 8), ([5], 8), ([10], 8), ([1, 2, 5, 10], 8)]


def test_a_row_judged_step_by_step_runs_every_cell_at_a_step_before_the_next(monkeypatch):
    import audit

    row = prows.BY_ID["bayes-ats"]
    plans = [p for p in pcells.plan_cells(row, pcells.Profile("cpu"), "embedded", {}, Path("/x")) if p.name != "utility"]
    passes = prun.row_passes(row, plans, {})
    step_passes = [(p.name, step) for p, claim_only, step in passes if step is not None]
    assert step_passes == [(p.name, s) for s in (1, 2, 5, 10) for p in plans]  # step-major: each step judged early
    assert [(p.name, step) for p, _, step in passes[-len(plans):]] == [(p.name, None) for p in plans]  # then whole
    calls, handed = [], []

    class Report:
        data = {"run_key": "k", "status": "complete"}

    monkeypatch.setattr(audit, "run", lambda **call: (calls.append((call["steps"], call["images"])), Report())[1])
    monkeypatch.setattr(prun, "_stored_evidence", lambda plan_, key, steps: ({}, ["ig"], _claim_evidence(2, tuple(steps))))
    paper = next(p for p in plans if p.name == "paper:ig")
    assert prun.run_cell(row, paper, None, on_step=handed.append, until_step=2) is None  # no whole record
    assert calls[-1] == ([2], 8) and all(steps == [2] for steps, _ in calls)  # step 1's images wait for their pass
    assert [list(r["step_evidence"]) for r in handed] == [["2"]]
    calls.clear()
    kept = {(s, i) for s in (1, 2) for i in range(8)}  # steps 1 and 2 kept and stored: the next pass starts at 5
    assert [c.steps for c in pslices.cell_calls(row, paper, kept, stepped=[1, 2], until_step=5) if c.needed] \
        == [[5]] * len([c for c in pslices.cell_calls(row, paper) if c.steps == [5]])


def test_a_step_a_leak_has_decided_is_not_run_again_by_the_other_cells(tmp_path, monkeypatch):
    row, profile = prows.BY_ID["bayes-ats"], pcells.Profile("cpu")
    leaks = {1: 3, 2: 0, 5: 3, 10: 0}  # the paper's cell identifies 3 of 8 at steps 1 and 5, none at 2 and 10
    ran = []

    def step_by_step(row_, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None,
                     on_step=None, stepped=(), until_step=None):
        ran.append((plan.name, until_step))
        if until_step is None:
            raise KeyboardInterrupt  # the sitting ends at the whole passes
        found = leaks[until_step] if plan.name == "paper:ig" else 0
        on_step(pcells.step_record(plan, ["ig"], until_step, _claim_evidence(found, (until_step,)), "k"))

    _fake_cells(monkeypatch, step_by_step)

    def planned_order():
        slices = pgpu.gpu_slices(row, profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
        return list(dict.fromkeys((s.cell, s.step) for s in slices))

    assert planned_order() == [(c, s) for s in (1, 2, 5, 10) for c in ("paper:ig", "planner")]  # step-major
    with pytest.raises(KeyboardInterrupt):
        prun.run_row(row, profile, "embedded", {}, tmp_path / "out", tmp_path / "results")
    # every step decided now: the plan runs the cells' images whole, cell by cell
    assert planned_order() == [(c, s) for c in ("paper:ig", "planner") for s in (1, 2, 5, 10)]
    # the planner runs only where the paper's attack left its step open
    assert ran == [("paper:ig", 1), ("paper:ig", 2), ("planner", 2), ("paper:ig", 5), ("paper:ig", 10),
                   ("planner", 10), ("paper:ig", None)]


def test_a_row_judged_step_by_step_shows_its_complete_steps_and_decides_nothing_before_all(tmp_path, monkeypatch):
    row, profile = prows.BY_ID["bayes-ats"], pcells.Profile("cpu")
    identified = {"n": 3}

    def interrupted(row_, plan, partial=None, on_claim=None, claim_only=False, deadline=None, cache=None,
                    on_step=None, stepped=(), until_step=None):
        for step in (1, 2):  # the paper's cell completes steps 1 and 2 before the sitting ends
            on_step(pcells.step_record(plan, ["ig"], step, _claim_evidence(identified["n"], (step,)), "k"))
        raise KeyboardInterrupt

    _fake_cells(monkeypatch, interrupted)

    def page_of(results):
        with pytest.raises(KeyboardInterrupt):
            prun.run_row(row, profile, "embedded", {}, tmp_path / "out", results)
        path = pstore.results_path(results, "cpu", "embedded", row)
        stored = pstore.load_results(path)
        assert set(stored["cells"]["paper:ig"]["step_evidence"]) == {"1", "2"}
        assert [p.name for p in pcells.cells_to_run(stored, plans)] == ["paper:ig", "planner"]  # neither is whole
        planner = next(p for p in plans if p.name == "planner")  # the planner completes step 1
        stored["cells"]["planner"] = pcells.add_step({}, pcells.step_record(planner, ["ig"], 1, _claim_evidence(0, (1,)), "k"))
        pstore.save_results(path, stored)
        page = prender.render([row], profile, "embedded", {}, results, tmp_path / "out")
        return page.splitlines()[0], " ".join(page.split())

    plans = pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out")
    head, text = page_of(tmp_path / "results")
    assert head.endswith("1 unfinished") and "stale" not in head
    assert "step 1: the claim holds (" in text and "step 2: the claim holds (" in text  # a leak decides its step
    assert "step 5: not complete (no cell has run this step yet)" in text
    assert "6 of 16 identified (steps 1, 2 so far) |" in text  # the table's figures say which steps they are of
    assert "**unfinished (paper:ig under way, planner under way): judged at steps 1, 2, 5, 10: so far (" in text
    # where the paper's attack is at chance, a step waits for the planner's cell before it is judged
    identified["n"] = 0
    head, text = page_of(tmp_path / "at-chance")
    assert head.endswith("1 unfinished")
    assert "step 1: the claim does not hold (" in text  # both cells complete at step 1, at chance
    assert "step 2: not complete (planner still to run; so far the claim does not hold" in text



def test_paper_claims_are_judged_as_the_paper_words_them():
    # Bayes ~ L2 under Gaussian noise, and Bayes not behind the others by more than 1 dB
    row = prows.BY_ID["bayes-gauss-0"]
    assert dict(row.order_kinds) == {"bayes-l2": "tie", "bayes-l1": "not-worse", "bayes-cos": "not-worse"}
    assert "equivalent up to a constant factor" in row.quote
    bayes = _psnr_cell([20.0 + 0.1 * i for i in range(12)])
    l1 = _psnr_cell([18.5 + 0.1 * i + (0.05 if i % 2 else -0.05) for i in range(12)])  # 1.5 dB behind Bayes
    assert pverdict.conclude_order(bayes, {"l1": l1}, {"l1": 0.37}).outcome == pverdict.FAILS  # read as a claimed tie: misses
    assert pverdict.conclude_order(bayes, {"l1": l1}, {"l1": 0.37}, kinds={"l1": "not-worse"}).outcome == pverdict.HOLDS
    far = _psnr_cell([22.0 + 0.1 * i + (0.05 if i % 2 else -0.05) for i in range(12)])  # 2 dB ahead of Bayes
    assert pverdict.conclude_order(bayes, {"l1": far}, {"l1": 0.37}, kinds={"l1": "not-worse"}).outcome == pverdict.FAILS
    with pytest.raises(ValueError):
        pverdict.pair_test(bayes, l1, "similar", 0.0)


def _powered(values, control=12):
    """A cell of per-image PSNR whose positive control recovers its first ``control`` images."""
    c = _psnr_cell(values)
    c.control = {(0, i, 0): i < control for i in range(len(values))}
    return c


def test_refiners_ordering_in_alpha_is_judged_pair_by_pair_on_the_same_images():
    row = prows.BY_ID["refiner-order"]
    assert row.chain == ("refiner-alpha-0.0", "refiner-alpha-0.5", "refiner-alpha-0.9") and "rise in alpha" in row.quote
    falling = [("a0", _powered([20.0 + 0.1 * i for i in range(12)])),
               ("a5", _powered([15.0 + 0.1 * i + (0.05 if i % 2 else -0.05) for i in range(12)])),
               ("a9", _powered([12.0 + 0.1 * i for i in range(12)]))]
    assert pverdict.conclude_chain(falling, [21.24, 13.20, 10.52]).outcome == pverdict.HOLDS
    # the same PSNR at every alpha, measured by an attack with power: a tie, so PSNR does not fall
    same = [(n, _powered([15.0 + 0.1 * i + (0.01 if i % 3 else -0.02) * k for i in range(12)]))
            for k, n in enumerate(("a0", "a5", "a9"))]
    flat = pverdict.conclude_chain(same, [21.24, 13.20, 10.52])
    assert flat.outcome == pverdict.FAILS and "excludes the paper's gap; a tie within 1 dB" in flat.detail
    # ... but where the attack recovers nothing without the defense, nothing is decided
    for control, why in ((0, "attack power"), (None, "no positive control")):
        weak = [(n, _powered([v + 0.0 for v in (c.per_image_psnr.values())], control or 0)) for n, c in same]
        if control is None:
            for _, c in weak:
                c.control = None
        found = pverdict.conclude_chain(weak, [21.24, 13.20, 10.52])
        assert found.outcome == pverdict.INCONCLUSIVE and why in found.detail
    # a wide interval around no difference decides nothing either
    noisy = [(n, _powered([15.0 + (3.0 if (i + k) % 2 else -3.0) for i in range(12)])) for k, n in
             enumerate(("a0", "a5", "a9"))]
    assert pverdict.conclude_chain(noisy, [21.24, 13.20, 10.52]).outcome == pverdict.INCONCLUSIVE
    assert pverdict.conclude_chain([("a0", None), *falling[1:]], [21.24, 13.20, 10.52]).outcome == pverdict.INCONCLUSIVE
    assert pcells.plan_cells(row, pcells.Profile("cpu"), "embedded", {}, Path("/x")) == []


def test_an_attack_at_its_own_budget_runs_there_and_counts_below_the_papers():
    from bench.papers.judge import at_paper_budget

    row, cpu = prows.BY_ID["refiner-alpha-0.5"], pcells.Profile("cpu")
    plans = {p.name: p for p in pcells.plan_cells(row, cpu, "embedded", {}, Path("/x"))}
    assert plans["paper:ig"].call["budget"] == 4000 and plans["paper:idlg"].call["budget"] == 1000
    quick = {p.name: p for p in pcells.plan_cells(row, pcells.Profile("quick"), "embedded", {}, Path("/x"))}
    assert quick["paper:idlg"].call["budget"] == quick["paper:ig"].call["budget"]
    run = pcells.run_setting(row, cpu)
    assert not at_paper_budget(row, run) and "idlg at 1,000 gradient evaluations; 16 of 1,000 images" in pcells.label(row, run)
    gpu = {p.name: p for p in pcells.plan_cells(row, pcells.Profile("gpu"), "embedded", {}, Path("/x"))}
    assert gpu["paper:idlg"].call["budget"] == gpu["paper:ig"].call["budget"] == 4000
    assert at_paper_budget(prows.BY_ID["bayes-gauss-0"], pcells.run_setting(prows.BY_ID["bayes-gauss-0"], cpu))


def test_the_verdict_table_opens_the_page_on_one_screen():
    page = (ROOT / "docs" / "papers.md").read_text().splitlines()
    head = page[:40]
    rows = [line for line in head if line.startswith("| [")]
    assert len(rows) == len(pcli.selected(None, None, "cpu"))
    assert all(len(line) <= 600 for line in page)
    for line in rows:
        assert all(len(cell) <= prender.MAX_CELL for cell in line.strip("|").split(" | "))
    assert "run_key" not in "\n".join(page)


def test_the_gpu_plan_lists_slices_that_each_fit_one_call(tmp_path):
    profile = pcells.Profile("gpu")
    slices = pgpu.gpu_slices(prows.BY_ID["censor-none"], profile, "embedded", {}, tmp_path, tmp_path)
    assert slices and all(s.minutes <= pslices.GPU_SLICE_MINUTES for s in slices)
    row = prows.BY_ID["censor-none"]
    images = pcells.run_setting(row, profile)["images"]
    assert sum(s.images for s in slices if s.cell == "paper:ig") == images
    text = pgpu.gpu_plan(slices)
    assert "censor-none paper:ig step 0 images 0-" in text
    # 5 IG slices of 5.5 planned minutes (2 images each), then the planner's 2.8: one call each (an
    # undefended row is its own positive control: nothing runs twice)
    assert [s.minutes for s in slices] == pytest.approx([5.5] * 5 + [2.75])
    assert text.splitlines()[-1].startswith("slices: 6 left, ~30 planned minutes in 6 9-minute calls")
    assert pslices.calls_needed([dataclasses.replace(s, minutes=2.0) for s in slices]) == 2  # three slices a call


class _FakeEngine:
    """The audit engine's calls, faked: a call writes a result for every image-step it covers
    that its store lacks (as the engine attacks only those), and its clock advances by their
    planned GPU minutes; ``calls``: per call, its cell's store and the image-steps it attacked."""

    def __init__(self, monkeypatch):
        self.now, self.calls = 0.0, []
        monkeypatch.setattr(prun, "run_slice", self.run_slice)
        monkeypatch.setattr(prun, "_stored_evidence", lambda plan, key, steps: ({}, list(plan.call["attacks"]), _cell(2)))
        monkeypatch.setattr(phealth, "model_health", _healthy_model)
        monkeypatch.setattr("bench.papers.stale.planned_now", lambda call: ["ig"])  # the fake planner's pick
        _one_engine_key(monkeypatch)  # the fake's one run

    def clock(self):
        return self.now

    def run_slice(self, call, steps, images):
        from types import SimpleNamespace

        from attacks.presets import defaults_fingerprint

        results = Path(call["out"]) / "runs" / "k" / "results"
        results.mkdir(parents=True, exist_ok=True)
        attacks = [a for a in call["attacks"] if a != "auto"] or ["ig"]  # the planner's pick, for the fake
        new = [(s, i) for s in steps for i in range(images)
               if not (results / f"s{s}__{attacks[0]}__i{i}.json").exists()]
        for (s, i) in new:
            for a in attacks:
                record = {"settings": (call.get("attack_args") or {}).get(a), "defaults": defaults_fingerprint(a),
                          "status": "ok"}
                (results / f"s{s}__{a}__i{i}.json").write_text(json.dumps(record))
        self.now += len(new) * pslices.image_minutes(call) * 60
        self.calls.append((Path(call["out"]).name, new))
        return SimpleNamespace(data={"run_key": "k", "status": "complete"})

    def attacked(self):
        """The image-steps each call that attacked something attacked, by cell store."""
        return [(store, set(new)) for store, new in self.calls if new]


def _covers(slices):
    """What each slice attacks: its cell's store and its image-steps."""
    return [("planner" if s.cell == "planner" else "paper", {(s.step, i) for i in range(s.first, s.first + s.images)})
            for s in slices]


def _gpu_call(engine, row, repo, where, minutes):
    """One GPU call: a fresh machine seeded with the committed results (``repo``), the row run
    under a deadline of ``minutes``, and what it kept copied back into ``repo``."""
    results = where / "papers-gpu"
    if repo.exists():
        shutil.copytree(repo, results)
    deadline = pslices.Deadline(minutes, clock=engine.clock)
    over = prun.run_rows([row], pcells.Profile("gpu"), "embedded", {}, where / "out", results, deadline=deadline)
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(results, repo)
    return deadline, over


def test_a_gpu_call_starts_only_the_slices_that_fit_and_the_next_call_runs_the_rest(tmp_path, monkeypatch):
    """Under a deadline a call starts a slice only while its planned minutes fit what is left,
    keeps what it finished and stops; the next call, seeded with what came back, runs only the
    rest (no kept slice is attacked or even called again) and finishes the row."""
    engine = _FakeEngine(monkeypatch)
    row, repo = prows.BY_ID["censor-none"], tmp_path / "repo"
    plan = pgpu.gpu_slices(row, pcells.Profile("gpu"), "embedded", {}, repo, tmp_path / "out")
    assert [s.minutes for s in plan] == pytest.approx([5.5] * 5 + [2.75])
    deadline, over = _gpu_call(engine, row, repo, tmp_path / "call-1", 13.0)  # two slices fit, not a third
    assert deadline.ran == plan[:2] and over.work == plan[2] and over.left == pytest.approx(2.0)
    assert engine.attacked() == _covers(plan[:2]) and len(engine.calls) == 2
    assert pgpu.gpu_slices(row, pcells.Profile("gpu"), "embedded", {}, repo, tmp_path / "out") == plan[2:]
    assert "paper:ig" not in pstore.load_results(pstore.results_path(repo, "gpu", "embedded", row)).get("cells", {})
    kept = pstore.partial_dir(pstore.results_path(repo, "gpu", "embedded", row), "paper:ig")
    assert sorted(p.name for p in kept.glob("k/*.json")) == [f"s0__ig__i{i}.json" for i in range(4)]
    summary = pgpu.call_summary(deadline, over, plan[2:])
    assert summary.startswith("2 slices run in 11.0 of 13 minutes; stopped before censor-none paper:ig step 0 "
                              "images 4-5: 5.5 min: 2.0 minutes left; 4 left, ~19 planned minutes in 4 9-minute calls")
    engine.calls.clear()
    deadline, over = _gpu_call(engine, row, repo, tmp_path / "call-2", 60.0)
    assert over is None and deadline.ran == plan[2:]
    assert engine.attacked() == _covers(plan[2:]) and len(engine.calls) == 4  # every call attacks something
    stored = pstore.load_results(pstore.results_path(repo, "gpu", "embedded", row))
    assert set(stored["cells"]) == {"paper:ig", "planner"} and not list(repo.rglob("*.partial/*"))  # kept no more
    assert pgpu.gpu_slices(row, pcells.Profile("gpu"), "embedded", {}, repo, tmp_path / "out") == []


def test_the_slices_a_gpu_call_runs_are_the_plans(tmp_path, monkeypatch):
    """What the gpu profile runs is what ``--plan`` lists, slice for slice and in its order (the
    steps of the row's claim of every cell first); every image-step once, sliced for a GPU call."""
    engine = _FakeEngine(monkeypatch)
    row, profile = prows.BY_ID["bayes-ats"], pcells.Profile("gpu")
    plan = pgpu.gpu_slices(row, profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    deadline = pslices.Deadline(10_000.0, clock=engine.clock)
    assert prun.run_rows([row], profile, "embedded", {}, tmp_path / "out", tmp_path / "results", deadline=deadline) \
        is None
    assert deadline.ran == plan
    assert engine.attacked() == _covers(plan)
    claim = [i for i, s in enumerate(plan) if s.step in row.claim_steps]
    assert claim == list(range(len(claim))) and {plan[i].cell for i in claim} == {"paper:ig", "planner"}
    for cell in ("paper", "planner"):
        covered = [pair for store, pairs in _covers(plan) if store == cell for pair in pairs]
        assert sorted(covered) == [(s, i) for s in row.setting.steps for i in range(100)]
    assert max(s.minutes for s in plan) <= pslices.GPU_SLICE_MINUTES + 1e-9 and plan[0].images == 11


def test_the_gpu_profile_stops_cleanly_when_no_slice_fits_its_call_minutes(tmp_path, monkeypatch, capsys):
    """``--call-minutes`` shorter than the first slice: nothing starts, the run returns (exit 0)
    and its last line says what it ran, why it stopped and what is left."""
    engine = _FakeEngine(monkeypatch)
    monkeypatch.setattr(pcli, "require_lpips", lambda: None)
    pcli.main(["--profile", "gpu", "--rows", "censor-none", "--call-minutes", "5", "--out", str(tmp_path / "out"),
             "--results", str(tmp_path / "results")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("0 slices run in ") and " of 5 minutes; stopped before censor-none paper:ig step 0 " \
        "images 0-1: 5.5 min: " in last and last.endswith("; 6 left, ~30 planned minutes in 6 9-minute calls")
    assert engine.calls == []


def test_the_one_call_command_fits_a_remote_command_and_is_in_the_help(capsys):
    command = next(line.strip() for line in pgpu.GPU_CALL.splitlines() if "--call-minutes 8" in line)
    assert len(command) < 2000 and command.startswith("mkdir -p $OUT/papers-gpu && cp -r bench/results/papers/")
    assert "--results $OUT/papers-gpu" in command
    with pytest.raises(SystemExit):
        pcli.main(["--help"])
    assert command in capsys.readouterr().out


def test_retry_reruns_a_stored_cell_that_has_no_positive_control(monkeypatch):
    """A cell stored under its current key is skipped, unless ``--retry`` and its evidence has
    steps but no control (the verdict cannot say "protects" without one), or unless it records
    no engine run key (nothing could check it against today's engine)."""
    from types import SimpleNamespace

    monkeypatch.setattr(pcells, "stale_key", lambda cell: [])  # the engine key itself is checked below
    plan = SimpleNamespace(name="planner", key="k1")
    cell = {"key": "k1", "fingerprints": {}, "call": {}, "run_key": "r1",
            "evidence": {"steps": [0], "missing": [], "control": None}}
    stored = {"cells": {"planner": cell}}
    assert pcells.cells_to_run(stored, [plan]) == []
    unkeyed = {k: v for k, v in cell.items() if k != "run_key"}
    assert pcells.cells_to_run({"cells": {"planner": unkeyed}}, [plan]) == [plan]
    assert pcells.cells_to_run(stored, [plan], retry=True) == [plan]
    cell["evidence"]["control"] = {"0": {"recovered": 3, "images": 8}}
    assert pcells.cells_to_run(stored, [plan], retry=True) == []
    utility = {"key": "k1", "fingerprints": {}, "call": {}, "run_key": "r1", "evidence": {}}
    assert pcells.cells_to_run({"cells": {"planner": utility}}, [plan], retry=True) == []


@pytest.mark.parametrize("lr, why", [(30, "the model diverged"), (300, "non-finite gradients on 2 of 2 images")])
def test_model_health_reads_a_collapsed_step_off_the_audits_own_training(tmp_path, one_thread, lr, why):
    """The model as the audit trains it: healthy at step 0; after 3 rounds at a learning rate
    far too large its logits blow up (lr 30) or its gradients are no longer finite (lr 300), and
    that step is not judged."""
    call = {"defense": "none", "defense_args": None, "model": "cnn", "steps": [0, 3], "images": 2, "image_size": 16,
            "batch_size": 1, "lr": lr, "seed": 0, "out": str(tmp_path), "progress": False}
    health = phealth.model_health(call)
    assert health["0"]["trained"] and health["0"]["finite"] == 2 and phealth.collapsed(health["0"]) == ""
    assert health["0"]["logit_std"] < phealth.DIVERGED_LOGIT_STD
    assert health["3"]["trained"] and why in phealth.collapsed(health["3"])


def test_calibration_pools_the_rules_false_positives_and_the_controls_recoveries(monkeypatch, tmp_path):
    """Above the table: the rule's false positives on the cells' own null items and what the
    positive control recovers, summed over the stored cells that keep them."""
    first = pevidence.CellEvidence(["ig"], [0])
    first.false_positives = [1, 400]
    first.per_image_recovered = {(0, 0, 0): False, (0, 1, 0): False}
    first.control = {(0, 0, 0): True, (0, 1, 0): False}
    second = pevidence.CellEvidence(["ig"], [0])
    second.false_positives = [0, 600]
    unrun = None
    monkeypatch.setattr(prender, "stored_cells", lambda row, *a: ({}, {"a": first, "b": second, "c": unrun}, []))
    note = prender.calibration_note(prows.ROWS[:1], pcells.Profile("cpu"), "embedded", {}, tmp_path, tmp_path)
    assert "calls 1 of 1000 null items recovered" in note and "2 of 2 stored cells" in note
    assert "recovers 1 of 2 images without the defense, over the 1 cells" in note
    monkeypatch.setattr(prender, "stored_cells", lambda row, *a: ({}, {"b": pevidence.CellEvidence(["ig"], [0])}, []))
    assert "kept by none of the 1 stored cells" in prender.calibration_note(prows.ROWS[:1], pcells.Profile("cpu"), "embedded",
                                                                          {}, tmp_path, tmp_path)


def test_a_planner_cell_is_stale_once_the_planner_plans_other_attacks(tmp_path, monkeypatch):
    """A stored planner cell ran the attacks the planner planned then; when the planner now
    plans others for the same call, the cell is stale: rerun, and the page says why."""
    from bench.papers import stale as ps

    row = prows.BY_ID["censor-none"]
    plan = next(p for p in pcells.plan_cells(row, pcells.Profile("quick"), "embedded", {}, tmp_path / "out")
                if p.name == "planner")
    call = json.loads(json.dumps(plan.call))
    cache = ps.PlanCache(tmp_path / "cpu-embedded")
    now = cache.plan(call)
    assert "ig" in now and "auto" not in now  # the planner's picks, named
    cell = {"key": plan.key, "call": call, "attacks": now[:-1], "fingerprints": {}, "run_key": ps.run_key(call),
            "evidence": {"steps": [0], "missing": [], "control": {"0": {"recovered": 1, "images": 2}}}}
    assert ps.stale_plan(cell, cache) == [f"+{now[-1]}"]
    assert pcells.cells_to_run({"cells": {"planner": cell}}, [plan], cache=cache) == [plan]
    assert "the planner's plan changed (+" in pcells.stale_text(ps.stale_plan(cell, cache))
    cell["attacks"] = now + ["old-attack"]
    assert ps.stale_plan(cell, cache) == ["-old-attack"]
    cell["attacks"] = list(now)
    assert ps.stale_plan(cell, cache) == [] and pcells.cells_to_run({"cells": {"planner": cell}}, [plan], cache=cache) == []
    # the kept plan answers without probing again, until the planner's code changes
    monkeypatch.setattr(ps, "planned_now", lambda call: ["ig"])
    assert ps.PlanCache(tmp_path / "cpu-embedded").plan(call) == now
    monkeypatch.setattr(ps, "planner_source", lambda: "changed")
    assert ps.PlanCache(tmp_path / "cpu-embedded").plan(call) == ["ig"]


def test_a_cell_that_ran_under_another_engine_key_is_stale_and_rerun(tmp_path):
    """A stored cell records the engine's run key it ran under; once the key for its call
    differs (the defense's code, a setting), the cell is stale and rerun; an unrecorded key is
    not judged stale."""
    from bench.papers import stale as ps

    row = prows.BY_ID["censor-none"]
    plan = next(p for p in pcells.plan_cells(row, pcells.Profile("quick"), "embedded", {}, tmp_path / "out")
                if p.name == "paper:ig")
    call = json.loads(json.dumps(plan.call))
    today = ps.run_key(call)
    assert today and today == ps.run_key({**call, "out": str(tmp_path / "elsewhere")})  # the folder is no setting
    cell = {"key": plan.key, "call": call, "attacks": ["ig"], "fingerprints": ps.cell_fingerprints(call, ["ig"]),
            "run_key": today, "evidence": {"steps": [0], "missing": [], "control": {"0": {"recovered": 1}}}}
    assert pcells.stale_cell(cell, None) == [] and pcells.cells_to_run({"cells": {plan.name: cell}}, [plan]) == []
    older = {**cell, "run_key": "0123456789ab"}
    assert pcells.stale_cell(older, None) == [ps.KEY_CHANGED]
    assert pcells.cells_to_run({"cells": {plan.name: older}}, [plan]) == [plan]
    assert "the engine's inputs changed" in pcells.stale_text(pcells.stale_cell(older, None))
    # the key follows what changes a number: another defense setting gives another key
    assert ps.run_key({**call, "seed": call.get("seed", 0) + 1}) != today
    assert pcells.stale_cell({k: v for k, v in older.items() if k != "run_key"}, None) == []


def test_a_cell_stored_without_its_control_gains_the_same_control_alone(tmp_path, monkeypatch):
    """A cell stored whole but without a positive control gets the control the full run
    computes, image by image, by the control's audit alone: nothing defended is attacked again."""
    from audit.engine.audit import Audit

    row, profile = prows.BY_ID["bayes-gauss-0"], pcells.Profile("quick", images=2)
    paper = pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out")[0]
    monkeypatch.setattr(pslices, "SLICE_EVALUATIONS", paper.call["budget"])  # one image a slice
    whole = prun.run_cell(row, paper)
    assert whole["evidence"]["control"]  # the reference: the control beside a full run
    bare = json.loads(json.dumps(whole))
    bare["evidence"]["control"], bare["evidence"]["control_missing"] = None, ""
    assert prun.needs_control_only(bare, paper) and not prun.needs_control_only(whole, paper)
    shutil.rmtree(tmp_path / "out")  # a fresh clone: nothing stored but the cell
    attacked = []
    real = schedule.attack_claimed
    monkeypatch.setattr(schedule, "attack_claimed", lambda run, store, spec, obs, step, images, bar:
                        (attacked.append((run.parts.defense.name == "none", list(images))),
                         real(run, store, spec, obs, step, images, bar)))
    partial = pstore.partial_dir(tmp_path / "results" / "cpu-embedded" / "row", paper.name)
    added = prun.run_control(row, paper, bare, partial)
    assert attacked == [(True, [0]), (True, [1])]  # the undefended client only, slice by slice
    assert added["evidence"]["control"] == whole["evidence"]["control"]
    assert added["evidence"]["per_image_psnr"] == whole["evidence"]["per_image_psnr"]
    assert len(list((partial / pstore.CONTROL_PARTIAL).glob("*/*.json"))) == 2  # kept as it went


def test_a_stale_planner_cell_leaves_an_order_claim_decided_and_says_so_beside_it(tmp_path, monkeypatch):
    """An order claim compares the paper's attacks: a planner cell whose plan changed is marked
    stale in its own paragraph, and the row's verdict stands."""
    monkeypatch.setattr("bench.papers.stale.planned_now", lambda call: ["ig", "spear-ig"])
    row, profile = prows.BY_ID["bayes-gauss-0"], pcells.Profile("cpu")
    plans = pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out")
    cells = {}
    for k, plan in enumerate(plans):
        ran = ["ig"] if plan.name == "planner" else list(plan.call["attacks"])
        evidence = _psnr_cell([14.0 + 3 * (plan.name == "paper:bayes-optimal") + i / 10 for i in range(16)])
        evidence.control = {key: True for key in evidence.per_image_psnr}
        cells[plan.name] = {"key": plan.key, "call": json.loads(json.dumps(plan.call)), "attacks": ran,
                            "fingerprints": pstale.cell_fingerprints(plan.call, ran), "evidence": evidence.to_dict()}
    pstore.save_results(pstore.results_path(tmp_path / "results", "cpu", "embedded", row), {"cells": cells})
    view = prender.row_lines(row, profile, "embedded", {}, tmp_path / "results", tmp_path / "out")
    assert view.conclusion.outcome != prender.STALE and not view.verdict.startswith(prender.STALE)
    planner = dict(view.details)["The planner's attacks at their presets"]
    assert "Stale: the planner's plan changed (+spear-ig) since these cells ran" in planner
    # a claim decided on every cell is stale with it
    protects = prows.BY_ID["censor-censor"]
    assert prender.decides(protects, "planner") and not prender.decides(row, "planner") and prender.decides(row, "paper:bayes-l2")


def test_a_planner_cell_resumed_after_the_plan_grew_runs_the_new_attack_on_every_kept_image(tmp_path, monkeypatch):
    """Kept image-steps lack an attack the planner plans now: they are not kept progress (the
    engine reuses the other attacks' results and runs the new one), and a stale claim record
    runs its claim's steps first again."""
    from attacks.presets import defaults_fingerprint
    from bench.papers import stale as ps

    row, profile = prows.BY_ID["bayes-ats"], pcells.Profile("gpu")
    results = pstore.results_path(tmp_path / "results", "gpu", "embedded", row)
    planner = next(p for p in pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out") if p.name == "planner")
    picks = pstore.partial_dir(results, planner.name) / "key"
    picks.mkdir(parents=True)
    for attack in ("ig", "bayes-optimal"):
        (picks / f"s1__{attack}__i0.json").write_text(json.dumps({"defaults": defaults_fingerprint(attack)}))
    monkeypatch.setattr(ps, "planned_now", lambda call: ["ig", "bayes-optimal", "spear"])
    cache = ps.PlanCache(results.parent)
    planned = pstore.planned_attacks(planner, cache)
    assert planned == ["ig", "bayes-optimal", "spear"]
    assert pstore.kept_image_steps(picks.parent, planner) == {(1, 0)}  # by the kept run's own attacks
    assert pstore.kept_image_steps(picks.parent, planner, planned) == set()  # spear still to run there
    (picks / "s1__spear__i0.json").write_text(json.dumps({"defaults": defaults_fingerprint("spear")}))
    monkeypatch.setattr(pstale, "run_key", lambda call: "key")
    assert pstore.kept_image_steps(picks.parent, planner, planned) == pstore.kept_for(picks.parent, planner, cache) == {(1, 0)}
    paper = next(p for p in pcells.plan_cells(row, profile, "embedded", {}, tmp_path / "out") if p.name == "paper:ig")
    assert pstore.planned_attacks(paper, cache) == []  # a cell that names its attacks plans nothing
    record = pcells.claim_record(planner, ["ig", "bayes-optimal"], _claim_evidence(0))
    stored = {"cells": {"planner": record}}
    stepwise = [(planner, False, step) for step in row.claim_steps]  # the row is judged step by step
    assert prun.row_passes(row, [planner], stored) == stepwise + [(planner, False, None)]  # its claim stored, as it ran
    assert prun.row_passes(row, [planner], stored, cache) == [(planner, True, None)] + stepwise + [(planner, False, None)]
    record["attacks"] = planned
    assert prun.row_passes(row, [planner], stored, cache) == stepwise + [(planner, False, None)]


def test_the_gpu_plan_on_the_page_sums_each_rows_slices_and_the_calls_they_need():
    from bench.papers.slices import GpuSlice

    left = [GpuSlice("svd-prune", "paper:ig", 0, 0, 8, 3.0), GpuSlice("svd-prune", "planner", 0, 0, 8, 6.5),
            GpuSlice("censor-none", "planner", 0, 0, 10, 2.0)]
    table = pgpu.plan_table(left)
    assert "| svd-prune | paper:ig, planner | 2 | 9.5 |" in table
    assert "| censor-none | planner | 1 | 2.0 |" in table
    # in order: 3.0 opens a 7-minute call, 6.5 needs a second (4.0 left), 2.0 a third (0.5 left)
    assert "3 left, ~12 planned minutes in 3 9-minute calls" in table
