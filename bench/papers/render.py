"""The papers page from the stored cells: the summary and verdict table of ``docs/papers.md``
and each row's details in :data:`DETAILS_PAGE`. Rendering runs no attack."""
from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench.docs_table import ROOT
from bench.papers.cells import (CellPlan, Profile, args_text, claim_cells, judged_on, label, own_text, run_setting,
                                stale_cell, stale_text, step_cells, stored_cells)
from bench.papers.evidence import LEVEL, CellEvidence
from bench.papers.health import health_text, projection_text
from bench.papers.judge import conclude, likely_cause
from bench.papers.rows import BY_ID
from bench.papers.search import search_edge
from bench.papers.spec import AT_PAPER, PAPERS, Row
from bench.papers.stale import PlanCache
from bench.papers.store import kept_for, partial_dir, results_path
from bench.papers.verdict import NOT_RUN, Conclusion, identification_text, interval_text


def _f(v: Optional[float], digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "inf" if v >= 199.9 else f"{v:.{digits}f}"


def cell_text(c: Optional[CellEvidence], head: str = "", progress: str = "") -> str:
    head = f"{head}: " if head else ""
    if c is None or (c.images == 0 and c.missing):
        return f"{head}{progress or 'not yet run'}"
    text = f"{head}{_f(c.psnr)} dB / {_f(c.ssim, 3)} / {_f(c.lpips, 3)}; {identification_text(c)}; {c.recovered} recovered"
    if len(c.per_step_psnr) > 1:
        text += "; per step " + ", ".join(f"{s}: {_f(v, 1)}" for s, v in sorted(c.per_step_psnr.items()))
        found = {s: [v for k, v in c.per_image_identified.items() if k[0] == s] for s in sorted(c.per_step_psnr)}
        text += " dB; identified per step " + ", ".join(f"{s}: {sum(v)}/{len(v)}" for s, v in found.items())
    if c.missing:
        text += f"; missing: {'; '.join(c.missing[:2])}"
    return text + (f"; {progress}" if progress else "")


def planner_head(row: Row, run: Dict[str, Any], c: Optional[CellEvidence], profile: str) -> str:
    names = "auto" if run["planner"] == ["auto"] else ", ".join(run["planner"])
    head = f"{names} at budget {run['planner_budget']:,}"
    if run["planner"] != ["auto"]:
        head += f" ({row.scale(profile).why})"
    if run["planner_args"]:
        head += f"; {json.dumps(run['planner_args'])}"
    return head + (f"; strongest {c.strongest}" if c is not None and c.strongest else "")


def adaptive_head(row: Row, run: Dict[str, Any]) -> str:
    """The adaptive attack's label, with its budget where it is not the row's."""
    own = run["adaptive_budget"]
    return row.adaptive.label + (f" at budget {own:,}" if own != run["budget"] else "")


def kept_progress(results: Path, plan: CellPlan, claim_judged: bool = False, per_step: bool = False,
                  complete: Sequence[int] = ()) -> str:
    """For a cell not yet stored: how many of its image-steps an unfinished run has kept in the
    repository (:func:`kept_image_steps`; '' where none). Nothing is judged from them until the
    steps of the row's claim complete (:func:`claim_record`; ``claim_judged``: they are, so the
    text says so), or of a row judged step by step (``per_step``), each claim step's images
    (``complete``: the steps whose evidence is stored, :func:`step_record`, which the figures are of)."""
    kept = partial_dir(results, plan.name)
    best = len(kept_for(kept, plan, None))
    if not best:
        return ""
    kept_text = (f"{best} of {len(plan.call['steps']) * int(plan.call['images'])} image-steps kept in "
                 f"{kept.relative_to(ROOT) if kept.is_relative_to(ROOT) else kept}")
    if claim_judged:
        return f"the claim's steps complete, the others under way: {kept_text}"
    when = "each claim step judged once all its images are kept" if per_step else "judged when the claim's steps complete"
    if complete:
        when = f"the figures are of {_steps_text(complete)} alone, complete so far; {when}"
    return f"under way: {kept_text} ({when})"


def _steps_text(steps: Sequence[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


@dataclass
class RowView:
    """A row on the page: its line of the verdict table and its paragraphs below it."""

    row: Row
    conclusion: Conclusion
    label: str
    ours: str
    power: str
    verdict: str
    details: List[Tuple[str, str]]  # (what, text) paragraphs

    def line(self) -> str:
        label = "at the paper's setting" if self.label == AT_PAPER else "scaled"
        cells = [f"[{self.row.id}]({DETAILS_LINK}#{self.row.id})", self.row.paper, CLAIM_WORDS[self.row.claim], label,
                 self.row.paper_number, self.ours, self.power, f"**{_short(self.verdict, 110)}**"]
        return "| " + " | ".join(_short(c.replace("|", "/"), MAX_CELL) for c in cells) + " |"

    def section(self) -> str:
        head = f'<a id="{self.row.id}"></a>\n#### {self.row.id}: {self.row.figure}'
        paragraphs = [textwrap.fill(f"**{what}.** {text}", 100, break_long_words=False, break_on_hyphens=False)
                      for what, text in self.details if text]
        return "\n\n".join([head, *paragraphs])


#: a verdict table cell's longest text
MAX_CELL = 300
#: where each row's details live (the page holds the verdict table), from the page
DETAILS_PAGE = "bench/results/papers/papers.md"
DETAILS_LINK = "../" + DETAILS_PAGE
#: the claim of each kind, in a few words
CLAIM_WORDS = {"protects": "the defense protects", "leaks": "the attack recovers images",
               "order": "the attacks' order", "utility": "accuracy kept", "chain": "PSNR falls as alpha rises"}


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3].rsplit(" ", 1)[0] + " ..."


def _power(cells: Dict[str, Optional[CellEvidence]]) -> str:
    """The positive control's recovery of each cell, named (``ig 3/8; planner 5/8``): 'none stored'
    for a cell judged without one; '-' where the row has no attack cell (an accuracy claim)."""
    found = [f"{name.split(':', 1)[-1]} {c.power_text(short=True)}" for name, c in cells.items() if c is not None]
    return "; ".join(found) if found else "-"


def _ours(c: Optional[CellEvidence]) -> str:
    if c is None:
        return "-"
    return f"{_f(c.psnr)} dB; {c.identified} of {c.images} identified"


def decides(row: Row, cell: str) -> bool:
    """Whether the row's verdict is decided on ``cell``: an order claim compares the paper's
    attacks alone (the planner's cell is shown beside it); every other claim uses each cell."""
    return row.claim != "order" or cell.startswith("paper:")


def row_lines(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
              out: Path) -> RowView:
    stored, cells, plans = stored_cells(row, profile, data, data_args, root, out)
    claimed = claim_cells(stored, plans)
    stepped = step_cells(stored, plans)
    cache = PlanCache(results_path(root, profile.name, data, row).parent)
    run = run_setting(row, profile)
    utility = ((stored.get("cells") or {}).get("utility") or {}).get("utility")
    judged = judged_on(cells, claimed, stepped)
    chain = [(r, stored_cells(BY_ID[r], profile, data, data_args, root, out)[1].get(f"paper:{row.attacks[0].name}"))
             for r in row.chain]
    conclusion = conclude(row, judged, run, utility, stored, chain)
    setting = f"{own_text(row, run, data)}. Label: {label(row, run)}"
    base = [("The paper's claim", row.quote), ("The paper", row.setting.text()), ("Ours", setting),
            ("Open or different", "; ".join(row.notes))]
    if row.claim in ("utility", "chain"):
        chained = [c for _, c in chain]
        ours = "-" if row.claim == "utility" else "; ".join(f"{_f(c.psnr)}" if c else "-" for c in chained) + " dB"
        power = "none: an accuracy claim, no attack" if row.claim == "utility" else _power(
            {r.replace(row.id.rsplit("-", 1)[0] + "-", ""): c for r, c in chain})
        return RowView(row, conclusion, label(row, run), ours, power, conclusion.text(),
                       base + [("Verdict", f"**{conclusion.text()}**")])
    results = results_path(root, profile.name, data, row)
    changed = {n: stale_cell((stored.get("cells") or {}).get(n) or {}, cache) for n in cells}
    fresh = {n for n in claimed if not changed[n]}  # a stale claim's rerun is under way, not complete
    progress = {p.name: kept_progress(results, p, p.name in fresh, row.per_step,
                                      stepped[p.name].steps if p.name in stepped else ()) for p in plans
                if cells.get(p.name) is None}
    # a cell under way shows its claim's evidence (``judged``) beside its progress
    paper_cell = "<br>".join(cell_text(judged.get(f"paper:{a.name}"), a.label, progress.get(f"paper:{a.name}", ""))
                             for a in row.attacks)
    search = stored.get("search") or {}
    if row.search and search.get("chosen"):
        paper_cell += "<br>weights chosen on " + f"{search['held_out']} held-out images: " + "; ".join(
            f"{n} {args_text(v)}{search_edge(search, n)}" for n, v in search["chosen"].items())
    planner = judged.get("planner")
    planner_cell = cell_text(planner, planner_head(row, run, planner, profile.name), progress.get("planner", ""))
    adaptive_cell = (cell_text(judged.get("adaptive"), adaptive_head(row, run), progress.get("adaptive", ""))
                     if row.adaptive else "-")
    resting = {n for n, why in changed.items() if why and decides(row, n)}  # stale cells the verdict may rest on
    if resting and resting <= ASIDE and conclusion.decided:
        standing = conclude(row, {n: None if n in resting else c for n, c in judged.items()}, run, utility, stored,
                            chain)
        if standing.decided and standing.outcome == conclusion.outcome:  # the current cells decide it alone
            conclusion, resting = standing, set()
    first = judged.get(f"paper:{row.attacks[0].name}")
    cause = likely_cause(row, run, data, first.psnr if first else None)
    verdict = conclusion.text() + (f"; {cause}" if cause else "")
    if row.claim_steps and conclusion.outcome != NOT_RUN:
        verdict = f"judged at steps {', '.join(map(str, row.claim_steps))}: {verdict}"
    if stored.get("projection"):
        verdict += "; alpha: " + projection_text(stored["projection"])
    stale = sorted({a for n in resting for a in changed[n]})
    aside = {n: f" Stale: {stale_text(why)}; running the row again redoes it." for n, why in changed.items()
             if why and n not in resting}  # shown beside the verdict, which it does not decide
    planner_cell += aside.get("planner", "")
    adaptive_cell += aside.get("adaptive", "")
    pending = [n for n, c in cells.items() if c is None]
    claims_complete = all(claimed.get(n) is not None for n in pending)  # every pending cell has its claim's steps
    if stale:
        verdict = f"{STALE} ({stale_text(stale)}; running the row again redoes them): {verdict}"
        conclusion = Conclusion(STALE)  # counted apart: its attacks are no longer what the tool runs
    elif pending and (conclusion.decided or claims_complete):
        # every pending cell has its claim's steps complete, or a leak shown decides the claim
        # whatever they add: the verdict counts, the rest of the steps are shown as they finish
        if claims_complete:
            verdict += f" (decided at the claim's steps; the other steps of {' and '.join(pending)} under way)"
        else:
            states = [f"{n} under way" if progress.get(n) or n in stepped else f"{n} not yet run" for n in pending]
            verdict += f" (decided; {', '.join(states)})"
    elif pending and (any(c is not None for c in judged.values()) or any(progress.values())):
        states = [f"{n} under way" if progress.get(n) or n in stepped else f"{n} not yet run" for n in pending]
        verdict = f"{UNFINISHED} ({', '.join(states)})" + (f": {verdict}" if conclusion.outcome != NOT_RUN else "")
        conclusion = Conclusion(UNFINISHED)  # the summary counts it as unfinished, whatever its cells say so far
    details = base + [("The paper's attack", paper_cell.replace("<br>", "; ")),
                      ("The planner's attacks at their presets", planner_cell),
                      ("The paper's adaptive attack", "" if adaptive_cell == "-" else adaptive_cell),
                      ("The model at each step, as the audit trains it", health_text(stored)),
                      ("Verdict", f"**{verdict}**")]
    ours = _ours(first)
    if first is not None and first is stepped.get(f"paper:{row.attacks[0].name}"):
        ours += f" ({_steps_text(first.steps)} so far)"  # a cell under way: the steps complete
    return RowView(row, conclusion, label(row, run), ours, _power(judged), verdict, details)


#: the cells whose staleness can be shown beside their own paragraph, where the verdict does not
#: rest on them (an order claim's, or a leak that the row's other cells decide alone)
ASIDE = {"planner", "adaptive"}
#: a row with some of its cells stored: its verdict so far is shown, never counted as one
UNFINISHED = "unfinished"
#: a row whose stored cells ran attacks whose defaults have changed since: shown, counted apart
STALE = "stale"


HEADER = ("| row | paper | claim | label | paper's number | ours: the paper's attack | power: recovered without the defense | verdict |\n"
          "|---|---|---|---|---|---|---|---|")


def counts(rows: Sequence[Row], profile: Profile) -> Tuple[int, int]:
    """Rows at the paper's setting and scaled rows under ``profile``."""
    at = sum(label(r, run_setting(r, profile)) == AT_PAPER for r in rows)
    return at, len(rows) - at


def render(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
           out: Path) -> str:
    """The verdict table, then each row's details."""
    return "\n\n".join(render_parts(rows, profile, data, data_args, root, out))


def render_parts(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                 out: Path) -> Tuple[str, str]:
    """The page's summary and verdict table, and the rows' details (:data:`DETAILS_PAGE`)."""
    at, scaled = counts(rows, profile)
    outcomes: Dict[str, int] = {}
    views = [row_lines(row, profile, data, data_args, root, out) for row in rows]
    for view in views:
        outcomes[view.conclusion.outcome] = outcomes.get(view.conclusion.outcome, 0) + 1
    summary = (f"{len(rows)} rows: **{at} at the paper's setting, {scaled} scaled** (profile `{profile.name}`); "
               + ", ".join(f"{n} {_tally(o, n)}" for o, n in sorted(outcomes.items())))
    summary += "\n\n" + calibration_note(rows, profile, data, data_args, root, out)
    table = "\n".join([HEADER, *(v.line() for v in views)])
    parts = []
    for paper in PAPERS:
        chosen = [v for v in views if v.row.paper == paper]
        if chosen:
            parts.append("\n\n".join([f"### {paper}", *(v.section() for v in chosen)]))
    link = f"Each row's details, its cells and its verdict in full: [{DETAILS_PAGE}]({DETAILS_LINK})."
    return ("\n\n".join([summary, table, link]),
            "\n\n".join([textwrap.fill(CHANCE_NOTE, 100),
                          textwrap.fill(grid_note(rows, profile, data, data_args, root, out), 100), *parts]))


def calibration_note(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                     out: Path) -> str:
    """The two numbers every verdict leans on, pooled over the stored cells: the leak rule's
    false-positive rate on the cells' own null items, and what the positive control recovers."""
    from audit.core.evidence import clopper_pearson

    fp = items = with_fp = controlled = recovered = judged = cells = 0
    for row in rows:
        for cell in stored_cells(row, profile, data, data_args, root, out)[1].values():
            if cell is None:
                continue
            cells += 1
            if cell.false_positives:
                fp, items, with_fp = fp + cell.false_positives[0], items + cell.false_positives[1], with_fp + 1
            effect = cell.control_effect()
            if effect is not None:
                controlled, recovered, judged = controlled + 1, recovered + effect.control_recovered, judged + effect.images
    lo, hi = clopper_pearson(fp, items, LEVEL) if items else (0.0, 1.0)
    rule = (f"the leak rule calls {fp} of {items} null items recovered (95% CI {interval_text(lo, hi)}; each "
            f"unrelated image or data-only guess judged as if it were the reconstruction, leave-one-out), over the "
            f"{with_fp} of {cells} stored cells that keep it" if items else
            f"the leak rule's false-positive rate is kept by none of the {cells} stored cells yet (they ran before "
            "it was stored; docs/evidence.md measures it on the embedded data: 0 of 1,040)")
    control = (f"the positive control recovers {recovered} of {judged} images without the defense, over the "
               f"{controlled} cells that store one" if controlled else "no cell stores a positive control yet")
    return f"**Calibration.** {rule}; {control}."


def grid_note(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
              out: Path) -> str:
    """How many of the searched rows' chosen prior weights sit at the edge of their grid."""
    chosen = edges = 0
    for row in rows:
        search = (stored_cells(row, profile, data, data_args, root, out)[0].get("search") or {}) if row.search else {}
        for name in search.get("chosen") or {}:
            chosen += 1
            edges += bool(search_edge(search, name))
    return (f"**The searched weights.** {edges} of the {chosen} prior weights chosen on held-out images sit at the "
            "edge of their searched grid (each edge was extended a decade up to four times, then the search "
            "stopped): those are not bracketed by worse values, and the row says so beside the weight. The "
            "learning rate is chosen from 0.1 and 0.5 alone, so it is always at an edge.")


#: why each cell's chance is a bound, said once above the rows' details
CHANCE_NOTE = ("**Chance, per cell.** A cell's chance is the probability that the best of its m null guesses "
               "(m: its attacks times the references each is judged against) identifies the image: a "
               "hypergeometric draw of m of the null items ranked for that image. It is a bound, not a "
               "measurement: the same attacks were not run on null uploads (that would double every cell's cost), "
               "and a draw of m independent null items errs high when the attacks' outputs are alike, so a cell "
               "needs more identified images to read above chance. Each cell below names it.")


def _tally(outcome: str, count: int) -> str:
    """How many rows have ``outcome``, in words: "1 holds", "2 hold", "2 do not hold"."""
    plural = {"holds": "hold", "does not hold": "do not hold"}
    return plural.get(outcome, outcome) if count != 1 else outcome


def timing(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path, out: Path) -> str:
    seconds, done, total, stale, keyed = 0.0, 0, 0, 0, 0
    for row in rows:
        stored, cells, _ = stored_cells(row, profile, data, data_args, root, out)
        total += len(cells)
        for name, c in cells.items():
            if c is not None or (row.claim == "utility" and (stored.get("cells") or {}).get(name)):
                done += 1
                cell = (stored.get("cells") or {}).get(name) or {}
                seconds += float(cell.get("seconds") or 0.0)
                stale += bool(stale_cell(cell, PlanCache(results_path(root, profile.name, data, row).parent)))
                keyed += bool(cell.get("run_key"))
        seconds += float((stored.get("search") or {}).get("seconds") or 0.0)
    return (f"{done} of {total} cells stored" + (f" ({stale} stale)" if stale else "")
            + f", {keyed} of them checked against the engine's run key today"
            + (f" (the other {done - keyed} record none: running their rows again records it)" if keyed < done else "")
            + f", {seconds / 60:.1f} min of runs in all")
