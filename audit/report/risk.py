"""Risk numbers of the report: per-image judgement against chance, the worst case over
attacks, the Bayes paper's empirical adversarial risk, and verdicts that fail closed.

Each private image is judged by :class:`audit.report.rule.LeakRule` from the evidence its
records carry (aligned PSNR, rank among K candidates) and its null (the chance level).
Calibrated as a whole: a step "leaks" when an image is exact, or when more of its images are
recovered than images carrying nothing private would reach at the report's level (and
"partially" likewise), so its word has a stated false-positive rate (:meth:`LeakRule.step_bars`).
Fail closed: without such a leak, any missing evidence (an attack that raised, failed to optimise, returned no evidence, or has
not run yet) makes it "incomplete", naming the attacks; only a step where every planned
attack finished on every image can be "partially" or "no recovered image", and it says
with an exact interval what recovery rate its images can exclude. A step where no attack
applies is "not judged" with the reason.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from audit.core.evidence import binomial_tail, excluded_rate, images_to_exclude
from audit.core.manifest import Manifest
from audit.core.records import SEVERITY, AttackResult, ImageClass, Interval, NullEvidence, Status, Verdict
from audit.core.step_records import AttackSummary, Risk, StepBar, StepReport, StepVerdict, WorstCase
from audit.report.reasons import word
from audit.report.rule import LeakRule

# metric name -> True when a higher value means more leakage
METRICS = {"psnr": True, "ssim": True, "lpips": False, "label_acc": True}

RECOVERED, PARTIAL, PRIVATE = Verdict.LEAKS.value, Verdict.PARTIALLY.value, Verdict.PRIVATE.value
INCOMPLETE, NOT_JUDGED = Verdict.INCOMPLETE.value, Verdict.NOT_JUDGED.value
INCONCLUSIVE = Verdict.INCONCLUSIVE.value
#: a rate the report says how many images would exclude
TARGET_RATE = 0.05

#: record status -> None (evidence), "neutral" (the attack does not apply), or the words
#: for missing evidence. An unknown status is missing evidence too (fail closed).
STATUS_EVIDENCE: Dict[str, Optional[str]] = {
    Status.OK.value: None,
    Status.NOT_APPLICABLE.value: "neutral",
    Status.ERROR.value: "failed",
    Status.FAILED_TO_OPTIMISE.value: "failed to optimise",
}
#: a null per private image: (private batch, index in the batch) -> its evidence
Nulls = Dict[Tuple[int, int], NullEvidence]


def default_delta(numel: int, rmse: float = 0.1) -> float:
    """The l2 radius of the risk ball: ``rmse * sqrt(pixels)`` (RMSE 0.1 = PSNR 20 dB)."""
    return rmse * math.sqrt(numel)


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _best(values: Iterable[Optional[float]], higher: bool) -> Optional[float]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return max(vals) if higher else min(vals)


# --------------------------------------------------------------------------- one record
def status_of(record: AttackResult) -> str:
    """The record's status word, with an "ok" whose trace says it failed to optimise read as such."""
    status = record.effective_status
    return getattr(status, "value", status)


def image_metrics(record: AttackResult) -> List[Dict[str, Any]]:
    """Per private image of the record's batch: each metric at its most leaking over the
    references the record was scored against (original, and what the client trained on),
    and ``evidence``: its :class:`ImageEvidence` per reference (empty when missing)."""
    refs = record.references()
    count = refs[0].count() if refs else 1
    evidence = [m.evidence for m in refs if len(m.evidence) == count]
    out = []
    for j in range(count):
        entry: Dict[str, Any] = {}
        for name, higher in METRICS.items():
            entry[name] = _best([m.per_image(name, count)[j] for m in refs], higher)
        entry["l2"] = _best([m.l2[j] if m.l2 is not None and len(m.l2) == count else None for m in refs], False)
        entry["evidence"] = [e[j] for e in evidence]
        entry["certificate_error"] = record.trace.certificate_error  # the batch reproduces the upload
        out.append(entry)
    return out


