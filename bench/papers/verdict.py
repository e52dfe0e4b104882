"""Reading a paper's claim against the audit's evidence: the per-cell numbers and the per-row
conclusion of the papers bench (``docs/papers.md``).

A *cell* is a set of attacks of one audit at some of its steps, judged by the engine
(:func:`audit.report.risk.judge_step`): per private image its most leaking attack, mean
PSNR / SSIM / LPIPS, images *identified* (rank 1 among K) and *recovered*, with exact 95%
intervals; its *chance* is the null's best of ``m`` (:func:`best_of_chance`). Conclusions:

* a claim that the defense **protects** fails when a cell identifies its private images
  above chance (the interval's lower end above the cell's chance); it holds only where every
  cell's *positive control* (the same attacks' base forms, budget and images on the undefended
  upload) recovers images and the defended cell recovers significantly fewer (one-sided exact
  McNemar on the per-image pairs, 5%), at the paper's budget; a cell with no stored control,
  or whose control recovers nothing, is inconclusive, never "holds";
* a claim that an attack **leaks** holds when its cell identifies above chance; when it does
  not, it fails only at the paper's budget and where the control recovers images;
* an **order** is tested pair by pair on the same images (:func:`pair_test`; a measured tie
  does not hold), only where every cell's control recovers (:func:`conclude_chain`); a claim
  over several steps is judged step by step (:func:`conclude_steps`);
* a **utility** claim (defended accuracy at least the undefended, or at least a ratio of it)
  is judged on the 95% Welch interval of ``defended - ratio x undefended`` over the training
  seeds, against a tolerance of ``UTILITY_TOLERANCE``: it holds when the whole interval lies
  above ``-tolerance``, does not hold when it lies below, and is inconclusive otherwise.

Missing evidence (an attack that failed, or has not run) makes a cell inconclusive.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.evidence import mean_difference
from audit.core.records import AccuracySpread
from bench.papers.evidence import LEVEL, NO_CONTROL, CellEvidence

HOLDS, FAILS, INCONCLUSIVE, NOT_RUN = "holds", "does not hold", "inconclusive", "not yet run"
#: a claim about several steps, some of whose evidence is still to come: its judged steps so far
SO_FAR = "so far"
#: the one-sided level of the paired test that the defense recovers fewer images than its control
CONTROL_ALPHA = 0.05
BELOW_BUDGET = "the attacks ran below the paper's budget"


@dataclass
class Conclusion:
    outcome: str  # HOLDS, FAILS, INCONCLUSIVE, NOT_RUN
    detail: str = ""
    below_budget: bool = False  # inconclusive because the attacks ran below the paper's budget
    decided: bool = False  # a leak shown: no evidence still to come (another cell) can change it

    def text(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        if self.outcome in (HOLDS, FAILS):
            return f"the claim {self.outcome}{detail}"
        if self.outcome == INCONCLUSIVE and self.below_budget:
            return f"{INCONCLUSIVE} at this budget{detail}"
        return self.outcome + detail


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def interval_text(lo: float, hi: float) -> str:
    """An interval in percent, its ends rounded outwards to 0.1 so that a lower end below a
    chance level never prints above it."""
    return f"{math.floor(1000 * lo) / 10:g}%-{math.ceil(1000 * hi) / 10:g}%"


#: why a best-of-m cell's chance is a bound: what each cell of the page says beside it
BOUND_WHY = ("a hypergeometric bound, which errs high: running each attack on null uploads would cost the "
             "cell again")


def identification_text(c: CellEvidence) -> str:
    lo, hi = c.identification_interval()
    k = f"K={c.candidates}" if c.candidates else "K=?"
    chance = ""
    if c.chance is not None:
        how = f" (best of {c.members}, {BOUND_WHY})" if c.members > 1 else ""
        chance = f", chance {100 * c.chance:.1f}%{how}, {'above' if c.above_chance() else 'not above'} chance"
    return f"{c.identified} of {c.images} identified among {k}, 95% CI {interval_text(lo, hi)}{chance}"


def recovered_text(c: CellEvidence) -> str:
    lo, hi = c.recovered_interval()
    return f"{c.recovered} of {c.images} recovered, CI {interval_text(lo, hi)}"


def control_verdict(cells: Sequence[CellEvidence]) -> Optional[str]:
    """Why the cells' positive controls cannot show that the defense stops their attacks (None:
    every control recovers images and every defended cell recovers significantly fewer), cell by
    cell, each named by its attacks."""
    powerless, whys = [], []
    for c in cells:
        effect, who = c.control_effect(), ", ".join(c.attacks)
        if effect is None:
            return NO_CONTROL
        if c.control_missing:
            return f"positive control incomplete: {c.control_missing}"
        if not c.images and c.control:  # the attack applied to no defended upload: nothing to pair
            whys.append(f"{who} applies to none of the defended uploads (its control recovers "
                        f"{c.power_text()})")
        elif not effect.control_recovered:
            powerless.append((who, effect.images))
        elif effect.p_value >= CONTROL_ALPHA:
            whys.append(f"{who}: {effect.text()}: not significant")
    if powerless:
        images = " and ".join(sorted({str(n) for _, n in powerless}))
        whys.insert(0, f"attack power: the control of {' and of '.join(w for w, _ in powerless)} recovers none of "
                       f"{images} images without the defense (these attacks at this budget cannot tell the defense "
                       "from their own limits)")
    return "; ".join(whys) or None


def conclude_protects(cells: Sequence[Optional[CellEvidence]], at_paper_budget: bool,
                      budget_note: str = BELOW_BUDGET) -> Conclusion:
    """The defense protects against every attack of ``cells``: no cell above chance, and every
    cell's control recovers images that the defense significantly stops (:func:`control_verdict`);
    ``budget_note``: why the attacks are not at the paper's budget, where they are not."""
    ran = [c for c in cells if c is not None]
    if not ran:
        return Conclusion(NOT_RUN)
    breaking = [c for c in ran if c.above_chance()]
    if breaking:
        worst = max(breaking, key=lambda c: (c.identification_interval()[0], c.identified))
        return Conclusion(FAILS, f"{recovered_text(worst)}; {identification_text(worst)}; {worst.strongest}",
                          decided=True)
    missing = [m for c in ran for m in c.missing]
    if len(ran) < len(cells) or missing:
        why = "; ".join(missing[:2]) if missing else "some cells have not run"
        return Conclusion(INCONCLUSIVE, f"evidence missing: {why}")
    best = max(ran, key=lambda c: c.identified)
    why = control_verdict(ran)
    if why is not None:
        return Conclusion(INCONCLUSIVE, f"{why}; no cell above chance, at most {identification_text(best)}")
    effects = "; ".join(c.control_effect().text() for c in ran)
    if not at_paper_budget:
        return Conclusion(INCONCLUSIVE, f"{effects}; at most {identification_text(best)}; {budget_note}",
                          below_budget=True)
    return Conclusion(HOLDS, f"{effects}; at most {identification_text(best)}")


