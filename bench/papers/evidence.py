"""One cell's evidence (:class:`CellEvidence`): a set of attacks of one audit at some of its
steps, judged by the engine (:func:`audit.report.risk.judge_step`): per private image its most
leaking attack, mean PSNR / SSIM / LPIPS, images *identified* (rank 1 among K) and *recovered*,
with exact 95% intervals; its *chance* is the null's best of ``m`` (:func:`best_of_chance`);
beside it the positive control's recovery on the undefended upload."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.evidence import clopper_pearson
from audit.core.evidence import mcnemar_exact as mcnemar_one_sided
from audit.core.records import AttackResult, ImageClass
from audit.report.risk import judge_step, nulls_from_manifest
from audit.report.rule import LeakRule

LEVEL = 0.95
NO_CONTROL = "no positive control stored: rerun the row"


@dataclass
class CellEvidence:
    """The evidence of one cell (a set of attacks at a set of steps), over its private images."""

    attacks: List[str]
    steps: List[int]
    images: int = 0  # judged private images (over the cell's steps)
    identified: int = 0
    recovered: int = 0
    candidates: Optional[int] = None  # K
    psnr: Optional[float] = None
    ssim: Optional[float] = None
    lpips: Optional[float] = None
    strongest: Optional[str] = None  # the attack most often the most leaking one
    missing: List[str] = field(default_factory=list)  # why evidence is missing
    per_step_psnr: Dict[int, Optional[float]] = field(default_factory=dict)
    per_image_identified: Dict[Tuple[int, int, int], bool] = field(default_factory=dict)  # (step, batch, index)
    per_image_psnr: Dict[Tuple[int, int, int], float] = field(default_factory=dict)
    per_step_recovered: Dict[int, int] = field(default_factory=dict)
    members: int = 1  # m: the (attack, reference) pairs the cell's per-image maximum runs over
    null_chance: Optional[float] = None  # the null's best-of-m identification rate
    per_image_recovered: Dict[Tuple[int, int, int], bool] = field(default_factory=dict)
    #: the positive control: per image, recovered on the undefended upload (None: not stored)
    control: Optional[Dict[Tuple[int, int, int], bool]] = None
    control_missing: str = ""  # why the stored control cannot be judged ('' where it can)
    #: the leak rule on the cell's own null items, leave-one-out: [recovered, items] (None: not stored)
    false_positives: Optional[List[int]] = None

    @property
    def complete(self) -> bool:
        return not self.missing and self.images > 0

    def identification_interval(self) -> Tuple[float, float]:
        return clopper_pearson(self.identified, self.images, LEVEL)

    def recovered_interval(self) -> Tuple[float, float]:
        return clopper_pearson(self.recovered, self.images, LEVEL)

    @property
    def chance(self) -> Optional[float]:
        """The identification rate of the cell's maximum on the null (:func:`best_of_chance`);
        1/K where no null was stored."""
        if self.null_chance is not None:
            return self.null_chance
        return 1.0 / self.candidates if self.candidates else None

    def above_chance(self) -> bool:
        """The identification rate's interval lies above the cell's chance."""
        return self.images > 0 and self.chance is not None and self.identification_interval()[0] > self.chance

    def at_steps(self, steps: Sequence[int]) -> "CellEvidence":
        """The same evidence restricted to ``steps`` (a claim about some of the cell's steps is
        judged on those alone): counts, PSNR and what is missing there; SSIM and LPIPS, stored
        pooled only, are left out."""
        keep = set(steps) & set(self.steps)
        if not keep <= set(self.per_step_recovered):
            raise ValueError(f"the cell stores no per-step recovered counts for steps {sorted(keep)}: "
                             "rerun the cell (python -m bench.papers --rows <row>)")
        out = CellEvidence(list(self.attacks), sorted(keep), candidates=self.candidates, strongest=self.strongest,
                           members=self.members, null_chance=self.null_chance)
        out.per_image_identified = {k: v for k, v in self.per_image_identified.items() if k[0] in keep}
        out.per_image_psnr = {k: v for k, v in self.per_image_psnr.items() if k[0] in keep}
        out.per_step_psnr = {s: v for s, v in self.per_step_psnr.items() if s in keep}
        out.per_step_recovered = {s: v for s, v in self.per_step_recovered.items() if s in keep}
        out.per_image_recovered = {k: v for k, v in self.per_image_recovered.items() if k[0] in keep}
        out.control = None if self.control is None else {k: v for k, v in self.control.items() if k[0] in keep}
        out.control_missing = self.control_missing
        out.false_positives = self.false_positives
        out.images = len(out.per_image_identified)
        out.identified = sum(out.per_image_identified.values())
        out.recovered = sum(out.per_step_recovered.values())
        out.missing = [m for m in self.missing if _missing_step(m) in keep | {None}]
        out.psnr = _mean(list(out.per_image_psnr.values()))
        return out

    @classmethod
    def joined(cls, parts: Sequence["CellEvidence"]) -> "CellEvidence":
        """One cell's evidence from its evidence at disjoint steps (each step kept as it completed):
        counts and per-image results side by side; chance and pooled SSIM / LPIPS averaged over the
        judged images (the null items are per image, the same at every step)."""
        if not parts:
            raise ValueError("no evidence to join")
        steps = [s for p in parts for s in p.steps]
        if len(set(steps)) != len(steps):
            raise ValueError(f"evidence to join shares steps: {sorted(steps)}")
        out = cls(list(parts[0].attacks), sorted(steps), candidates=next((p.candidates for p in parts if p.candidates), None),
                  members=max(p.members for p in parts), false_positives=parts[0].false_positives)
        for p in parts:
            out.per_step_psnr.update(p.per_step_psnr)
            out.per_step_recovered.update(p.per_step_recovered)
            out.per_image_identified.update(p.per_image_identified)
            out.per_image_psnr.update(p.per_image_psnr)
            out.per_image_recovered.update(p.per_image_recovered)
            out.missing.extend(p.missing)
        controls = [p.control for p in parts]
        out.control = None if any(c is None for c in controls) else {k: v for c in controls for k, v in c.items()}
        out.control_missing = "; ".join(p.control_missing for p in parts if p.control_missing)
        out.images = sum(p.images for p in parts)
        out.identified = sum(p.identified for p in parts)
        out.recovered = sum(p.recovered for p in parts)
        out.psnr = _mean(list(out.per_image_psnr.values()))

        def weighted(values: List[Tuple[Optional[float], int]]) -> Optional[float]:
            known = [(v, n) for v, n in values if v is not None and n]
            return sum(v * n for v, n in known) / sum(n for _, n in known) if known else None

        out.ssim = weighted([(p.ssim, p.images) for p in parts])
        out.lpips = weighted([(p.lpips, p.images) for p in parts])
        out.null_chance = weighted([(p.null_chance, p.images) for p in parts])
        strongest = {p.strongest for p in parts}
        out.strongest = strongest.pop() if len(strongest) == 1 else None
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {"attacks": self.attacks, "steps": self.steps, "images": self.images, "identified": self.identified,
                "recovered": self.recovered, "candidates": self.candidates, "psnr": self.psnr, "ssim": self.ssim,
                "lpips": self.lpips, "strongest": self.strongest, "missing": self.missing,
                "per_step_psnr": {str(k): v for k, v in self.per_step_psnr.items()},
                "per_image_identified": {f"{s}/{b}/{j}": v for (s, b, j), v in self.per_image_identified.items()},
                "per_image_psnr": {f"{s}/{b}/{j}": v for (s, b, j), v in self.per_image_psnr.items()},
                "per_step_recovered": {str(k): v for k, v in self.per_step_recovered.items()},
                "members": self.members, "null_chance": self.null_chance,
                "per_image_recovered": _keyed_out(self.per_image_recovered),
                "control": None if self.control is None else _keyed_out(self.control),
                "control_missing": self.control_missing, "false_positives": self.false_positives}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CellEvidence":
        out = cls(list(d["attacks"]), list(d["steps"]), d["images"], d["identified"], d["recovered"],
                  d.get("candidates"), d.get("psnr"), d.get("ssim"), d.get("lpips"), d.get("strongest"),
                  list(d.get("missing") or []))
        out.per_step_psnr = {int(k): v for k, v in (d.get("per_step_psnr") or {}).items()}
        out.per_image_identified = {tuple(int(p) for p in k.split("/")): bool(v)
                                    for k, v in (d.get("per_image_identified") or {}).items()}
        out.per_image_psnr = {tuple(int(p) for p in k.split("/")): float(v)
                              for k, v in (d.get("per_image_psnr") or {}).items() if v is not None}
        out.per_step_recovered = {int(k): int(v) for k, v in (d.get("per_step_recovered") or {}).items()}
        out.members = int(d.get("members") or 1)
        out.null_chance = d.get("null_chance")
        out.per_image_recovered = _keyed_in(d.get("per_image_recovered") or {})
        out.control = None if d.get("control") is None else _keyed_in(d["control"])
        out.control_missing = d.get("control_missing") or ""
        out.false_positives = d.get("false_positives")
        return out

    def control_effect(self) -> Optional["ControlEffect"]:
        """The paired comparison with the positive control (None: no control stored)."""
        if self.control is None:
            return None
        both = sorted(set(self.control) & set(self.per_image_recovered))
        stopped = sum(self.control[k] and not self.per_image_recovered[k] for k in both)
        through = sum(self.per_image_recovered[k] and not self.control[k] for k in both)
        return ControlEffect(len(both), sum(self.control[k] for k in both), stopped, through,
                             mcnemar_one_sided(stopped, through))

    def power_text(self, short: bool = False) -> str:
        """The control's recovery, as the page shows it beside a verdict (``short``: ``3/8``, for
        the one-screen table)."""
        if self.control is None:
            return "none stored" if short else "no control stored"
        recovered, images = sum(self.control.values()), len(self.control)  # the control's own images
        return f"{recovered}/{images}" if short else f"{recovered} of {images} without the defense"


@dataclass(frozen=True)
class ControlEffect:
    """A cell against its positive control on the images both judged: the control's recoveries,
    those the defense stopped and let through, and the one-sided exact McNemar p-value."""

    images: int
    control_recovered: int
    stopped: int
    let_through: int
    p_value: float

    def text(self) -> str:
        return (f"power: {self.control_recovered} of {self.images} recovered without the defense; the defense stops "
                f"{self.stopped} of {self.control_recovered} and lets {self.let_through} through, exact McNemar "
                f"p={self.p_value:.2g}")


def _keyed_out(values: Dict[Tuple[int, int, int], bool]) -> Dict[str, bool]:
    return {f"{s}/{b}/{j}": bool(v) for (s, b, j), v in values.items()}


def _keyed_in(values: Dict[str, Any]) -> Dict[Tuple[int, int, int], bool]:
    return {tuple(int(p) for p in k.split("/")): bool(v) for k, v in values.items()}


def control_from_report(steps: Sequence[Dict[str, Any]], keep: Sequence[int]) -> Tuple[Optional[Dict], str]:
    """The positive control of a report's ``steps`` (``audit.run``'s ``steps[i].control``) at the
    steps ``keep``: per image recovered, and why it cannot be judged ('' where it can); None
    where the report stored no control."""
    found: Dict[Tuple[int, int, int], bool] = {}
    why = []
    entries = [s for s in steps if int(s["step"]) in set(keep)]
    if not entries or any(not s.get("control") for s in entries):
        return None, ""
    for s in entries:
        control = s["control"]
        if not control.get("available"):
            why.append(f"step {s['step']}: {control.get('reason', 'control unavailable')}")
        for e in control.get("per_image") or []:
            found[(int(s["step"]), int(e["image"]), int(e.get("index", 0)))] = bool(e["recovered"])
    return found, "; ".join(why)


def _missing_step(why: str) -> Optional[int]:
    """The step a ``missing`` entry names ("step 50: ..."), None if it names none."""
    found = re.match(r"step (\d+):", why)
    return int(found.group(1)) if found else None


def _image_entries(record: AttackResult) -> List[Dict[str, Any]]:
    """The record's per-image metric entries (each with its ``evidence`` list)."""
    from audit.report.risk import image_metrics

    try:
        return list(image_metrics(record))
    except Exception:  # a failed record has no metrics
        return []


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def best_of_chance(ranks: Sequence[int], m: int, identify_rank: int = 1) -> float:
    """The probability that the best of ``m`` distinct null items of one image (each ranked
    among the candidates, ``ranks``) is ranked within ``identify_rank``: one minus the chance
    that a draw of ``m`` of the ``n`` items holds none of the ``r`` that are."""
    n, r = len(ranks), sum(1 for k in ranks if k is not None and k <= identify_rank)
    m = max(1, min(m, n))
    return 1.0 - math.comb(n - r, m) / math.comb(n, m)


