"""The positive control in the report: per step, what the same attacks recovered without the
defense, and the verdict words that follow from both runs.

The engine stores the control's results (:mod:`audit.engine.control`); here they are judged by
the same leak rule and null as the defended run, image by image, and the defended step's
verdict is qualified:

* the defended run recovers an image: "leaks" stands, with the control beside it;
* it recovers none and the control recovers none either: "inconclusive" (attack power): these
  attacks at this budget cannot tell a defense from their own limits;
* it recovers none and the control recovers k > 0: "no recovered image", with "the defense
  stops k of k" and the exact one-sided McNemar p-value on the per-image pairs;
* the control's evidence is missing or incomplete: "incomplete", never "no recovered image".
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Tuple

from audit.core.evidence import mcnemar_exact
from audit.core.records import ImageClass, Verdict
from audit.core.step_records import ControlSummary, StepVerdict, WorstCase
from audit.report.rule import LeakRule

PRIVATE, INCOMPLETE, INCONCLUSIVE = Verdict.PRIVATE.value, Verdict.INCOMPLETE.value, Verdict.INCONCLUSIVE.value
RECOVERED = ImageClass.RECOVERED.value
#: what to do when the control recovers nothing, for the verdict's reason
POWER_ADVICE = ("raise --budget (or --budget auto, which searches it on the control), add attacks with --attacks, "
                "or run on a GPU (--device cuda) where larger budgets are affordable")

Image = Tuple[int, int]

#: what a control ran, by the code the engine stores (the manifest's ``control.kind``)
CONTROL_KINDS = {
    "simulated": "the same attacks' base forms, budget, seeds and private images against the client without the "
                 "defense: its uploads and its training between audited steps without it, everything else as audited",
    "state": "the same attacks' base forms, budget, seeds and private images against the client's upload from the "
             "same state without the defense",
    "replica": "the replica's own upload of the round's images with the declared training and no privacy mod, from "
               "the same global model: the same attacks' base forms, budget and seeds",
}


def search_text(search: Dict[str, Any]) -> str:
    """Why ``budget="auto"`` chose its budget, from the search's code (``stopped_by``) and numbers;
    a search stored with its own words (an older report) keeps them."""
    tried, code = (search.get("tried") or [{}])[-1], search.get("stopped_by")
    if not code or not tried:
        return search.get("reason", "")
    got = (f"the control recovered {tried.get('recovered')} of {tried.get('images')} images of step "
           f"{tried.get('step')}")
    if code == "recovered":
        return f"{got} at {search.get('budget')} gradient evaluations (at least half)"
    limit = (f"max_budget {search.get('max_budget')}" if code == "max_budget" else
             f"max_minutes {search.get('max_minutes'):g}: the next budget would end past it")
    return (f"{got} at the largest budget tried, {search.get('budget')} ({limit}); steps where it recovers none "
            "are inconclusive")


def control_entry(info: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The report's ``control`` section: the manifest's entry with its codes in words (what the
    control ran, why the budget search stopped)."""
    if not info:
        return {"unavailable": "no positive control was stored for this audit"}
    out = dict(info)
    if out.get("kind") in CONTROL_KINDS:
        out["description"] = CONTROL_KINDS[out["kind"]]
    if out.get("search"):
        out["search"] = {**out["search"], "reason": search_text(out["search"])}
    return out


def _recovered(per_image: Sequence[Dict[str, Any]]) -> Dict[Image, bool]:
    """``(batch, index) -> recovered`` for every judged image."""
    return {(e["image"], e.get("index", 0)): e.get("image_class") == RECOVERED
            for e in per_image if e.get("image_class") is not None}


def control_summary(judged: Optional[Dict[str, Any]], info: Dict[str, Any], rule: LeakRule) -> ControlSummary:
    """The control of one step for the report: ``available``, its label, ``k of n`` recovered
    with the interval, the images it recovered, its budget and attacks (``info``: the manifest's
    ``control`` entry); ``judged``: ``judge_step``'s output on the control's records with the
    attacks that did not apply (``not_applicable``; None: no control was run)."""
    base = {"budget": info.get("budget"), "attacks": list(info.get("attacks") or []),
            "description": control_entry(info).get("description", ""),
            "not_applicable": list((judged or {}).get("not_applicable") or []) or None}
    if judged is None:
        return ControlSummary(**base, available=False, reason=info.get("unavailable") or "no positive control was "
                              "stored for this audit; rerun the audit command to compute it")
    verdict, worst = StepVerdict.from_dict(judged["verdict"]), WorstCase.from_dict(judged["worst_case"])
    recovered = _recovered(worst.per_image)
    complete = verdict.label not in (INCOMPLETE, Verdict.NOT_JUDGED.value)
    return ControlSummary(
        **base, available=complete, label=verdict.label, recovered=verdict.recovered, images=verdict.images,
        recovery_rate=rule.interval(verdict.recovered, verdict.images).to_dict(),
        recovered_images=[list(k) for k, v in sorted(recovered.items()) if v],
        per_image=[{"image": i, "index": j, "recovered": v} for (i, j), v in sorted(recovered.items())],
        mean_psnr=worst.psnr,
        reason=None if complete else f"the control is {verdict.label}: {verdict.reason}".rstrip(": "))


def defense_effect(defended: Sequence[Dict[str, Any]], control: Any) -> Optional[Dict[str, Any]]:
    """The paired comparison on the images both runs judged: the control recovered and the
    defended run did not (``stopped``), the reverse (``let_through``), and the one-sided exact
    McNemar p-value that the defense recovers no fewer images than the control."""
    control = ControlSummary.from_dict(control)
    if not control.available:
        return None
    mine = _recovered(defended)
    theirs = {(e["image"], e["index"]): e["recovered"] for e in control.per_image or []}
    both = sorted(set(mine) & set(theirs))
    if not both:
        return None
    stopped = sum(theirs[k] and not mine[k] for k in both)
    let_through = sum(mine[k] and not theirs[k] for k in both)
    return {"images": len(both), "control_recovered": sum(theirs[k] for k in both), "stopped": stopped,
            "let_through": let_through, "p_value": mcnemar_exact(stopped, let_through),
            "test": "exact McNemar (one-sided): each image recovered by one run only is a fair coin under no effect"}


def controlled_verdict(verdict: Any, per_image: Sequence[Dict[str, Any]], control: Any) -> StepVerdict:
    """The step's verdict qualified by its control (see the module docstring)."""
    verdict, control = StepVerdict.from_dict(verdict), ControlSummary.from_dict(control)
    effect = defense_effect(per_image, control)
    if effect is not None:
        verdict = replace(verdict, defense_effect=effect)
    if verdict.label != PRIVATE:
        return verdict
    if not control.available:
        return replace(verdict, label=INCOMPLETE, reason=f"no recovered image, but the positive control is missing: "
                                                         f"{control.reason or 'not run'}")
    if not control.recovered:
        skipped = control.not_applicable or []
        attacks = ", ".join(a for a in control.attacks if a not in skipped) or "the attacks"
        aside = f" ({', '.join(skipped)}: not applicable to this model)" if skipped else ""
        return replace(verdict, label=INCONCLUSIVE, attack_power=False, reason=(
            f"attack power: {attacks}{aside} recover none of these {control.images} images without the "
            f"defense at budget {control.budget}; {POWER_ADVICE}"))
    if effect is None:
        return replace(verdict, label=INCOMPLETE, reason="no recovered image, but no image was judged by both the "
                                                         "defended run and its control")
    return verdict
