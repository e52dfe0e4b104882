"""Reading a paper's claim against the audit's evidence: the per-cell numbers and the per-row
conclusion of ``bench/bench_papers.py`` (``docs/papers.md``).

A *cell* is a set of attacks of one audit at some of its steps, judged by the engine
(:func:`audit.report.risk.judge_step`): per private image its most leaking attack, the mean
PSNR / SSIM / LPIPS, how many images are *identified* (rank 1 among K candidates) and
*recovered* (the calibrated rule), with exact 95% intervals.

A row's conclusion is decided by the identification rate's interval, never by a PSNR
threshold:

* a claim that the defense **protects** fails when a cell identifies its private images
  above chance (the interval's lower end above 1/K); it holds when no cell does and the
  attacks ran at the paper's budget; below that budget it is inconclusive (a longer attack
  may still identify them);
* a claim that an attack **leaks** holds when its cell identifies above chance; when it does
  not, it fails at the paper's budget and is inconclusive below it;
* an **order** of attacks (the Bayes paper's Table 2) is compared pair by pair on the same
  images with an exact McNemar test on identification (two-sided 5%);
* a **utility** claim compares mean accuracies across seeds: a gap larger than the two
  standard deviations added is beyond the training noise.

Missing evidence (an attack that failed, or has not run) makes a cell inconclusive, never a
"holds".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.evidence import clopper_pearson
from audit.core.records import AttackResult
from audit.report.risk import judge_step, nulls_from_manifest
from audit.report.rule import LeakRule

HOLDS, FAILS, INCONCLUSIVE, NOT_RUN = "holds", "does not hold", "inconclusive at this budget", "not yet run"
LEVEL = 0.95


# --------------------------------------------------------------------------- one cell
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

    @property
    def complete(self) -> bool:
        return not self.missing and self.images > 0

    def identification_interval(self) -> Tuple[float, float]:
        return clopper_pearson(self.identified, self.images, LEVEL)

    def recovered_interval(self) -> Tuple[float, float]:
        return clopper_pearson(self.recovered, self.images, LEVEL)

    @property
    def chance(self) -> Optional[float]:
        return 1.0 / self.candidates if self.candidates else None

    def above_chance(self) -> bool:
        """The identification rate's interval lies above chance (1/K)."""
        return self.images > 0 and self.chance is not None and self.identification_interval()[0] > self.chance

    def to_dict(self) -> Dict[str, Any]:
        return {"attacks": self.attacks, "steps": self.steps, "images": self.images, "identified": self.identified,
                "recovered": self.recovered, "candidates": self.candidates, "psnr": self.psnr, "ssim": self.ssim,
                "lpips": self.lpips, "strongest": self.strongest, "missing": self.missing,
                "per_step_psnr": {str(k): v for k, v in self.per_step_psnr.items()},
                "per_image_identified": {f"{s}/{b}/{j}": v for (s, b, j), v in self.per_image_identified.items()}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CellEvidence":
        out = cls(list(d["attacks"]), list(d["steps"]), d["images"], d["identified"], d["recovered"],
                  d.get("candidates"), d.get("psnr"), d.get("ssim"), d.get("lpips"), d.get("strongest"),
                  list(d.get("missing") or []))
        out.per_step_psnr = {int(k): v for k, v in (d.get("per_step_psnr") or {}).items()}
        out.per_image_identified = {tuple(int(p) for p in k.split("/")): bool(v)
                                    for k, v in (d.get("per_image_identified") or {}).items()}
        return out


def _mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


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
        for e in done:
            hit = e["rank"] is not None and e["rank"] <= rule.identify_rank
            out.identified += hit
            out.per_image_identified[(step, e["image"], e["index"])] = hit
            out.candidates = e.get("candidates") or out.candidates
            if e.get("best_attack"):
                best_count[e["best_attack"]] = best_count.get(e["best_attack"], 0) + 1
            for name in metric:
                metric[name].append(e[name])
        out.per_step_psnr[step] = _mean([e["psnr"] for e in done])
    out.psnr, out.ssim, out.lpips = (_mean(metric[n]) for n in ("psnr", "ssim", "lpips"))
    if best_count:
        out.strongest = max(best_count, key=lambda a: (best_count[a], -list(attacks).index(a)))
    return out


# --------------------------------------------------------------------------- conclusions
@dataclass
class Conclusion:
    outcome: str  # HOLDS, FAILS, INCONCLUSIVE, NOT_RUN
    detail: str = ""

    def text(self) -> str:
        return f"the claim {self.outcome}" + (f" ({self.detail})" if self.detail else "") \
            if self.outcome in (HOLDS, FAILS) else self.outcome + (f" ({self.detail})" if self.detail else "")


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def identification_text(c: CellEvidence) -> str:
    lo, hi = c.identification_interval()
    k = f"K={c.candidates}" if c.candidates else "K=?"
    return f"{c.identified} of {c.images} identified among {k}, 95% CI {_pct(lo)}-{_pct(hi)}"


def recovered_text(c: CellEvidence) -> str:
    lo, hi = c.recovered_interval()
    return f"{c.recovered} of {c.images} recovered, CI {_pct(lo)}-{_pct(hi)}"


def conclude_protects(cells: Sequence[Optional[CellEvidence]], at_paper_budget: bool) -> Conclusion:
    """The defense protects against every attack of ``cells``."""
    ran = [c for c in cells if c is not None]
    if not ran:
        return Conclusion(NOT_RUN)
    breaking = [c for c in ran if c.above_chance()]
    if breaking:
        worst = max(breaking, key=lambda c: (c.identification_interval()[0], c.identified))
        return Conclusion(FAILS, f"{recovered_text(worst)}; {identification_text(worst)}, chance "
                                 f"{_pct(worst.chance)}; {worst.strongest}")
    missing = [m for c in ran for m in c.missing]
    if len(ran) < len(cells) or missing:
        why = "; ".join(missing[:2]) if missing else "some cells have not run"
        return Conclusion(INCONCLUSIVE, f"evidence missing: {why}")
    best = max(ran, key=lambda c: c.identified)
    if not at_paper_budget:
        return Conclusion(INCONCLUSIVE, f"no cell above chance, at most {identification_text(best)}; the attacks "
                                        "ran below the paper's budget")
    return Conclusion(HOLDS, f"no cell above chance; at most {identification_text(best)}")


def conclude_leaks(cell: Optional[CellEvidence], at_paper_budget: bool,
                   others: Sequence[Tuple[str, Optional[CellEvidence]]] = ()) -> Conclusion:
    """The attack of ``cell`` identifies the private images. Where it does not, a leak shown by
    another of the row's cells (``others``: (name, cell), e.g. the planner's) confirms the
    claim that the defense leaks, and the conclusion names that cell."""
    if cell is None:
        return Conclusion(NOT_RUN)
    if cell.above_chance():
        return Conclusion(HOLDS, f"{recovered_text(cell)}; {identification_text(cell)}")
    for name, other in others:
        if other is not None and other.above_chance():
            who = f"{name} {other.strongest}" if other.strongest else name
            return Conclusion(HOLDS, f"by {who}, {recovered_text(other)}; {identification_text(other)}; "
                                     f"the paper's attack: {identification_text(cell)}")
    if cell.missing:
        return Conclusion(INCONCLUSIVE, f"evidence missing: {'; '.join(cell.missing[:2])}")
    if not at_paper_budget:
        return Conclusion(INCONCLUSIVE, f"{identification_text(cell)}, not above chance, below the paper's budget")
    return Conclusion(FAILS, f"{recovered_text(cell)}; {identification_text(cell)}, not above chance")


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value for ``b`` and ``c`` discordant pairs."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(a: CellEvidence, b: CellEvidence) -> Tuple[int, int]:
    """Images identified by ``a`` and not ``b``, and by ``b`` and not ``a`` (common images only)."""
    keys = set(a.per_image_identified) & set(b.per_image_identified)
    only_a = sum(a.per_image_identified[k] and not b.per_image_identified[k] for k in keys)
    only_b = sum(b.per_image_identified[k] and not a.per_image_identified[k] for k in keys)
    return only_a, only_b


def conclude_order(first: Optional[CellEvidence], others: Dict[str, Optional[CellEvidence]],
                   paper_gaps: Dict[str, float], tie_db: float = 1.0, alpha: float = 0.05) -> Conclusion:
    """The paper's claim on ``first`` against each of ``others``: better where the paper's gap
    (dB) is at least ``tie_db``, no different otherwise; each pair by an exact McNemar test on
    identification over the same images."""
    if first is None or any(c is None for c in others.values()):
        return Conclusion(NOT_RUN if first is None else INCONCLUSIVE, "" if first is None else "some cells have not run")
    parts, outcomes = [], []
    for name, other in others.items():
        wins, losses = paired(first, other)
        p = mcnemar_exact(wins, losses)
        claim_better = paper_gaps.get(name, 0.0) >= tie_db
        if p < alpha and losses > wins:
            outcomes.append(FAILS)
        elif p < alpha and wins > losses:
            outcomes.append(HOLDS if claim_better else FAILS)
        elif claim_better or not (first.identified or other.identified):
            outcomes.append(INCONCLUSIVE)  # nothing identified: the order is not resolved
        else:
            outcomes.append(HOLDS)
        parts.append(f"vs {name}: {wins}/{losses} discordant, p={p:.2g}")
    if first.missing or any(o.missing for o in others.values()):
        return Conclusion(INCONCLUSIVE, "evidence missing; " + "; ".join(parts))
    outcome = FAILS if FAILS in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else HOLDS
    return Conclusion(outcome, "; ".join(parts))


def conclude_utility(utility: Optional[Dict[str, Any]], claim: str, ratio: Optional[float] = None) -> Conclusion:
    """``claim``: ``"not-worse"`` (defended accuracy not below undefended beyond the noise) or
    ``"ratio"`` (defended / undefended at least ``ratio``, beyond the noise)."""
    if not utility or utility.get("unavailable") or not utility.get("defended") or not utility.get("undefended"):
        return Conclusion(NOT_RUN, (utility or {}).get("unavailable", ""))
    d, u = utility["defended"], utility["undefended"]
    if d.get("mean") is None or u.get("mean") is None:
        return Conclusion(INCONCLUSIVE, "no finished training run")
    if d.get("std") is None or u.get("std") is None:
        return Conclusion(INCONCLUSIVE, "one seed: no spread to judge the gap against")
    noise = d["std"] + u["std"]
    target = u["mean"] if claim == "not-worse" else (ratio or 1.0) * u["mean"]
    detail = (f"defended {100 * d['mean']:.1f}% ± {100 * d['std']:.1f}, undefended {100 * u['mean']:.1f}% ± "
              f"{100 * u['std']:.1f} ({len(d.get('runs') or [])} seeds)")
    if d["mean"] < target - noise:
        return Conclusion(FAILS, detail + ", below beyond the noise")
    if d["mean"] >= target:
        return Conclusion(HOLDS, detail)
    return Conclusion(HOLDS, detail + ", within the noise")