def conclude_leaks(cell: Optional[CellEvidence], at_paper_budget: bool,
                   others: Sequence[Tuple[str, Optional[CellEvidence]]] = (),
                   budget_note: str = BELOW_BUDGET) -> Conclusion:
    """The attack of ``cell`` identifies the private images. Where it does not, a leak shown by
    another of the row's cells (``others``: (name, cell), e.g. the planner's) confirms the
    claim that the defense leaks, and the conclusion names that cell. It does not hold only at
    the paper's budget and where the cell's control recovers images (else inconclusive). A leak
    shown by another cell decides before ``cell`` has run: no outcome of it can undo a leak."""
    if cell is not None and cell.above_chance():
        return Conclusion(HOLDS, f"{recovered_text(cell)}; {identification_text(cell)}", decided=True)
    for name, other in others:
        if other is not None and other.above_chance():
            who = f"{name} {other.strongest}" if other.strongest else name
            paper = identification_text(cell) if cell is not None else "not run yet"
            return Conclusion(HOLDS, f"by {who}, {recovered_text(other)}; {identification_text(other)}; "
                                     f"the paper's attack: {paper}", decided=True)
    if cell is None:
        return Conclusion(NOT_RUN)
    if cell.missing:
        return Conclusion(INCONCLUSIVE, f"evidence missing: {'; '.join(cell.missing[:2])}")
    if not at_paper_budget:
        return Conclusion(INCONCLUSIVE, f"{identification_text(cell)}; {budget_note}", below_budget=True)
    effect = cell.control_effect()
    if effect is None or not effect.control_recovered or cell.control_missing:
        why = NO_CONTROL if effect is None else cell.control_missing or "attack power: the control recovers nothing"
        return Conclusion(INCONCLUSIVE, f"{why}; {identification_text(cell)}")
    return Conclusion(FAILS, f"{recovered_text(cell)}; {identification_text(cell)}; {effect.text()}")


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


