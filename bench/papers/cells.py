"""A row's cells: what each profile runs (:func:`run_setting`), the ``audit.run`` call of
each cell (:func:`plan_cells`) and its key, and the row's cells in the store
(whole, with the claim's steps alone, or step by step)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.jsonable import to_jsonable
from bench.papers.cell_plan import CellPlan, Profile
from bench.papers.evidence import CellEvidence
from bench.papers.search import held_out_images, search_key
from bench.papers.spec import AT_PAPER, IMAGES, QUICK, Row
from bench.papers.stale import KEY_CHANGED, PlanCache, cell_fingerprints, stale_attacks, stale_key, stale_plan
from bench.papers.store import load_results, results_path


def run_setting(row: Row, profile: Profile) -> Dict[str, Any]:
    """What ``profile`` runs for ``row``: model arguments, budget (gradient evaluations per
    attack and image), steps, images, and the planner cell's attacks and budget."""
    s, paper = row.scale(profile.name), row.setting
    quick = profile.shrunk
    budget = QUICK["budget"] if quick else s.budget or paper.budget or row.budget_if_unstated
    steps = tuple(s.steps or paper.steps)
    images = profile.images or s.images or paper.images or IMAGES
    planner_budget = QUICK["budget"] if quick else s.planner_budget or row.planner_budget or min(budget, 1000)
    return {"model_args": dict(paper.model_args if s.model_args is None else s.model_args), "budget": budget,
            "steps": list(steps[:2] if quick else steps), "images": images,
            "planner": list(s.planner or ("auto",)), "planner_args": {k: dict(v) for k, v in s.planner_args.items()},
            "planner_budget": planner_budget,
            "adaptive_budget": QUICK["budget"] if quick else s.adaptive_budget or budget,
            "train_batch": paper.train_batch or 8,
            **({"attack_budgets": dict(s.attack_budgets)} if s.attack_budgets and not quick else {})}


def args_text(args: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in args.items()) or "defaults"