def _judgeable(record: AttackResult) -> bool:
    return all(e["evidence"] for e in image_metrics(record))


# --------------------------------------------------------------------------- one attack
def summarize_attack(records: List[AttackResult]) -> AttackSummary:
    """One attack at one step: means over its judged private images (``aligned_psnr``: each
    image's best aligned PSNR, the leak rule's quantity), the worst image, and what did not
    finish. Results that do not apply count neither as done nor as missing
    (``images_not_applicable``); when none applies, ``reason`` says why."""
    ok = [r for r in records if status_of(r) == Status.OK.value]
    images = [e for r in ok for e in image_metrics(r)]
    skipped = [r for r in records if status_of(r) == Status.NOT_APPLICABLE.value]
    reason = None
    if skipped and len(skipped) == len(records):
        reason = "; ".join(dict.fromkeys(word(r.not_applicable_reason) if r.not_applicable_reason
                                         else "no reason given" for r in skipped))
    trained = [r.metrics_trained for r in ok if r.metrics_trained is not None]
    unavailable = {k: v for r in ok for k, v in (r.unavailable or {}).items()}
    problems = [{"image": r.image, "status": status_of(r), "reason": r.reason}
                for r in records if status_of(r) != Status.OK.value]
    return AttackSummary(
        images_done=len(records) - len(skipped), images_ok=len(ok), images_not_applicable=len(skipped),
        status=_attack_status(records), reason=reason, **{name: _mean(e[name] for e in images) for name in METRICS},
        aligned_psnr=_mean(_best([ev.aligned_psnr for ev in e["evidence"]], True) for e in images),
        psnr_max=_best([e["psnr"] for e in images], True),
        # an input-transforming defense: also scored against what the client trained on
        psnr_original=_mean(r.metrics.psnr for r in ok if r.metrics is not None) if trained else None,
        psnr_trained=_mean(m.psnr for m in trained) if trained else None,
        unavailable=unavailable or None, problems=problems or None)


def _attack_status(records: List[AttackResult]) -> str:
    statuses = {status_of(r) for r in records}
    if not records:
        return "pending"
    if statuses == {"ok"}:
        return "ok"
    if statuses == {"ok", "not_applicable"}:
        return "partly not applicable"
    if "ok" in statuses:
        return "partly failed"
    if statuses == {"not_applicable"}:
        return "not applicable"
    return "failed to optimise" if statuses <= {"failed_to_optimise", "not_applicable"} else "error"


# --------------------------------------------------------------------------- one step
def missing_evidence(by_attack: Dict[str, List[AttackResult]], images: int) -> List[Dict[str, Any]]:
    """Per attack, the private batches it gave no evidence on, and why (fail closed: an
    error, a failure to optimise, missing metrics, an unknown status, or not run yet)."""
    out = []
    for attack, recs in by_attack.items():
        seen = {r.image: r for r in recs}
        gaps: List[Tuple[int, str]] = []
        for image in range(images):
            rec = seen.get(image)
            if rec is None:
                gaps.append((image, "pending"))
                continue
            status = status_of(rec)
            kind = STATUS_EVIDENCE.get(status, f"status {status!r}")
            if kind == "neutral":
                continue
            if kind is None and not _judgeable(rec):
                kind = "no evidence"
            if kind is not None:
                gaps.append((image, kind if not rec.reason else f"{kind}: {rec.reason}"))
        if gaps:
            kinds = sorted({why.split(":")[0] for _, why in gaps})
            out.append({"attack": attack, "images": [i for i, _ in gaps], "why": ", ".join(kinds),
                        "reasons": [why for _, why in gaps]})
    return out


CLASS_ORDER = {ImageClass.RECOVERED: 2, ImageClass.PARTIAL: 1, ImageClass.NOT_RECOVERED: 0}


