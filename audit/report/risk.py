"""Risk numbers of the report: per-image judgement, the worst case over attacks, the Bayes
paper's empirical adversarial risk, and verdicts that fail closed.

Fail closed: a step is "leaks" as soon as one private image is recovered; otherwise any
missing evidence (an attack that raised, failed to optimise, returned no metrics, or has
not run yet) makes it "incomplete", naming the attacks; only a step where every planned
attack finished on every image can be "partially" or "no recovered image". A step where no
attack applies is "not judged" with the reason. Batches are judged per private image.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

# metric name -> True when a higher value means more leakage
METRICS = {"psnr": True, "ssim": True, "lpips": False, "label_acc": True}

RECOVERED, PARTIAL, PRIVATE = "leaks", "partially", "no recovered image"
INCOMPLETE, NOT_JUDGED = "incomplete", "not judged"
#: how bad a step verdict is for the defender; "not judged" steps are listed, never ranked
SEVERITY = {RECOVERED: 3, PARTIAL: 2, INCOMPLETE: 1, PRIVATE: 0}

#: record status -> None (evidence), "neutral" (the attack does not apply), or the words
#: for missing evidence. An unknown status is missing evidence too (fail closed).
STATUS_EVIDENCE: Dict[str, Optional[str]] = {
    "ok": None,
    "not_applicable": "neutral",
    "error": "failed",
    "failed_to_optimise": "failed to optimise",
}
#: the reference images a record may be scored against: the private original, and (for
#: input-transforming defenses) the batch the client actually trained on
REFERENCES = ("metrics", "metrics_trained")


@dataclass(frozen=True)
class Thresholds:
    """Per-image classification of the worst-case reconstruction.

    * recovered: PSNR >= ``leak_psnr`` dB or SSIM >= ``leak_ssim``;
    * not recovered (the Refiner paper's "private"): PSNR <= ``private_psnr`` dB and
      SSIM < ``private_ssim``;
    * partially recovered otherwise. Both PSNR and SSIM missing: not judged.
    """

    leak_psnr: float = 20.0
    leak_ssim: float = 0.5
    private_psnr: float = 15.0
    private_ssim: float = 0.5

    def classify(self, psnr: Optional[float], ssim: Optional[float]) -> Optional[str]:
        """The image's class, or None when neither PSNR nor SSIM is there to judge it by."""
        if psnr is None and ssim is None:
            return None
        if (psnr is not None and psnr >= self.leak_psnr) or (ssim is not None and ssim >= self.leak_ssim):
            return RECOVERED
        if (psnr is None or psnr <= self.private_psnr) and (ssim is None or ssim < self.private_ssim):
            return PRIVATE
        return PARTIAL

    def describe(self) -> str:
        return (
            f"an image counts as recovered if its worst-case PSNR >= {self.leak_psnr:g} dB or "
            f"SSIM >= {self.leak_ssim:g}; as not recovered (the Refiner paper's 'private') if "
            f"PSNR <= {self.private_psnr:g} dB and SSIM < {self.private_ssim:g}; partially "
            "otherwise. Each image of a batch is judged on its own. A step 'leaks' if any image is "
            "recovered; is 'incomplete' (naming the attacks) if any planned attack raised, failed to "
            "optimise, has no metrics or has not run; is 'partially' if any image is partially "
            "recovered, and has 'no recovered image' otherwise; a step where no attack applies is "
            "'not judged'. The overall verdict is the worst judged step."
        )

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "rule": self.describe()}


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
def trace_failed(record: Dict[str, Any]) -> bool:
    """The optimisation engine's stall detection marked the attack as failed to optimise."""
    trace = record.get("trace") or {}
    return bool(trace.get("failed_to_optimise")) or trace.get("status") == "failed_to_optimise"


def status_of(record: Dict[str, Any]) -> str:
    """The record's status, with an "ok" whose trace says it failed to optimise read as such."""
    status = record.get("status", "error")
    return "failed_to_optimise" if status == "ok" and trace_failed(record) else status


def _per_image(metrics: Dict[str, Any], name: str, count: int) -> List[Optional[float]]:
    """One value per private image of the batch: the ``<name>_per_image`` list, else the
    batch value for each (a batch mean never stands in for a worse image when the list is there)."""
    values = metrics.get(f"{name}_per_image")
    if isinstance(values, list) and len(values) == count:
        return [None if v is None else float(v) for v in values]
    value = metrics.get(name)
    return [None if value is None else float(value)] * count