def differences(row: Row, run: Dict[str, Any]) -> List[str]:
    """How the run differs from the paper's setting, the data set aside (empty: at the paper's)."""
    paper, out = row.setting, []
    if run["model_args"] != paper.model_args:
        out.append(f"{row.model} with {args_text(run['model_args'])} (the paper's: {args_text(paper.model_args)})")
    if row.claim != "utility":
        if paper.budget is None:
            out.append(f"the paper states no iteration count; {run['budget']:,} gradient evaluations here")
        elif run["budget"] < paper.budget:
            its = max(1, run["budget"] // paper.restarts)
            out.append(f"{its:,} of {paper.iterations:,} iterations"
                       + (f" x {paper.restarts} restarts" if paper.restarts > 1 else ""))
        out.extend(f"{name} at {n:,} gradient evaluations" for name, n in below_budget(row, run).items())
        if list(run["steps"]) != list(paper.steps):
            out.append(f"steps {', '.join(map(str, run['steps']))} of {', '.join(map(str, paper.steps))}")
        if paper.images and run["images"] < paper.images:
            out.append(f"{run['images']} of {paper.images:,} images")
    if paper.train_optimizer and row.lr != paper.train_lr:
        out.append(f"training lr {row.lr:g} (the paper's: {paper.train_lr:g})")
    out.extend(row.differences)
    return out


def below_budget(row: Row, run: Dict[str, Any]) -> Dict[str, int]:
    """The row's paper attacks that ``run`` gives their own budget below the paper's (or where
    the paper states none), with that budget."""
    paper, own = row.setting.budget, run.get("attack_budgets") or {}
    return {a.name: own[a.name] for a in row.attacks if a.name in own and (paper is None or own[a.name] < paper)}


def label(row: Row, run: Dict[str, Any]) -> str:
    diff = differences(row, run)
    return AT_PAPER if not diff else "scaled: " + "; ".join(diff)


def own_text(row: Row, run: Dict[str, Any], data: str) -> str:
    used = "CIFAR-10 32x32" if data == "cifar10" else "the embedded 32x32 photos"
    parts = [f"{row.model} ({args_text(run['model_args'])})", used, "batch 1"]
    if row.claim != "utility":
        parts += [f"{run['budget']:,} gradient evaluations", f"{run['images']} images",
                  f"step{'s' if len(run['steps']) > 1 else ''} {', '.join(map(str, run['steps']))}"]
    if row.setting.train_batch:
        parts.append(f"training batch {run['train_batch']}")
    if row.setting.training_text(row.lr):
        parts.append(row.setting.training_text(row.lr).split(" (")[0])
    if row.setting.mode_text():
        parts.append(row.setting.mode_text())
    return "; ".join(parts)


def store_dir(row: Row, out: Path) -> Path:
    return out / (row.store or f"{row.defense}-{row.model}")


def base_call(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
              run: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword settings of ``audit.run`` shared by the row's paper cells."""
    utility = row.claim == "utility"
    return dict(defense=row.defense, defense_args=dict(row.defense_args), model=row.model,
                model_args=dict(run["model_args"]), data=data, data_args=data_args or None,
                steps=list(run["steps"]) if not utility else [0], images=run["images"] if not utility else 1,
                budget=run["budget"], batch_size=1, lr=row.lr, train_batch_size=run["train_batch"], utility=utility,
                utility_steps=4 if profile.shrunk else row.utility_steps,
                utility_seeds=2 if profile.shrunk else row.utility_seeds, device=profile.device,
                out=str(store_dir(row, out) / "paper"), progress=not profile.shrunk,
                # named only where they are not the default, so the other rows' cell keys stay as stored
                **({"client_mode": row.setting.client_mode} if row.setting.client_mode != "train" else {}),
                **({"server_optimizer": row.setting.train_optimizer} if row.setting.train_optimizer else {}))


def plan_cells(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
               searched: Optional[Dict[str, Dict[str, Any]]] = None) -> List[CellPlan]:
    """The row's cells (:func:`_row_cells`), sliced for a GPU call on the gpu profile."""
    cells = _row_cells(row, profile, data, data_args, out, searched)
    for cell in cells:
        cell.gpu = profile.name == "gpu"
    return cells


def _row_cells(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
               searched: Optional[Dict[str, Dict[str, Any]]] = None) -> List[CellPlan]:
    """The row's cells: the paper's attacks one by one (with the weights ``searched`` on
    held-out images where the row searches them) and its adaptive attack, in one engine store;
    the planner's attacks at their presets in another (``auto``, never the paper's settings)."""
    run = run_setting(row, profile)
    base = base_call(row, profile, data, data_args, out, run)
    if row.claim == "utility":
        return [CellPlan("utility", {**base, "attacks": ["ig"], "budget": QUICK["budget"]}, [0])]
    if row.chain:  # judged on the cells of the rows it orders
        return []
    steps = list(run["steps"])
    cells = []
    for a in row.attacks:
        args = {**a.args, **((searched or {}).get(a.name) or {})}
        paper_steps = [s for s in (row.paper_steps or steps) if s in steps]
        own = {"budget": run["attack_budgets"][a.name]} if a.name in run.get("attack_budgets", {}) else {}
        cells.append(CellPlan(f"paper:{a.name}", {**base, "steps": paper_steps, "attacks": [a.name],
                                                  "attack_args": {a.name: args} if args else None, **own},
                              paper_steps))
    if row.adaptive:
        adaptive_steps = [s for s in (row.adaptive_steps or steps) if s in steps]
        args = dict(row.adaptive.args)
        if profile.shrunk and row.adaptive.name == "learned-inverter":
            args.update(pairs=16, train_steps=5)
        cells.append(CellPlan("adaptive", {**base, "steps": adaptive_steps, "attacks": [row.adaptive.name],
                                           "attack_args": {row.adaptive.name: args} if args else None,
                                           "budget": run["adaptive_budget"]}, adaptive_steps))
    planner_args = dict(run["planner_args"])
    if profile.shrunk:
        planner_args["learned-inverter"] = {"pairs": 16, "train_steps": 5}
    cells.append(CellPlan("planner", {**base, "attacks": list(run["planner"]), "attack_args": planner_args or None,
                                      "budget": run["planner_budget"],
                                      "out": str(store_dir(row, out) / "planner")}, steps))
    return cells


def current_search_key(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path) -> str:
    """The key the row's held-out search has under the current settings and code (its probe:
    the row's first cell)."""
    probe = plan_cells(row, profile, data, data_args, out)[0]
    return search_key(row, probe, held_out_images(profile))


def stored_cells(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                 out: Path) -> Tuple[Dict[str, Any], Dict[str, Optional[CellEvidence]], List[CellPlan]]:
    """The row's stored results; per planned cell, its evidence when stored under the cell's
    current key (None: not run yet, or run with other settings); and the planned cells."""
    stored = load_results(results_path(root, profile.name, data, row))
    search = stored.get("search") or {}
    if row.search and search.get("key") != current_search_key(row, profile, data, data_args, out):
        search = {}  # searched with other settings: its choices, and the cells run with them, are stale
        stored = {**stored, "search": {}}
    plans = plan_cells(row, profile, data, data_args, out, search.get("chosen"))
    return stored, whole_cells(stored, plans), plans


def whole_cells(stored: Dict[str, Any], plans: Sequence[CellPlan]) -> Dict[str, Optional[CellEvidence]]:
    """Per planned cell, its evidence when stored whole under the cell's current key (None:
    not run yet, under way, or run with other settings)."""
    cells: Dict[str, Optional[CellEvidence]] = {}
    for plan in plans:
        cell = (stored.get("cells") or {}).get(plan.name)
        ok = cell is not None and cell.get("key") == plan.key
        cells[plan.name] = CellEvidence.from_dict(cell["evidence"]) if ok and cell.get("evidence") else None
    return cells


def judged_on(whole: Dict[str, Optional[CellEvidence]], claimed: Dict[str, CellEvidence],
              stepped: Dict[str, CellEvidence]) -> Dict[str, Optional[CellEvidence]]:
    """What each cell's claim is judged on: its ``whole`` evidence (:func:`whole_cells`), else
    its claim's steps (``claimed``, :func:`claim_cells`), else the claim steps complete so far
    (``stepped``, :func:`step_cells`)."""
    return {n: c if c is not None else claimed.get(n) or stepped.get(n) for n, c in whole.items()}


def claim_cells(stored: Dict[str, Any], plans: Sequence[CellPlan]) -> Dict[str, CellEvidence]:
    """Per cell under way whose claim's steps are complete (:func:`claim_record`, under the
    cell's current key), the evidence at those steps."""
    out = {}
    for plan in plans:
        cell = (stored.get("cells") or {}).get(plan.name) or {}
        if cell.get("key") == plan.key and cell.get("claim_evidence"):
            out[plan.name] = CellEvidence.from_dict(cell["claim_evidence"])
    return out


def planner_attacks(manifest: Dict[str, Any]) -> List[str]:
    """Every attack the planner's audit ran (its base attacks and the planner's picks)."""
    return [a["id"] for a in manifest.get("attacks") or []]


def claim_record(plan: CellPlan, attacks: Sequence[str], evidence: CellEvidence,
                 run_key: Optional[str] = None) -> Dict[str, Any]:
    """What a cell under way stores once the steps of the row's claim are complete: the claim's
    evidence (judged from it; the cell's other steps are still running), keyed as the cell is,
    with the engine's ``run_key`` it ran under."""
    return {"key": plan.key, "call": to_jsonable(plan.call), "attacks": list(attacks),
            "claim_evidence": evidence.to_dict(), "fingerprints": cell_fingerprints(plan.call, attacks),
            **({"run_key": run_key} if run_key else {})}


def step_record(plan: CellPlan, attacks: Sequence[str], step: int, evidence: CellEvidence,
                run_key: Optional[str] = None) -> Dict[str, Any]:
    """What a cell under way of a row judged step by step stores as one claim step's images
    complete: that step's evidence (``step_evidence``, joined with the steps stored before it
    under the same keys by :func:`add_step`), keyed as the cell is."""
    return {"key": plan.key, "call": to_jsonable(plan.call), "attacks": list(attacks),
            "step_evidence": {str(step): evidence.to_dict()}, "fingerprints": cell_fingerprints(plan.call, attacks),
            **({"run_key": run_key} if run_key else {})}


def add_step(old: Dict[str, Any], record: Dict[str, Any]) -> Dict[str, Any]:
    """The cell's stored record once :func:`step_record`'s ``record`` is added: joined with the
    steps ``old`` stores under the same cell key, engine run key and attacks; a record of the
    claim's steps or the whole cell is kept as it is."""
    if (old.get("key"), old.get("run_key")) == (record["key"], record.get("run_key")) and (
            "evidence" in old or "claim_evidence" in old):
        return old
    same = all(old.get(k) == record.get(k) for k in ("key", "run_key", "attacks"))
    if same and old.get("step_evidence"):
        return {**record, "step_evidence": {**old["step_evidence"], **record["step_evidence"]}}
    return record


def stored_steps(cell: Dict[str, Any], plan: CellPlan) -> List[int]:
    """The claim steps whose evidence the cell's record stores under the cell's current key."""
    if cell.get("key") != plan.key:
        return []
    if cell.get("claim_evidence"):
        return list(cell["claim_evidence"]["steps"])
    return sorted(int(s) for s in cell.get("step_evidence") or {})


def step_cells(stored: Dict[str, Any], plans: Sequence[CellPlan]) -> Dict[str, CellEvidence]:
    """Per cell under way of a row judged step by step, the evidence of the claim steps whose
    images are complete (:func:`step_record`, under the cell's current key), joined."""
    out = {}
    for plan in plans:
        cell = (stored.get("cells") or {}).get(plan.name) or {}
        if cell.get("key") == plan.key and cell.get("step_evidence"):
            out[plan.name] = CellEvidence.joined([CellEvidence.from_dict(e) for _, e in sorted(
                cell["step_evidence"].items(), key=lambda item: int(item[0]))])
    return out


def cells_to_run(stored: Dict[str, Any], plans: Sequence[CellPlan], retry: bool = False,
                 cache: Optional[PlanCache] = None) -> List[CellPlan]:
    """The planned cells not stored whole under their current key (stored with only their
    claim's steps, or some steps of a row judged step by step), with an attack default since
    changed, with a planner's plan since changed (where ``cache`` is given), or (``retry``) with
    missing evidence or no positive control beside their attacks' evidence. A cell that records
    no engine run key (it ran before cells recorded one) runs again so that it records one: the
    page shows it meanwhile, counted as unchecked."""
    todo = []
    for plan in plans:
        old = (stored.get("cells") or {}).get(plan.name) or {}
        evidence = old.get("evidence") or {}
        redo = retry and (evidence.get("missing") or (evidence.get("steps") and not evidence.get("control")))
        whole = ("evidence" in old or "utility" in old) and "claim_evidence" not in old
        keyed = bool(old.get("run_key"))
        if old.get("key") == plan.key and whole and keyed and not redo and not stale_cell(old, cache):
            continue
        todo.append(plan)
    return todo


def stale_cell(cell: Dict[str, Any], cache: Optional[PlanCache]) -> List[str]:
    """Why a stored cell no longer runs what the tool runs ([] where it does): each attack
    whose defaults changed, a changed engine run key (:func:`stale_key`) and (``cache`` given)
    each change of the planner's plan."""
    return stale_attacks(cell) + stale_key(cell) + (stale_plan(cell, cache) if cache is not None else [])


def stale_text(changes: Sequence[str]) -> str:
    """:func:`stale_cell`'s changes in words."""
    moved = [c for c in changes if c[:1] in "+-"]
    defaults = [c for c in changes if c not in moved and c != KEY_CHANGED]
    parts = ([f"the defaults of {', '.join(defaults)} changed"] if defaults else []) + (
        [f"the planner's plan changed ({', '.join(moved)})"] if moved else []) + (
        ["the engine's inputs changed (a defense's or model's code, a setting)"] if KEY_CHANGED in changes else [])
    return " and ".join(parts) + " since these cells ran"
