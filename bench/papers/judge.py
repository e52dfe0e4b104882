"""A row's conclusion from its cells: each kind of claim by its rule of
:mod:`bench.papers.verdict`, a row judged step by step per step (a step whose model collapsed
left out)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from bench.papers.cells import (CellPlan, args_text, below_budget, claim_cells, differences, judged_on, stale_cell,
                                step_cells, whole_cells)
from bench.papers.evidence import CellEvidence
from bench.papers.health import collapsed
from bench.papers.rows import BY_ID
from bench.papers.spec import Row
from bench.papers.stale import PlanCache
from bench.papers.verdict import (NOT_RUN, Conclusion, conclude_chain, conclude_leaks, conclude_order,
                                  conclude_protects, conclude_steps, conclude_utility)


def at_paper_budget(row: Row, run: Dict[str, Any]) -> bool:
    """The paper's attacks ran at the paper's budget on the paper's model (each of them: one
    at its own budget below the paper's is not)."""
    budget = row.setting.budget
    return (budget is not None and run["budget"] >= budget and run["model_args"] == row.setting.model_args
            and not below_budget(row, run))


def budget_note(row: Row, run: Dict[str, Any]) -> str:
    """Why the row's attacks are not at the paper's setting, in words (where they are not)."""
    if row.setting.budget is None:
        return f"the paper states no iteration count ({run['budget']:,} gradient evaluations here)"
    if run["model_args"] != row.setting.model_args:
        return f"a smaller model than the paper's ({args_text(run['model_args'])})"
    if run["budget"] >= row.setting.budget and below_budget(row, run):
        return "; ".join(f"{name} ran below the paper's budget ({n:,} of {row.setting.budget:,})"
                         for name, n in below_budget(row, run).items())
    return f"the attacks ran below the paper's budget ({run['budget']:,} of {row.setting.budget:,})"


@dataclass
class Judging:
    """What a row is judged on: its cells (at the claim's steps), its run setting, its stored
    results (utility, the model's health per step) and the cells of the rows it orders."""

    cells: Dict[str, Optional[CellEvidence]]
    run: Dict[str, Any]
    stored: Dict[str, Any] = field(default_factory=dict)
    chain: List[Tuple[str, Optional[CellEvidence]]] = field(default_factory=list)


def _conclude_utility(row: Row, j: Judging) -> Conclusion:
    claim, ratio = row.utility or ("not-worse", 1.0)
    utility = ((j.stored.get("cells") or {}).get("utility") or {}).get("utility")
    return conclude_utility(utility, claim, ratio) if utility else Conclusion(NOT_RUN)


def _conclude_protects(row: Row, j: Judging) -> Conclusion:
    return conclude_protects(list(j.cells.values()), at_paper_budget(row, j.run), budget_note(row, j.run))


def _conclude_leaks(row: Row, j: Judging) -> Conclusion:
    key = "adaptive" if row.leak_cell == "adaptive" else f"paper:{row.attacks[0].name}"
    named = [("the paper's", f"paper:{a.name}") for a in row.attacks[1:]]
    others = [(name, j.cells.get(k)) for name, k in (*named, ("the planner's", "planner"),
                                                      ("the paper's adaptive attack", "adaptive")) if k != key]
    return conclude_leaks(j.cells.get(key), at_paper_budget(row, j.run), others, budget_note(row, j.run))


def _conclude_order(row: Row, j: Judging) -> Conclusion:
    first = j.cells.get("paper:bayes-optimal")
    others = {n: j.cells.get(f"paper:{n}") for n in ("bayes-l2", "bayes-l1", "bayes-cos")}
    gaps = {n: row.order_psnr["bayes-optimal"] - row.order_psnr[n] for n in others}
    return conclude_order(first, others, gaps, below_budget=not at_paper_budget(row, j.run),
                          kinds=dict(row.order_kinds) or None)


def _conclude_chain(row: Row, j: Judging) -> Conclusion:
    return conclude_chain(j.chain, [BY_ID[r].paper_psnr for r in row.chain])


#: how each kind of claim is concluded from its evidence
CONCLUDERS: Dict[str, Callable[[Row, Judging], Conclusion]] = {
    "utility": _conclude_utility, "protects": _conclude_protects, "leaks": _conclude_leaks,
    "order": _conclude_order, "chain": _conclude_chain}