def cell_evidence(manifest: Dict[str, Any], records: Sequence[Dict[str, Any]], attacks: Sequence[str],
                  steps: Sequence[int], rule: Optional[LeakRule] = None) -> CellEvidence:
    """The evidence of ``attacks`` at ``steps`` of a stored audit (its manifest and records),
    judged per step by the engine's rule and pooled over the steps."""
    rule = rule or LeakRule.from_dict(manifest.get("thresholds"))
    nulls = nulls_from_manifest(manifest)
    images = int(manifest["images"])
    recs = [AttackResult.from_dict(r) for r in records]
    out = CellEvidence(list(attacks), list(steps))
    metric = {"psnr": [], "ssim": [], "lpips": []}
    best_count: Dict[str, int] = {}
    references = max([len(e.get("evidence") or [1]) for r in recs if r.attack_id in attacks
                                                            for e in _image_entries(r)] or [1])
    out.members = max(1, len(attacks)) * references
    chances = []
    for step in steps:
        by_attack = {a: [r for r in recs if r.step == step and r.attack_id == a and r.image < images]
                     for a in attacks}
        judged = judge_step(by_attack, images, rule, nulls)
        verdict, wc = judged["verdict"], judged["worst_case"]
        for m in verdict["failed_attacks"]:
            out.missing.append(f"step {step}: {m['attack']} {m['why']} on {len(m['images'])} batch(es)")
        done = [e for e in wc["per_image"] if e["image_class"] is not None]
        out.images += len(done)
        out.recovered += verdict["recovered"]
        out.per_step_recovered[step] = int(verdict["recovered"])
        for e in done:
            out.per_image_recovered[(step, e["image"], e["index"])] = e["image_class"] == ImageClass.RECOVERED.value
            hit = e["rank"] is not None and e["rank"] <= rule.identify_rank
            out.identified += hit
            out.per_image_identified[(step, e["image"], e["index"])] = hit
            out.candidates = e.get("candidates") or out.candidates
            if e.get("best_attack"):
                best_count[e["best_attack"]] = best_count.get(e["best_attack"], 0) + 1
            for name in metric:
                metric[name].append(e[name])
            if e["psnr"] is not None and math.isfinite(e["psnr"]):
                out.per_image_psnr[(step, e["image"], e["index"])] = float(e["psnr"])
            null = nulls.get((e["image"], e["index"]))
            if null is not None and null.ranks:
                chances.append(best_of_chance(null.ranks, out.members, rule.identify_rank))
        out.per_step_psnr[step] = _mean([e["psnr"] for e in done])
    out.psnr, out.ssim, out.lpips = (_mean(metric[n]) for n in ("psnr", "ssim", "lpips"))
    out.null_chance = _mean(chances)
    if nulls:
        found, _ = rule.false_positives(nulls.values())
        out.false_positives = [found.k, found.n]
    if best_count:
        out.strongest = max(best_count, key=lambda a: (best_count[a], -list(attacks).index(a)))
    return out
