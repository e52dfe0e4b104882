"""Risk numbers of the report: per-step aggregation, the worst case over attacks, the Bayes
paper's empirical adversarial risk, and the leak verdict with stated thresholds."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

# metric name -> True when a higher value means more leakage
METRICS = {"psnr": True, "ssim": True, "lpips": False, "label_acc": True}

RECOVERED, PARTIAL, PRIVATE = "leaks", "partially", "no recovered image"
UNAVAILABLE = "unavailable"  # no attack produced a reconstruction to judge


@dataclass(frozen=True)
class Thresholds:
    """Per-image classification of the worst-case reconstruction.

    * recovered: PSNR >= ``leak_psnr`` dB or SSIM >= ``leak_ssim``;
    * not recovered (the Refiner paper's "private"): PSNR <= ``private_psnr`` dB and
      SSIM < ``private_ssim``;
    * partially recovered otherwise.
    """

    leak_psnr: float = 20.0
    leak_ssim: float = 0.5
    private_psnr: float = 15.0
    private_ssim: float = 0.5

    def classify(self, psnr: Optional[float], ssim: Optional[float]) -> str:
        if psnr is None and ssim is None:
            return PRIVATE
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
            "otherwise. A step 'leaks' if any image is recovered, is 'partially' if any is "
            "partially recovered, and has 'no recovered image' otherwise."
        )

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "rule": self.describe()}


def default_delta(numel: int, rmse: float = 0.1) -> float:
    """The l2 radius of the risk ball: ``rmse * sqrt(pixels)`` (RMSE 0.1 = PSNR 20 dB)."""
    return rmse * math.sqrt(numel)


def _mean(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def _best(values: Sequence[Optional[float]], higher: bool) -> Optional[float]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return max(vals) if higher else min(vals)


def summarize_attack(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Mean metrics of one attack at one step over its finished images."""
    ok = [r for r in records if r["status"] == "ok"]
    out: Dict[str, Any] = {
        "images_done": len(records),
        "images_ok": len(ok),
        "status": _attack_status(records),
    }
    for name in METRICS:
        out[name] = _mean(r["metrics"].get(name) for r in ok)
    out["psnr_max"] = _best([r["metrics"].get("psnr") for r in ok], True)
    unavailable = {k: v for r in ok for k, v in r.get("unavailable", {}).items()}
    if unavailable:
        out["unavailable"] = unavailable
    problems = [r for r in records if r["status"] != "ok"]
    if problems:
        out["problems"] = [{"image": r["image"], "status": r["status"], "reason": r.get("reason", "")}
                           for r in problems]
    return out


def _attack_status(records: List[Dict[str, Any]]) -> str:
    statuses = {r["status"] for r in records}
    if not records:
        return "pending"
    if statuses == {"ok"}:
        return "ok"
    if "ok" in statuses:
        return "partly failed"
    return "error" if "error" in statuses else "not applicable"


def worst_case(by_attack: Dict[str, List[Dict[str, Any]]], thresholds: Thresholds) -> Dict[str, Any]:
    """Per image, the most leaking attack for each metric; then means over images and the
    per-image verdicts."""
    images = sorted({r["image"] for recs in by_attack.values() for r in recs})
    per_image = []
    for image in images:
        rows = [r for recs in by_attack.values() for r in recs if r["image"] == image and r["status"] == "ok"]
        if not rows:  # every attack failed or did not apply: nothing to judge this image by
            continue
        entry: Dict[str, Any] = {"image": image}
        for name, higher in METRICS.items():
            entry[name] = _best([r["metrics"].get(name) for r in rows], higher)
        top = max(rows, key=lambda r: r["metrics"].get("psnr") or -math.inf, default=None)
        entry["best_attack"] = top["attack_id"] if top else None
        entry["class"] = thresholds.classify(entry["psnr"], entry["ssim"])
        per_image.append(entry)
    summary = {name: _mean(e[name] for e in per_image) for name in METRICS}
    summary["psnr_max"] = _best([e["psnr"] for e in per_image], True)
    summary["per_image"] = per_image
    return summary


def step_verdict(per_image: List[Dict[str, Any]]) -> Dict[str, Any]:
    counts = {c: sum(e["class"] == c for e in per_image) for c in (RECOVERED, PARTIAL, PRIVATE)}
    n = len(per_image)
    if not n:
        label = UNAVAILABLE
    elif counts[RECOVERED]:
        label = RECOVERED
    elif counts[PARTIAL]:
        label = PARTIAL
    else:
        label = PRIVATE
    return {"label": label, "recovered": counts[RECOVERED], "partially": counts[PARTIAL],
            "not_recovered": counts[PRIVATE], "images": n}


def empirical_risk(by_attack: Dict[str, List[Dict[str, Any]]], delta: float) -> Dict[str, Any]:
    """The Bayes paper's empirical adversarial risk at radius ``delta``.

    For each attack, the fraction of private images it reconstructs within l2 distance
    ``delta`` (``success``); the strongest attack is the one with the largest fraction, and
    ``bayes_risk`` = 1 - its success is the paper's R(f) = P(||x - f(g)||_2 > delta).
    """
    per_attack = {}
    for attack, recs in by_attack.items():
        dists = [d for r in recs if r["status"] == "ok" for d in (r["metrics"].get("l2") or [])]
        if dists:
            inside = sum(d <= delta for d in dists)
            psnr = _mean(r["metrics"].get("psnr") for r in recs if r["status"] == "ok")
            per_attack[attack] = {"within": inside, "images": len(dists), "success": inside / len(dists),
                                  "psnr": psnr}
    if not per_attack:
        return {"delta": delta, "strongest_attack": None, "success": None, "bayes_risk": None,
                "per_attack": {}, "reason": "no attack finished on this step"}
    # ties (e.g. every attack at 0%) go to the attack with the higher mean PSNR
    strongest = max(per_attack, key=lambda a: (per_attack[a]["success"], per_attack[a]["psnr"] or -math.inf))
    success = per_attack[strongest]["success"]
    return {"delta": delta, "strongest_attack": strongest, "success": success,
            "bayes_risk": 1.0 - success, "per_attack": per_attack}


def overall_verdict(steps: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The worst step's verdict (leaks > partially > no recovered image)."""
    order = {RECOVERED: 2, PARTIAL: 1, PRIVATE: 0}
    judged = [s for s in steps if s["verdict"]["images"]]
    if not judged:
        return {"label": UNAVAILABLE, "reason": "no attack produced a reconstruction"}
    worst = max(judged, key=lambda s: (order[s["verdict"]["label"]], s["worst_case"]["psnr"] or -math.inf))
    leaking = [s["step"] for s in judged if s["verdict"]["label"] == RECOVERED]
    return {"label": worst["verdict"]["label"], "worst_step": worst["step"],
            "worst_psnr": worst["worst_case"]["psnr"], "leaking_steps": leaking}