def conclude(row: Row, cells: Dict[str, Optional[CellEvidence]], run: Dict[str, Any],
             utility: Optional[Dict[str, Any]] = None, stored: Optional[Dict[str, Any]] = None,
             chain: Sequence[Tuple[str, Optional[CellEvidence]]] = ()) -> Conclusion:
    """The row's conclusion from its cells (see :mod:`bench.papers.verdict`); a row judged step
    by step (``per_step``) leaves out the steps whose model collapsed (:func:`collapsed`)."""
    stored = dict(stored or {})
    if utility is not None:
        stored["cells"] = {**(stored.get("cells") or {}), "utility": {"utility": utility}}
    judging = Judging(cells, run, stored, list(chain))
    if row.claim not in ("utility", "chain") and not any(c is not None for c in cells.values()):
        return Conclusion(NOT_RUN)
    if not row.claim_steps:
        return CONCLUDERS[row.claim](row, judging)
    if not row.per_step:
        judging.cells = {n: c.at_steps(row.claim_steps) if c is not None else None for n, c in cells.items()}
        return CONCLUDERS[row.claim](row, judging)
    return conclude_steps(*step_states(row, judging))


def step_states(row: Row, judging: Judging) -> Tuple[Dict[int, Conclusion], Dict[int, str], Dict[int, str]]:
    """Of a row judged step by step, its claim steps as (judged: their conclusion, not judged:
    why, pending: what is missing) from ``judging``'s cells; a step whose model collapsed
    (:func:`collapsed`) is not judged, one a cell still to come can change is pending."""
    cells = judging.cells
    health = (judging.stored.get("health") or {}).get("steps") or {}
    judged, skipped, pending = {}, {}, {}
    for step in row.claim_steps:
        why = collapsed(health[str(step)]) if str(step) in health else "the model's health is not measured: rerun the row"
        at_step = {n: c.at_steps([step]) if c is not None and step in c.steps else None for n, c in cells.items()}
        if why:
            skipped[step] = why
            continue
        if not any(c is not None for c in at_step.values()):
            pending[step] = "no cell has run this step yet"
            continue
        judging.cells = at_step
        found = CONCLUDERS[row.claim](row, judging)
        missing = [n for n, c in at_step.items() if c is None]
        if found.outcome == NOT_RUN or (missing and not found.decided):  # a cell still to come can change it
            pending[step] = f"{' and '.join(missing)} still to run" + (f"; so far {found.text()}"
                                                                      if found.outcome != NOT_RUN else "")
            continue
        judged[step] = found
    return judged, skipped, pending


def settled_steps(row: Row, stored: Dict[str, Any], plans: Sequence[CellPlan], run: Dict[str, Any],
                  cache: Optional[PlanCache] = None) -> Set[int]:
    """The claim steps of a row judged step by step that no further cell can change, from the
    stored cells that run what the tool runs: judged (a leak one cell shows decides its step at
    once) or not judged (the model measured collapsed); a step pass of :func:`run_row` skips
    them."""
    every = judged_on(whole_cells(stored, plans), claim_cells(stored, plans), step_cells(stored, plans))
    current = {n: None if stale_cell((stored.get("cells") or {}).get(n) or {}, cache) else c
               for n, c in every.items() if n != "utility"}
    judged, skipped, _ = step_states(row, Judging(current, run, stored, []))
    measured = (stored.get("health") or {}).get("steps") or {}  # unmeasured is not collapsed
    return set(judged) | {step for step in skipped if str(step) in measured}


def likely_cause(row: Row, run: Dict[str, Any], data: str, ours: Optional[float]) -> str:
    """Where our figure for the paper's own attack differs from the paper's by more than 3 dB:
    the differences that apply to this row (the label's, the data set, the code's)."""
    if ours is None or row.paper_psnr is None or abs(ours - row.paper_psnr) <= 3.0:
        return ""
    causes = differences(row, run)
    if data != "cifar10" or "CIFAR-10" not in row.setting.data:
        causes.append(f"data ({data} here, {row.setting.data} in the paper)")
    causes.extend(f"code: {n}" for n in row.notes)
    return f"{ours - row.paper_psnr:+.1f} dB from the paper; likely: " + "; ".join(causes or ["unexplained"])