def paired_psnr(a: CellEvidence, b: CellEvidence) -> List[float]:
    """Per-image PSNR differences ``a - b`` over the images both cells scored."""
    keys = sorted(set(a.per_image_psnr) & set(b.per_image_psnr))
    return [a.per_image_psnr[k] - b.per_image_psnr[k] for k in keys]


def wilcoxon_p(diffs: Sequence[float]) -> float:
    """Two-sided Wilcoxon signed-rank p-value of paired differences (1 without a non-zero one)."""
    from scipy.stats import wilcoxon

    if not any(d != 0 for d in diffs):
        return 1.0
    return float(wilcoxon(diffs, zero_method="wilcox", alternative="two-sided").pvalue)


def wilcoxon_power(n: int, sd: float, shift: float, alpha: float = 0.05) -> float:
    """Power of the two-sided signed-rank test at ``n`` pairs to detect a mean shift ``shift``
    with paired differences of spread ``sd``: the paired t-test's normal approximation at the
    Wilcoxon test's asymptotic relative efficiency under normality (3/pi)."""
    from scipy.stats import norm

    if n < 2 or shift == 0:
        return alpha if shift == 0 else 0.0
    if sd <= 0:
        return 1.0
    z = abs(shift) / (sd / math.sqrt(n * 3 / math.pi))
    crit = norm.ppf(1 - alpha / 2)
    return float(norm.cdf(z - crit) + norm.cdf(-z - crit))


def mcnemar_floor(discordant: int) -> float:
    """The smallest p-value an exact McNemar test can reach with ``discordant`` pairs."""
    return min(1.0, 2 * 0.5 ** discordant) if discordant else 1.0