def worst_case(by_attack: Dict[str, List[AttackResult]], rule: LeakRule, nulls: Nulls) -> WorstCase:
    """Per private image (each image of each batch): its class under ``rule`` at the most
    leaking attack, that attack, its evidence and chance level, and each metric at its most
    leaking attack; then the mean over images and the worst image. Records that failed to
    optimise still count when they leak (they can only raise leakage)."""
    rows: Dict[Tuple[int, int], List[Tuple[str, Dict[str, Any]]]] = {}
    for attack, recs in by_attack.items():
        for r in recs:
            if status_of(r) in (Status.OK.value, Status.FAILED_TO_OPTIMISE.value):
                for j, entry in enumerate(image_metrics(r)):
                    rows.setdefault((r.image, j), []).append((attack, entry))
    per_image = []
    for (image, j), found in sorted(rows.items()):
        null = nulls.get((image, j))
        chance = None if null is None else null.chance_level
        entry: Dict[str, Any] = {"image": image, "index": j, "chance_level": chance}
        for name, higher in METRICS.items():
            entry[name] = _best([e[name] for _, e in found], higher)
        judged = []
        for attack, e in found:
            for ev in e["evidence"]:  # the original, and what the client trained on
                level = chance if ev.chance_level is None else ev.chance_level
                cls = rule.classify(ev.aligned_psnr, ev.rank, level)
                if cls is not None:
                    judged.append((CLASS_ORDER[cls], ev.aligned_psnr - level, attack, cls, ev, level, e))
        if judged:
            _, _, attack, cls, ev, level, e = max(judged, key=lambda t: t[:2])
            entry.update(best_attack=attack, image_class=cls.value, aligned_psnr=ev.aligned_psnr, rank=ev.rank,
                         candidates=ev.candidates, chance_level=level, exact=rule.exact(cls, e["certificate_error"], ev.aligned_psnr))
        else:
            entry.update(best_attack=None, image_class=None, aligned_psnr=None, rank=None, candidates=None)
        per_image.append(entry)
    done = [e for e in per_image if e["image_class"] is not None]
    return WorstCase(**{name: _mean(e[name] for e in done) for name in METRICS},
                     aligned_psnr=_mean(e["aligned_psnr"] for e in done), psnr_max=_best([e["psnr"] for e in done], True),
                     ssim_max=_best([e["ssim"] for e in done], True),
                     above_chance_max=_best([e["aligned_psnr"] - e["chance_level"] for e in done], True),
                     per_image=per_image)


def step_verdict(per_image: List[Dict[str, Any]], rule: LeakRule, missing: Sequence[Dict[str, Any]] = (),
                 attacks: int = 1, bars: Optional[Tuple[StepBar, StepBar]] = None) -> StepVerdict:
    """The step's verdict from its judged images and the attacks with missing evidence:
    ``k of n`` images recovered with an exact interval, and for 'no recovered image' the
    recovery rate it excludes and the images that would exclude :data:`TARGET_RATE`.
    ``bars``: what "leaks" and "partially" need of the judged images (:meth:`LeakRule.step_bars`);
    None counts every image (one recovered image leaks)."""
    judged = [e for e in per_image if e.get("image_class") is not None]
    counts = {c: sum(e["image_class"] == c.value for e in judged) for c in ImageClass}
    n = len(judged)
    exact = sum(bool(e.get("exact")) for e in judged)
    recovered, reached = counts[ImageClass.RECOVERED], counts[ImageClass.RECOVERED] + counts[ImageClass.PARTIAL]
    leak_bar, partial_bar = bars or (None, None)
    leaks = exact > 0 or recovered >= (leak_bar.needed if leak_bar else 1)
    partly = reached >= (partial_bar.needed if partial_bar else 1)
    found = (Verdict.LEAKS if leaks else Verdict.PARTIALLY if partly else Verdict.PRIVATE if judged else None)
    rate = rule.interval(recovered, n)
    identified = rule.interval(sum(e["rank"] is not None and e["rank"] <= rule.identify_rank for e in judged), n)
    out = {"recovered": recovered, "exact": exact,
           "partially": counts[ImageClass.PARTIAL], "not_recovered": counts[ImageClass.NOT_RECOVERED], "images": n,
           "judged": None if found is None else found.value, "failed_attacks": list(missing),
           "recovery_rate": rate.to_dict(), "identification_rate": identified.to_dict()}
    if bars:
        out["bars"] = [bar.to_dict() for bar in bars]
    if found is Verdict.LEAKS:
        label, reason = Verdict.LEAKS, ""
    elif missing:
        label = Verdict.INCOMPLETE
        reason = "; ".join(f"{m['attack']} {m['why']} on batch(es) {', '.join(map(str, m['images']))}"
                           for m in missing)
    elif found is None:
        label = Verdict.NOT_JUDGED
        reason = ("no planned attack" if not attacks else
                  "no attack applies to this step (every attack reported not applicable)")
    else:
        label, reason = found, ""
    if bars and found is not Verdict.LEAKS and below_bar_reason(recovered, reached, n, bars):
        out["short_of"] = below_bar_reason(recovered, reached, n, bars)
    if n and recovered == 0:
        out["excludes_rate_above"] = excluded_rate(n, rule.level)
        out["images_to_exclude"] = {"rate": TARGET_RATE, "images": images_to_exclude(TARGET_RATE, rule.level)}
    return StepVerdict(label=label.value, reason=reason, **out)


