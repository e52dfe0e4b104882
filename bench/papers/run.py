"""Running a row: its cells in the order that decides the claim first (:func:`row_passes`),
each cell call by call (:func:`run_cell`) with its results kept as they finish, its positive
control alone where only that is missing (:func:`run_control`)."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

from audit.core.jsonable import to_jsonable
from bench.papers.cells import (CellPlan, Profile, add_step, cells_to_run, claim_record, label,
                                planner_attacks, plan_cells, run_setting, stale_cell, step_record, stored_steps)
from bench.papers.evidence import CellEvidence, cell_evidence, control_from_report
from bench.papers.health import refiner_projection, store_health
from bench.papers.judge import settled_steps
from bench.papers.search import held_out_images, search_key, search_weights
from bench.papers.slices import CallOver, Deadline, cell_calls, cell_slices, claim_of, slice_evaluations
from bench.papers.spec import Row
from bench.papers.stale import PlanCache, audit_of, cell_fingerprints
from bench.papers.store import (CONTROL_PARTIAL, keep_partial, keep_results, kept_for, kept_seconds, load_results,
                                partial_dir, restore_partial, results_path, save_results)


def with_control(evidence: CellEvidence, report: Dict[str, Any]) -> CellEvidence:
    """``evidence`` with the positive control the report stored at its steps."""
    evidence.control, evidence.control_missing = control_from_report(report.get("steps") or [], evidence.steps)
    return evidence


def _stored_evidence(plan: CellPlan, run_key: str, steps: Sequence[int]) -> Tuple[Dict[str, Any], List[str], CellEvidence]:
    """The engine store's manifest of the cell's run, its attacks, and their evidence at ``steps``."""
    from audit.report.store import ResultStore

    store = ResultStore(plan.call["out"], run_key)
    manifest = store.load_manifest()
    attacks = planner_attacks(manifest) if plan.name == "planner" else list(plan.call["attacks"])
    return manifest, attacks, cell_evidence(manifest, [r.to_dict() for r in store.records()], attacks, steps)


def run_slice(call: Dict[str, Any], steps: Sequence[int], images: int) -> Any:
    """One audit call of a cell: its settings at these steps and this many images (the engine
    adds them to the cell's run, reusing every result it already has)."""
    import audit

    return audit.run(**{**call, "steps": list(steps), "images": images})


def run_cell(row: Row, plan: CellPlan, partial: Optional[Path] = None,
             on_claim: Optional[Callable[[Dict[str, Any]], None]] = None,
             claim_only: bool = False, deadline: Optional[Deadline] = None,
             cache: Optional[PlanCache] = None, on_step: Optional[Callable[[Dict[str, Any]], None]] = None,
             stepped: Collection[int] = (), until_step: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Run (or resume) the cell's audit, call by call (:func:`cell_calls`), keeping each call's
    results under ``partial`` before the next starts and skipping the slices whose results it
    kept; its evidence from the engine's store. Where the row's claim is about some of the
    cell's steps, ``on_claim`` receives the record of the claim's evidence (:func:`claim_record`)
    as soon as those steps are complete; ``claim_only`` stops there (returns None). A row judged
    step by step gives ``on_step`` the record of each claim step's evidence as the step's images
    complete (:func:`step_record`; ``stepped``: the steps already stored); ``until_step`` runs
    that step's calls alone (returns None). Under a ``deadline`` a slice that does not fit
    raises :class:`CallOver` before it starts. A planner cell's attacks planned now (kept in
    ``cache``) run on every kept image-step lacking them. The stored ``seconds`` count the
    earlier runs' kept results too (:func:`kept_seconds`)."""
    started = time.perf_counter()
    earlier = kept_seconds(partial) if partial is not None else 0.0  # the runs before this one
    out_dir = Path(plan.call["out"])
    if partial is not None and restore_partial(partial, out_dir):
        print(f"    resumed from {partial}", flush=True)
    kept = kept_for(partial, plan, cache) if partial is not None else set()
    calls = cell_calls(row, plan, kept, claim_only, stepped, until_step)
    for call in calls:
        if not call.needed:
            continue
        if deadline is not None:
            deadline.admit(call.work)
        report = run_slice(plan.call, call.steps, call.images)
        if partial is not None:
            keep_partial(out_dir, report.data["run_key"], partial, report.data.get("control"))
        if deadline is not None:
            deadline.finished(call.work)
        if call.step is not None and on_step is not None:
            _, attacks, evidence = _stored_evidence(plan, report.data["run_key"], [call.step])
            on_step(step_record(plan, attacks, call.step, with_control(evidence, report.data), report.data["run_key"]))
        if call.claim:
            if on_claim is not None:
                _, attacks, evidence = _stored_evidence(plan, report.data["run_key"], call.steps)
                on_claim(claim_record(plan, attacks, with_control(evidence, report.data), report.data["run_key"]))
            if claim_only:
                return None
    if until_step is not None and not (calls and calls[-1].whole):
        return None
    manifest, attacks, evidence = _stored_evidence(plan, report.data["run_key"], plan.steps)
    out = {"key": plan.key, "call": to_jsonable(plan.call), "seconds": round(earlier + time.perf_counter() - started, 1),
           "status": report.data["status"], "attacks": attacks, "run_key": report.data["run_key"]}
    if plan.name == "utility":
        out["utility"] = manifest.get("utility")
    else:
        out["evidence"] = with_control(evidence, report.data).to_dict()
        out["fingerprints"] = cell_fingerprints(plan.call, attacks)
    return out


def needs_control_only(cell: Dict[str, Any], plan: CellPlan, cache: Optional[PlanCache] = None) -> bool:
    """Whether a stored cell lacks only its positive control: stored whole under its current key,
    running what the tool runs, its evidence complete, no control beside it (a cell stored
    before the bench ran one). :func:`run_control` adds it without redoing the defended run."""
    evidence = cell.get("evidence") or {}
    return (cell.get("key") == plan.key and "claim_evidence" not in cell and bool(evidence.get("steps"))
            and not evidence.get("missing") and not evidence.get("control") and not stale_cell(cell, cache))


def run_control(row: Row, plan: CellPlan, cell: Dict[str, Any], partial: Optional[Path] = None) -> Dict[str, Any]:
    """The stored ``cell`` with its positive control beside its evidence: the engine's control
    (:class:`audit.engine.control.PositiveControl`: the base forms of the attacks the cell ran,
    same budget, images and seeds, defense ``none``) run alone in the cell's slices, each slice's
    results kept under ``partial`` as it finishes; the defended results are not redone."""
    from audit.engine.control import PositiveControl, control_inputs
    from audit.report.control import control_summary

    started = time.perf_counter()
    out_dir = Path(plan.call["out"])
    if partial is not None and restore_partial(partial, out_dir):
        print(f"    resumed from {partial}", flush=True)
    for steps, images in cell_slices(plan.call, claim_of(row, plan), slice_evaluations(plan)):
        audit = audit_of(plan.call, steps=list(steps), images=images)
        specs = [s for s in audit.planned()[0] if s.id in cell["attacks"]]
        control, budget = PositiveControl(control_inputs(audit)), audit.attack_settings.budget
        store = control.run(specs, budget, list(steps))
        if partial is not None:
            keep_results(store.dir / "results", partial / CONTROL_PARTIAL / store.key)
    info = control.describe(store, specs, budget, None)  # the last slice is the whole call
    judged = control.judge(store, control.specs(specs), list(steps))
    reports = [{"step": s, "control": control_summary(judged[s].judged, info, audit.output_settings.thresholds)}
               for s in steps]
    evidence = CellEvidence.from_dict(cell["evidence"])
    evidence.control, evidence.control_missing = control_from_report(reports, evidence.steps)
    return {**cell, "evidence": evidence.to_dict(), "control_seconds": round(time.perf_counter() - started, 1)}


def run_row(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path, root: Path,
            retry: bool = False, deadline: Optional[Deadline] = None) -> Dict[str, Any]:
    """Run the row's cells not stored under their current key (:func:`cells_to_run`, in the
    order of :func:`row_passes`), storing each (the row's line in the store) as it finishes;
    returns the stored results. Under a ``deadline`` a slice that does not fit stops the row
    (:class:`CallOver`), every finished slice kept."""
    path = results_path(root, profile.name, data, row)
    stored = load_results(path)
    stored.update(row=row.id, profile=profile.name, data=data)
    run = run_setting(row, profile)
    stored["setting"] = {"run": run, "label": label(row, run)}
    if row.search:
        probe = plan_cells(row, profile, data, data_args, out)[0]
        held = held_out_images(profile)
        key = search_key(row, probe, held)  # current_search_key, from the probe planned here
        if (stored.get("search") or {}).get("key") != key:
            started = time.perf_counter()
            stored["search"] = {"key": key, **search_weights(row, probe, held),
                                "seconds": round(time.perf_counter() - started, 1)}
            save_results(path, stored)
            print(f"  search: {stored['search']['chosen']} ({stored['search']['seconds']:.0f} s)", flush=True)
    if row.defense == "refiner" and row.claim == "protects":
        key = json.dumps([row.defense_args, run["model_args"]], sort_keys=True)
        if (stored.get("projection") or {}).get("key") != key:
            stored["projection"] = {"key": key, **refiner_projection(row, profile, run,
                                                                    2 if profile.shrunk else 8)}
            save_results(path, stored)
    if row.per_step:
        store_health(row, profile, data, data_args, out, stored)
        save_results(path, stored)
    stored.setdefault("cells", {})
    plans = plan_cells(row, profile, data, data_args, out, (stored.get("search") or {}).get("chosen"))

    def keep(plan: CellPlan) -> Callable[[Dict[str, Any]], None]:
        def keep_claim(record: Dict[str, Any]) -> None:
            stored["cells"][plan.name] = record
            save_results(path, stored)
        return keep_claim

    def keep_step(plan: CellPlan) -> Callable[[Dict[str, Any]], None]:
        def kept(record: Dict[str, Any]) -> None:
            stored["cells"][plan.name] = add_step(stored["cells"].get(plan.name) or {}, record)
            save_results(path, stored)
        return kept

    cache = PlanCache(path.parent)
    for plan, claim_only, until_step in open_passes(row, stored, plans, run, retry, cache):
        old = stored["cells"].get(plan.name) or {}
        # a lent call plans its slices as whole cells: there the cell reruns whole
        part = claim_only or until_step is not None
        control_only = deadline is None and not part and needs_control_only(old, plan, cache)
        what = (", the claim's steps" if claim_only else f", up to step {until_step}" if until_step is not None
                else ", its positive control" if control_only else "")
        print(f"  [{time.strftime('%H:%M:%S')}] {row.id} {plan.name}{what} (budget {plan.call['budget']})", flush=True)
        partial = partial_dir(path, plan.name)
        if control_only:
            stored["cells"][plan.name] = run_control(row, plan, old, partial)
            save_results(path, stored)
            shutil.rmtree(partial, ignore_errors=True)
            continue
        stepped = [] if stale_cell(old, cache) else stored_steps(old, plan)
        cell = run_cell(row, plan, partial, keep(plan), claim_only=claim_only, deadline=deadline, cache=cache,
                        on_step=keep_step(plan), stepped=stepped, until_step=until_step)
        if cell is not None:
            stored["cells"][plan.name] = cell
            save_results(path, stored)
            shutil.rmtree(partial, ignore_errors=True)
    return stored


def row_passes(row: Row, todo: Sequence[CellPlan], stored: Dict[str, Any],
               cache: Optional[PlanCache] = None) -> List[Tuple[CellPlan, bool, Optional[int]]]:
    """The order a row runs its cells in, as (cell, claim only, up to step): the claim's steps
    of every cell whose claim is not stored yet, or stored stale (:func:`stale_cell`), first
    (they decide the row), then each cell whole. A row judged step by step runs its cells
    step by step, each claim step in every cell before the next step, so each step is judged
    as soon as the cells' work for it is done."""
    cells = stored.get("cells") or {}

    def claim_stored(plan: CellPlan) -> bool:
        old = cells.get(plan.name) or {}
        return old.get("key") == plan.key and "claim_evidence" in old and not stale_cell(old, cache)

    stepwise = [(p, False, s) for s in (row.claim_steps if row.per_step else ()) for p in todo
                if s in p.call["steps"] and not p.call.get("utility")]
    return ([(p, True, None) for p in todo if claim_of(row, p) and not claim_stored(p)] + stepwise
            + [(p, False, None) for p in todo])


def open_passes(row: Row, stored: Dict[str, Any], plans: Sequence[CellPlan], run: Dict[str, Any],
                retry: bool = False, cache: Optional[PlanCache] = None) -> Iterator[Tuple[CellPlan, bool, Optional[int]]]:
    """The row's passes (:func:`row_passes`) over its cells still to run, each step pass left
    out where its step is settled when the pass comes (:func:`settled_steps`, read from
    ``stored`` as the run fills it in): the cell's work there runs in its whole pass."""
    for plan, claim_only, until_step in row_passes(row, cells_to_run(stored, plans, retry, cache), stored, cache):
        if until_step is None or until_step not in settled_steps(row, stored, plans, run, cache):
            yield plan, claim_only, until_step


def run_rows(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], out: Path, root: Path,
             retry: bool = False, deadline: Optional[Deadline] = None,
             after_row: Callable[[], None] = lambda: None) -> Optional[CallOver]:
    """Run the rows in turn (:func:`run_row`), ``after_row`` after each that finishes; a failing
    row is reported and the others still run. Under a ``deadline`` the first slice that does not
    fit stops them all: returns why (None: every row ran)."""
    for i, row in enumerate(rows, 1):
        print(f"[{time.strftime('%H:%M:%S')}] row {i}/{len(rows)} {row.id} ({profile.name})", flush=True)
        try:
            run_row(row, profile, data, data_args, out, root, retry=retry, deadline=deadline)
        except CallOver as over:
            return over
        except Exception as err:  # a failing row is reported; the others still run
            print(f"  row {row.id} failed: {type(err).__name__}: {err}", flush=True)
            continue
        after_row()
    return None