def _sd(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


#: the kinds of a pairwise claim on per-image PSNR: ``better`` (significantly higher), ``tie``
#: (the mean difference's 95% interval within the tie margin) and ``not-worse`` (its lower end
#: above minus the margin: "performs best" read as no attack ahead by more than the margin)
PAIR_KINDS = ("better", "tie", "not-worse")


def pair_test(first: CellEvidence, other: CellEvidence, kind: str, gap: float, tie_db: float = 1.0,
              alpha: float = 0.05) -> Tuple[str, str]:
    """One pairwise claim of ``first`` over ``other`` (``kind`` of :data:`PAIR_KINDS`; ``gap``:
    the paper's dB), on the images both scored: a Wilcoxon signed-rank test on per-image PSNR
    decides, an exact McNemar test on identification that contradicts it significantly makes
    it not hold. Returns the outcome and its text, with each test's power."""
    from scipy.stats import t as student

    if kind not in PAIR_KINDS:
        raise ValueError(f"unknown pairwise claim {kind!r}: one of {', '.join(PAIR_KINDS)}")
    diffs = paired_psnr(first, other)
    n = len(diffs)
    mean, sd = (sum(diffs) / n if n else 0.0), _sd(diffs)
    p_w = wilcoxon_p(diffs) if n else 1.0
    half = student.ppf(1 - alpha / 2, n - 1) * sd / math.sqrt(n) if n > 1 else math.inf
    power = wilcoxon_power(n, sd, gap if kind == "better" else tie_db, alpha)
    wins, losses = paired(first, other)
    p_m = mcnemar_exact(wins, losses)
    contradicts_id = p_m < alpha and (losses > wins or kind == "tie")
    if kind == "better":  # a tie measured (the interval within the tie margin) is not better
        outcome = (FAILS if (p_w < alpha and mean < 0) or contradicts_id else
                   HOLDS if p_w < alpha and mean > 0 else
                   FAILS if gap >= tie_db and abs(mean) + half <= tie_db else INCONCLUSIVE)
    elif kind == "tie":
        outcome = (FAILS if (p_w < alpha and abs(mean) > tie_db) or contradicts_id else
                   HOLDS if abs(mean) + half <= tie_db else INCONCLUSIVE)
    else:
        outcome = (FAILS if (p_w < alpha and mean < -tie_db) or contradicts_id else
                   HOLDS if mean - half > -tie_db else INCONCLUSIVE)
    text = (f"{kind}: PSNR {mean:+.2f} dB (95% CI {mean - half:+.2f} to {mean + half:+.2f}) over {n} images, "
            f"Wilcoxon p={p_w:.2g}, power {100 * power:.0f}% to detect "
            + (f"the paper's {gap:+.2f} dB" if kind == "better" else f"a {tie_db:g} dB difference")
            + f"; identification {wins}/{losses} discordant, McNemar p={p_m:.2g} (at best "
              f"{mcnemar_floor(wins + losses):.2g}): {outcome}")
    if kind == "better" and n > 1 and mean + half < gap:
        text += " (the interval excludes the paper's gap" + (
            f"; a tie within {tie_db:g} dB)" if outcome == FAILS and abs(mean) + half <= tie_db else ")")
    return outcome, text


def _combined(outcomes: Sequence[str]) -> str:
    return FAILS if FAILS in outcomes else INCONCLUSIVE if INCONCLUSIVE in outcomes else HOLDS


def conclude_order(first: Optional[CellEvidence], others: Dict[str, Optional[CellEvidence]],
                   paper_gaps: Dict[str, float], tie_db: float = 1.0, alpha: float = 0.05,
                   below_budget: bool = False, kinds: Optional[Dict[str, str]] = None) -> Conclusion:
    """The paper's claim on ``first`` against each of ``others`` (:func:`pair_test`): of the
    kind ``kinds`` names (the paper's text), else better where the paper's gap (dB) is at least
    ``tie_db`` and a tie otherwise. Missing evidence makes it inconclusive."""
    if first is None or any(c is None for c in others.values()):
        return Conclusion(NOT_RUN if first is None else INCONCLUSIVE, "" if first is None else "some cells have not run")
    parts, outcomes = [], []
    for name, other in others.items():
        gap = paper_gaps.get(name, 0.0)
        kind = (kinds or {}).get(name) or ("better" if gap >= tie_db else "tie")
        outcome, text = pair_test(first, other, kind, gap, tie_db, alpha)
        outcomes.append(outcome)
        parts.append(f"vs {name}, {text}")
    if first.missing or any(o.missing for o in others.values()):
        return Conclusion(INCONCLUSIVE, "evidence missing; " + "; ".join(parts), below_budget)
    outcome = _combined(outcomes)
    return Conclusion(outcome, "; ".join(parts), below_budget and outcome == INCONCLUSIVE)


def conclude_chain(cells: Sequence[Tuple[str, Optional[CellEvidence]]], paper_db: Sequence[float],
                   tie_db: float = 1.0, alpha: float = 0.05) -> Conclusion:
    """An ordering the paper reports along a setting (Refiner's PSNR falling as alpha rises):
    each cell better than the next, pair by pair on the same images (:func:`pair_test`). Only
    where every cell's positive control recovers images: PSNR compared where the attack recovers
    nothing measures the attack's own floor, not the setting."""
    if any(c is None for _, c in cells):
        missing = [n for n, c in cells if c is None]
        return Conclusion(INCONCLUSIVE if len(missing) < len(cells) else NOT_RUN,
                          f"not yet run: {', '.join(missing)}")
    for name, c in cells:
        effect = c.control_effect()
        if effect is None or c.control_missing or not effect.control_recovered:
            why = (NO_CONTROL if effect is None else f"positive control incomplete: {c.control_missing}"
                   if c.control_missing else f"attack power: the control recovers none of {effect.images} images "
                                             "without the defense")
            return Conclusion(INCONCLUSIVE, f"{name}: {why}")
    parts, outcomes = [], []
    for (name, a), (other, b), gap_a, gap_b in zip(cells, cells[1:], paper_db, paper_db[1:]):
        outcome, text = pair_test(a, b, "better", gap_a - gap_b, tie_db, alpha)
        outcomes.append(outcome)
        parts.append(f"{name} over {other}, {text}")
    if any(c.missing for _, c in cells):
        return Conclusion(INCONCLUSIVE, "evidence missing; " + "; ".join(parts))
    return Conclusion(_combined(outcomes), "; ".join(parts))


def conclude_steps(judged: Dict[int, Conclusion], not_judged: Dict[int, str],
                   pending: Optional[Dict[int, str]] = None) -> Conclusion:
    """A claim about each of several steps: every judged step's conclusion, and the steps not
    judged with why (a collapsed model is no evidence either way). It holds (does not hold)
    only where every judged step does; no judged step: inconclusive. Steps whose evidence is
    still to come (``pending``, with what is missing) leave the claim :data:`SO_FAR`: the judged
    steps are shown, nothing is decided."""
    pending = pending or {}
    parts = [f"step {s}: " + (judged[s].text() if s in judged else f"not complete ({pending[s]})" if s in pending
                              else f"not judged ({not_judged[s]})")
             for s in sorted(set(judged) | set(not_judged) | set(pending))]
    text = _bound_once("; ".join(parts))
    outcomes = {c.outcome for c in judged.values()}
    if pending:
        return Conclusion(SO_FAR, text)
    if not judged:
        return Conclusion(INCONCLUSIVE, "no step judged; " + text)
    outcome = next(iter(outcomes)) if len(outcomes) == 1 and outcomes <= {HOLDS, FAILS, NOT_RUN} else INCONCLUSIVE
    return Conclusion(outcome, text, decided=all(c.decided for c in judged.values()))


def _bound_once(text: str) -> str:
    """``text`` with why a best-of-m chance is a bound (:data:`BOUND_WHY`) said at its first
    step only: the later steps keep their "best of m"."""
    first = text.find(BOUND_WHY)
    if first < 0:
        return text
    end = first + len(BOUND_WHY)
    return text[:end] + text[end:].replace(f", {BOUND_WHY}", "")


#: accuracy (a fraction) by which a utility claim may miss and still hold
UTILITY_TOLERANCE = 0.02


def conclude_utility(utility: Optional[Dict[str, Any]], claim: str, ratio: Optional[float] = None,
                     tolerance: float = UTILITY_TOLERANCE) -> Conclusion:
    """``claim``: ``"not-worse"`` (defended accuracy at least the undefended) or ``"ratio"``
    (at least ``ratio`` x the undefended), each up to ``tolerance``, judged on the 95% Welch
    interval of ``defended - ratio x undefended`` over the seeds (see the module docstring)."""
    if not utility or utility.get("unavailable") or not utility.get("defended") or not utility.get("undefended"):
        return Conclusion(NOT_RUN, (utility or {}).get("unavailable", ""))
    d, u = AccuracySpread.from_dict(utility["defended"]), AccuracySpread.from_dict(utility["undefended"])
    if d.mean is None or u.mean is None:
        return Conclusion(INCONCLUSIVE, "no finished training run")
    weight = 1.0 if claim == "not-worse" else float(ratio if ratio is not None else 1.0)
    diff = mean_difference(d.accuracies, u.accuracies, weight, LEVEL)
    if diff is None:
        return Conclusion(INCONCLUSIVE, "one seed: no spread to judge the gap against")
    what = "defended - undefended" if weight == 1.0 else f"defended - {weight:g} x undefended"
    detail = (f"defended {100 * d.mean:.1f}% ± {100 * d.std:.1f}, undefended {100 * u.mean:.1f}% ± "
              f"{100 * u.std:.1f} (mean ± std, {len(d.accuracies)} and {len(u.accuracies)} seeds); {what} "
              f"{100 * diff.estimate:+.1f} points, 95% CI {100 * diff.low:+.1f} to {100 * diff.high:+.1f}, "
              f"tolerance {100 * tolerance:.0f} points")
    if diff.low > -tolerance:
        return Conclusion(HOLDS, detail)
    if diff.high < -tolerance:
        return Conclusion(FAILS, detail + ", below beyond the noise")
    return Conclusion(INCONCLUSIVE, f"{detail}; the noise (± {100 * diff.half_width:.1f} points) spans the "
                                    "tolerance")