def below_bar_reason(recovered: int, reached: int, n: int, bars: Tuple[StepBar, StepBar]) -> str:
    """Why images that met a per-image bar did not make the step's word: their count against the
    count the word needs and how often images carrying nothing private reach it."""
    parts = []
    for count, bar, what in ((recovered, bars[0], "recovered"), (reached, bars[1], "partially recovered or better")):
        if count and count < bar.needed:
            chance = binomial_tail(n, bar.per_image, count)
            parts.append(f"{count} of {n} image(s) {what}, fewer than the {bar.needed} '{bar.word}' needs: images "
                         f"that carry nothing private reach {count} in {chance:.0%} of such steps")
    return "; ".join(parts)


def empirical_risk(by_attack: Dict[str, List[AttackResult]], delta: float) -> Risk:
    """The Bayes paper's empirical adversarial risk at radius ``delta``.

    For each attack, the fraction of private images it reconstructs within l2 distance
    ``delta`` (``success``; the nearer of the original and what the client trained on);
    the strongest attack is the one with the largest fraction, and ``bayes_risk`` = 1 - its
    success is the paper's R(f) = P(||x - f(g)||_2 > delta).
    """
    per_attack = {}
    for attack, recs in by_attack.items():
        entries = [e for r in recs if status_of(r) == "ok" for e in image_metrics(r)]
        dists = [e["l2"] for e in entries if e["l2"] is not None]
        if dists:
            inside = sum(d <= delta for d in dists)
            per_attack[attack] = {"within": inside, "images": len(dists), "success": inside / len(dists),
                                  "psnr": _mean(e["psnr"] for e in entries)}
    if not per_attack:
        return Risk(delta=delta, reason="no attack finished on this step")
    # ties (e.g. every attack at 0%) go to the attack with the higher mean PSNR
    strongest = max(per_attack, key=lambda a: (per_attack[a]["success"], per_attack[a]["psnr"] or -math.inf))
    success = per_attack[strongest]["success"]
    return Risk(delta=delta, strongest_attack=strongest, success=success, bayes_risk=1.0 - success,
                per_attack=per_attack)


def judge_step(by_attack: Dict[str, List[AttackResult]], images: int, rule: LeakRule, nulls: Nulls) -> Dict[str, Any]:
    """Worst case and verdict of one step with ``images`` planned private batches
    (``{"worst_case": WorstCase, "verdict": StepVerdict}``)."""
    wc = worst_case(by_attack, rule, nulls)
    bars = step_bars(rule, nulls, sum(e["image_class"] is not None for e in wc.per_image))
    missing = missing_evidence(by_attack, images)
    for e in wc.per_image:  # an image without a null or evidence is missing evidence, never private
        if e["image_class"] is None and not any(m for m in missing if e["image"] in m["images"]):
            missing.append({"attack": "leak rule", "images": [e["image"]], "why": "no null for this image",
                            "reasons": ["no null for this image"]})
    return {"worst_case": wc, "verdict": step_verdict(wc.per_image, rule, missing, attacks=len(by_attack), bars=bars)}