def _batch_count(record: Dict[str, Any]) -> int:
    for ref in REFERENCES:
        metrics = record.get(ref) or {}
        for name in ("psnr", "ssim", "lpips", "l2"):
            values = metrics.get("l2" if name == "l2" else f"{name}_per_image")
            if isinstance(values, list) and values:
                return len(values)
    return 1


def image_metrics(record: Dict[str, Any]) -> List[Dict[str, Optional[float]]]:
    """Per private image of the record's batch: each metric at its most leaking over the
    references the record was scored against (original, and what the client trained on)."""
    count = _batch_count(record)
    refs = [record[r] for r in REFERENCES if record.get(r)]
    out = []
    for j in range(count):
        entry: Dict[str, Optional[float]] = {}
        for name, higher in METRICS.items():
            entry[name] = _best([_per_image(m, name, count)[j] for m in refs], higher)
        l2s = [m.get("l2") for m in refs]
        entry["l2"] = _best([d[j] if isinstance(d, list) and len(d) == count else None for d in l2s], False)
        out.append(entry)
    return out


def _judgeable(record: Dict[str, Any]) -> bool:
    return any(e["psnr"] is not None or e["ssim"] is not None for e in image_metrics(record))


# --------------------------------------------------------------------------- one attack
def summarize_attack(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """One attack at one step: means over its judged private images, the worst image, and
    what did not finish."""
    ok = [r for r in records if status_of(r) == "ok"]
    images = [e for r in ok for e in image_metrics(r)]
    out: Dict[str, Any] = {"images_done": len(records), "images_ok": len(ok), "status": _attack_status(records)}
    for name in METRICS:
        out[name] = _mean(e[name] for e in images)
    out["psnr_max"] = _best([e["psnr"] for e in images], True)
    trained = [r["metrics_trained"] for r in ok if r.get("metrics_trained")]
    if trained:  # input-transforming defense: also scored against what the client trained on
        out["psnr_original"] = _mean(r["metrics"].get("psnr") for r in ok if r.get("metrics"))
        out["psnr_trained"] = _mean(m.get("psnr") for m in trained)
    unavailable = {k: v for r in ok for k, v in r.get("unavailable", {}).items()}
    if unavailable:
        out["unavailable"] = unavailable
    problems = [r for r in records if status_of(r) != "ok"]
    if problems:
        out["problems"] = [{"image": r["image"], "status": status_of(r), "reason": r.get("reason", "")}
                           for r in problems]
    return out


def _attack_status(records: List[Dict[str, Any]]) -> str:
    statuses = {status_of(r) for r in records}
    if not records:
        return "pending"
    if statuses == {"ok"}:
        return "ok"
    if "ok" in statuses:
        return "partly failed"
    if statuses == {"not_applicable"}:
        return "not applicable"
    return "failed to optimise" if statuses <= {"failed_to_optimise", "not_applicable"} else "error"


# --------------------------------------------------------------------------- one step
def missing_evidence(by_attack: Dict[str, List[Dict[str, Any]]], images: int) -> List[Dict[str, Any]]:
    """Per attack, the private batches it gave no evidence on, and why (fail closed: an
    error, a failure to optimise, missing metrics, an unknown status, or not run yet)."""
    out = []
    for attack, recs in by_attack.items():
        seen = {r["image"]: r for r in recs}
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
                kind = "no PSNR/SSIM"
            if kind is not None:
                gaps.append((image, kind if not rec.get("reason") else f"{kind}: {rec['reason']}"))
        if gaps:
            kinds = sorted({why.split(":")[0] for _, why in gaps})
            out.append({"attack": attack, "images": [i for i, _ in gaps], "why": ", ".join(kinds),
                        "reasons": [why for _, why in gaps]})
    return out


def worst_case(by_attack: Dict[str, List[Dict[str, Any]]], thresholds: Thresholds) -> Dict[str, Any]:
    """Per private image (each image of each batch), the most leaking attack for each
    metric; then the mean over images, the worst image, and the per-image classes. Records
    that failed to optimise still count when they leak (they can only raise leakage)."""
    rows: Dict[Tuple[int, int], List[Tuple[str, Dict[str, Optional[float]]]]] = {}
    for attack, recs in by_attack.items():
        for r in recs:
            if status_of(r) in ("ok", "failed_to_optimise"):
                for j, entry in enumerate(image_metrics(r)):
                    rows.setdefault((r["image"], j), []).append((attack, entry))
    per_image = []
    for (image, j), found in sorted(rows.items()):
        entry: Dict[str, Any] = {"image": image, "index": j}
        for name, higher in METRICS.items():
            entry[name] = _best([e[name] for _, e in found], higher)
        top = max(found, key=lambda ae: ae[1]["psnr"] if ae[1]["psnr"] is not None else -math.inf)
        entry["best_attack"] = top[0]
        entry["class"] = thresholds.classify(entry["psnr"], entry["ssim"])
        per_image.append(entry)
    judged = [e for e in per_image if e["class"] is not None]
    summary: Dict[str, Any] = {name: _mean(e[name] for e in judged) for name in METRICS}
    summary["psnr_max"] = _best([e["psnr"] for e in judged], True)
    summary["ssim_max"] = _best([e["ssim"] for e in judged], True)
    summary["per_image"] = per_image
    return summary


def step_verdict(per_image: List[Dict[str, Any]], missing: Sequence[Dict[str, Any]] = (),
                 attacks: int = 1) -> Dict[str, Any]:
    """The step's verdict from its judged images and the attacks with missing evidence."""
    judged = [e for e in per_image if e.get("class") is not None]
    counts = {c: sum(e["class"] == c for e in judged) for c in (RECOVERED, PARTIAL, PRIVATE)}
    found = RECOVERED if counts[RECOVERED] else PARTIAL if counts[PARTIAL] else PRIVATE if judged else None
    out = {"recovered": counts[RECOVERED], "partially": counts[PARTIAL], "not_recovered": counts[PRIVATE],
           "images": len(judged), "judged": found, "failed_attacks": list(missing)}
    if found == RECOVERED:
        label, reason = RECOVERED, ""
    elif missing:
        label = INCOMPLETE
        reason = "; ".join(f"{m['attack']} {m['why']} on batch(es) {', '.join(map(str, m['images']))}"
                           for m in missing)
    elif found is None:
        label = NOT_JUDGED
        reason = ("no planned attack" if not attacks else
                  "no attack applies to this step (every attack reported not applicable)")
    else:
        label, reason = found, ""
    return {"label": label, "reason": reason, **out}


def empirical_risk(by_attack: Dict[str, List[Dict[str, Any]]], delta: float) -> Dict[str, Any]:
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
        return {"delta": delta, "strongest_attack": None, "success": None, "bayes_risk": None,
                "per_attack": {}, "reason": "no attack finished on this step"}
    # ties (e.g. every attack at 0%) go to the attack with the higher mean PSNR
    strongest = max(per_attack, key=lambda a: (per_attack[a]["success"], per_attack[a]["psnr"] or -math.inf))
    success = per_attack[strongest]["success"]
    return {"delta": delta, "strongest_attack": strongest, "success": success,
            "bayes_risk": 1.0 - success, "per_attack": per_attack}


def judge_step(by_attack: Dict[str, List[Dict[str, Any]]], images: int, thresholds: Thresholds) -> Dict[str, Any]:
    """Worst case and verdict of one step with ``images`` planned private batches."""
    wc = worst_case(by_attack, thresholds)
    missing = missing_evidence(by_attack, images)
    return {"worst_case": wc, "verdict": step_verdict(wc["per_image"], missing, attacks=len(by_attack))}


# --------------------------------------------------------------------------- the run
def overall_verdict(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The worst judged step (leaks > partially > incomplete > no recovered image); steps
    that are not judged are listed with their reasons, and never count as private."""
    judged = [s for s in steps if s["verdict"]["label"] in SEVERITY]
    not_judged = [{"step": s["step"], "reason": s["verdict"].get("reason", "")}
                  for s in steps if s["verdict"]["label"] not in SEVERITY]
    incomplete = [s["step"] for s in judged if s["verdict"]["label"] == INCOMPLETE]
    if not judged:
        why = "; ".join(f"step {n['step']}: {n['reason']}" for n in not_judged) or "no audited step"
        return {"label": NOT_JUDGED, "reason": why, "worst_step": None, "worst_psnr": None,
                "leaking_steps": [], "incomplete_steps": [], "not_judged_steps": not_judged}

    def rank(s):
        return SEVERITY[s["verdict"]["label"]], s["worst_case"].get("psnr_max") or -math.inf

    worst = max(judged, key=rank)
    label = worst["verdict"]["label"]
    return {"label": label, "reason": worst["verdict"].get("reason", ""), "worst_step": worst["step"],
            "worst_psnr": worst["worst_case"]["psnr"], "worst_image_psnr": worst["worst_case"].get("psnr_max"),
            "leaking_steps": [s["step"] for s in judged if s["verdict"]["label"] == RECOVERED],
            "incomplete_steps": incomplete, "not_judged_steps": not_judged}
