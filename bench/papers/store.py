"""Where the papers bench keeps its results: one append-only store,
``bench/results/papers/results.jsonl`` (:class:`bench.jsonl.Lines`), with a line for a row each
time its stored cells change (keyed ``<profile>-<data>/<row>``; the planner's plans beside them,
:class:`~bench.papers.stale.PlanCache`), and the per-image results of cells still under way
(``<profile>-<data>/<row>.partial/``), copied in as each slice finishes so that a cell resumes
from a fresh clone."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from audit.core.jsonable import to_jsonable
from bench.docs_table import ROOT
from bench.jsonl import FILE, Lines
from bench.papers import stale
from bench.papers.stale import PlanCache

if TYPE_CHECKING:
    from bench.papers.cell_plan import CellPlan
    from bench.papers.spec import Row

#: the persisted cells of every profile and data set
RESULTS = ROOT / "bench" / "results" / "papers"


def results_path(root: Path, profile: str, data: str, row: Row) -> Path:
    """The row's place under ``root``: its key in the store (:func:`row_line`) and, beside it,
    the folder of its cells under way (:func:`partial_dir`)."""
    return root / f"{profile}-{data}" / row.id


def row_line(place: Path) -> Tuple[Lines, str]:
    """The store of the row at ``place`` (:func:`results_path`) and the row's key in it."""
    return Lines(place.parent.parent / FILE), f"{place.parent.name}/{place.name}"


def load_results(place: Path) -> Dict[str, Any]:
    lines, key = row_line(place)
    stored = lines.get(key)
    return stored if isinstance(stored, dict) else {}


def save_results(place: Path, stored: Dict[str, Any]) -> None:
    """Append the row's results as its line (nothing where the store holds them already)."""
    lines, key = row_line(place)
    if lines.get(key) != json.loads(json.dumps(stored)):
        lines.put(key, stored, sort_keys=True)


def partial_dir(place: Path, cell: str) -> Path:
    """Where an unfinished cell's per-image results are kept in the repository (``place``: the
    row's, :func:`results_path`)."""
    return place.parent / f"{place.name}.partial" / cell.replace(":", "-")


#: where a cell's positive control is kept under its partial folder (its store: ``out/control``)
CONTROL_PARTIAL = "control"


def restore_partial(partial: Path, out: Path) -> int:
    """Copy the repository's unfinished results into the engine's store (its run keys as
    stored; the engine reuses a result only if its settings and defaults still match), the
    positive control's into the control's store."""
    copied = 0
    found = [(src, out / "runs" / src.parent.name / "results" / src.name)
             for src in (sorted(partial.glob("*/*")) if partial.is_dir() else []) if src.is_file()]
    found += [(src, out / CONTROL_PARTIAL / "runs" / src.parent.name / "results" / src.name)
              for src in sorted((partial / CONTROL_PARTIAL).glob("*/*")) if src.is_file()]
    for src, dst in found:
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            copied += 1
    return copied


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``b`` exists with ``a``'s bytes (sizes first: most differing results differ in size)."""
    return b.exists() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def keep_results(results: Path, kept: Path) -> None:
    """Copy a store's finished results (``results``) into the repository's ``kept`` folder: new
    ones, and those the run redid (a result run with other settings is kept under the same name
    until it is redone)."""
    for src in sorted(results.glob("*")):
        dst = kept / src.name
        if src.suffix in (".json", ".png") and not _same_file(src, dst):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def kept_seconds(partial: Path) -> float:
    """The attack time of the results an unfinished run kept under ``partial`` (each image's
    ``time_s``, the control's included): counted into the cell's ``seconds`` when a later run
    finishes it, so a resumed cell records the time of all its runs, not the last one's."""
    total = 0.0
    for path in sorted(partial.rglob("*.json")) if partial.is_dir() else []:
        try:
            total += float(json.loads(path.read_text()).get("time_s") or 0.0)
        except (ValueError, OSError, AttributeError):
            continue  # an unreadable kept result is redone by the engine; its time is not known
    return total


def keep_partial(out: Path, key: str, partial: Path, control: Optional[Dict[str, Any]] = None) -> None:
    """Keep the engine run's finished results in the repository (:func:`keep_results`);
    ``control`` (the report's ``control`` entry): its own store's results too."""
    keep_results(out / "runs" / key / "results", partial / key)
    if control and control.get("run_key") and control.get("dir") == CONTROL_PARTIAL:
        keep_results(out / CONTROL_PARTIAL / "runs" / control["run_key"] / "results",
                     partial / CONTROL_PARTIAL / control["run_key"])


def kept_image_steps(kept: Path, plan: CellPlan, planned: Sequence[str] = (),
                     key: Optional[str] = None) -> Set[Tuple[int, int]]:
    """The (step, image) pairs of the cell that an unfinished run kept in ``kept`` (its partial
    folder) with every attack's result the cell's call reuses, as the engine decides by the
    store's own result names: run with the cell's settings of its attack and the attack's
    current defaults, and not an error (retried); from the kept run with the most, or from the
    run ``key`` alone where given (the engine's key for the call today, :func:`run_key`). A planner
    cell's attacks are those the kept run has results of and those it plans now (``planned``,
    :func:`planned_attacks`): an attack the planner added is still to run on every image."""
    import adaptive  # noqa: F401  (registers the adaptive attacks in ATTACKS)
    from attacks import ATTACKS
    from attacks.presets import defaults_fingerprint
    from audit.report.store import RETRIED, result_id

    steps, images = [int(t) for t in plan.call["steps"]], int(plan.call["images"])
    named = [a for a in plan.call["attacks"] if a != "auto"]
    wanted = plan.call.get("attack_args") or {}
    fingerprint = functools.lru_cache(maxsize=None)(defaults_fingerprint)

    def attacks(run: Path) -> List[str]:  # the planner's picks: what the kept run has results of, and plans now
        ran = {f.stem.split("__")[1] for f in run.glob("s*__*__i*.json")}
        return named or (sorted(ran | set(planned)) if ran else [])

    def reused(path: Path, attack: str) -> bool:  # a result run with other settings is redone, not kept progress
        if not path.is_file():
            return False
        record = json.loads(path.read_text())
        return (record.get("status") not in RETRIED and attack in ATTACKS
                and record.get("defaults") == fingerprint(attack)
                and (attack not in wanted or record.get("settings") == to_jsonable(wanted[attack])))

    def done(run: Path) -> Set[Tuple[int, int]]:
        ran = attacks(run)
        return {(s, i) for s in steps for i in range(images)
                if ran and all(reused(run / f"{result_id(s, a, i)}.json", a) for a in ran)}

    runs = [r for r in sorted(kept.glob("*")) if r.is_dir() and r.name != CONTROL_PARTIAL and key in (None, r.name)]
    return max((done(r) for r in runs), key=len, default=set())


def planned_attacks(plan: CellPlan, cache: Optional[PlanCache]) -> List[str]:
    """The attacks a planner cell's call plans now (kept in ``cache``); [] for a cell that names
    its attacks, or without a cache."""
    return cache.plan(plan.call) if cache is not None and "auto" in plan.call["attacks"] else []


def kept_for(partial: Path, plan: CellPlan, cache: Optional[PlanCache]) -> Set[Tuple[int, int]]:
    """:func:`kept_image_steps` under the engine's run key of today, with a planner cell's plan of
    now: both worked out only where a run is kept."""
    if not any(partial.glob("*/*.json")):
        return set()
    return kept_image_steps(partial, plan, planned_attacks(plan, cache), stale.run_key(plan.call))