def step_bars(rule: LeakRule, nulls: Nulls, images: int) -> Optional[Tuple[StepBar, StepBar]]:
    """What "leaks" and "partially" need of ``images`` judged images, calibrated on the audit's
    null (:meth:`LeakRule.step_bars`); None without a null."""
    if not nulls or not rule.calibrated:
        return None
    some = next(iter(nulls.values()))
    return rule.step_bars(images, measured_rates(rule, nulls), some.candidates, some.similarity)


_RATES: Dict[Tuple[Any, ...], Tuple[Interval, Interval]] = {}


def measured_rates(rule: LeakRule, nulls: Nulls) -> Tuple[Interval, Interval]:
    """:meth:`LeakRule.false_positives` on ``nulls``, kept for the last few nulls (a report judges
    every step and its control on the same null)."""
    key = (rule, tuple((k, tuple(v.scores), tuple(v.ranks)) for k, v in sorted(nulls.items())))
    if key not in _RATES:
        if len(_RATES) > 8:
            _RATES.clear()
        _RATES[key] = rule.false_positives(nulls.values())
    return _RATES[key]


def nulls_from_manifest(manifest: Any) -> Nulls:
    """The stored null of every private image, keyed by (batch, index in the batch)."""
    out: Nulls = {}
    for image, batch in enumerate((Manifest.from_dict(manifest).null or {}).get("images") or []):
        for j, data in enumerate(batch):
            out[(image, j)] = NullEvidence.from_dict(data)
    return out


def false_positive_rates(rule: LeakRule, nulls: Nulls) -> Dict[str, Any]:
    """The rule's false-positive rates on the audited data (see :meth:`LeakRule.false_positives`)."""
    if not nulls:
        return {"unavailable": "no null was stored for this audit"}
    recovered, partial = measured_rates(rule, nulls)
    return {"recovered": recovered.to_dict(), "partially_or_worse": partial.to_dict(),
            "how": "every null item (unrelated image or data-only guess) of every private image fed to the rule as "
                   "its reconstruction, judged against the chance level of the other items (leave-one-out)"}


# --------------------------------------------------------------------------- the run
def overall_verdict(steps: Sequence[Any]) -> Dict[str, Any]:
    """The worst step by :data:`~audit.core.records.SEVERITY` (leaks > partially > incomplete >
    inconclusive > not judged > no recovered image): a run reads "no recovered image" only when
    every step does; steps lacking evidence are listed with their reasons. ``steps``:
    :class:`~audit.core.step_records.StepReport` records or their JSON objects."""
    steps = [StepReport.from_dict(s) for s in steps]
    severity = {v.value: rank for v, rank in SEVERITY.items()}
    not_judged = [{"step": s.step, "reason": s.verdict.reason}
                  for s in steps if s.label not in severity or s.label == NOT_JUDGED]
    if not steps:
        return {"label": NOT_JUDGED, "reason": "no audited step", "worst_step": None, "worst_psnr": None,
                "leaking_steps": [], "incomplete_steps": [], "inconclusive_steps": [], "not_judged_steps": []}

    def rank(s):  # an unknown label ranks with "not judged" (fail closed)
        return severity.get(s.label, severity[NOT_JUDGED]), s.worst_case.above_chance_max or -math.inf

    worst = max(steps, key=rank)
    label = worst.label if worst.label in severity else NOT_JUDGED
    return {"label": label, "reason": worst.verdict.reason, "worst_step": None if label == NOT_JUDGED else worst.step,
            "worst_psnr": worst.worst_case.psnr, "worst_image_psnr": worst.worst_case.psnr_max,
            "leaking_steps": [s.step for s in steps if s.label == RECOVERED],
            "incomplete_steps": [s.step for s in steps if s.label == INCOMPLETE],
            "inconclusive_steps": [s.step for s in steps if s.label == INCONCLUSIVE], "not_judged_steps": not_judged}
