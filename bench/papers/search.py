"""The held-out grid search of the prior weights and learning rates of a row's attacks (the
Bayes rows: the paper's App. A.3), on test images that the row's evaluation images do not include."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Sequence

from bench.papers.cell_plan import CellPlan, Profile
from bench.papers.spec import QUICK, Row

#: the held-out grid search of the Bayes rows' attacks (the paper's App. A.3 searches the prior
#: weight on a log scale, then learning rate and decay around the best): per attack its prior
#: weight's name and values, crossed with :data:`SEARCH_LR`; the best mean PSNR on held-out images wins
SEARCH = {"bayes-optimal": ("prior_weight", (0.1, 1.0, 10.0)), "bayes-l2": ("tv", (1e-3, 1e-2, 1e-1)),
          "bayes-l1": ("tv", (1e-3, 1e-2, 1e-1)), "bayes-cos": ("tv", (1e-3, 1e-2, 1e-1))}
SEARCH_LR = (0.1, 0.5)
#: a best value at the grid's edge extends the grid a decade further that way, up to this many
#: times, so the chosen value is bracketed by worse ones wherever the extensions allow (on
#: held-out images the L2 attack at TV weight w and the Bayes attack under Gaussian noise at
#: prior weight w score alike, and their first grids are two decades apart)
SEARCH_EXTEND = 4
HELD_OUT = 8


def held_out_images(profile: Profile) -> int:
    """Held-out images of a row's search under ``profile`` (fewer on a shrunk profile)."""
    return QUICK["held_out"] if profile.shrunk else HELD_OUT


def search_key(row: Row, plan: CellPlan, held_out: int) -> str:
    from audit.report.store import settings_key

    base = {k: v for k, v in plan.call.items() if k not in ("out", "progress", "attacks", "attack_args")}
    fixed = {a.name: a.args for a in row.attacks if a.args}  # e.g. the attacks' start
    return settings_key({"call": base, "grid": SEARCH, "lr": SEARCH_LR, "held_out": held_out,
                         "extend": SEARCH_EXTEND, **({"attacks": fixed} if fixed else {})}, 16)


def search_weights(row: Row, plan: CellPlan, held_out: int) -> Dict[str, Any]:
    """The grid search on ``held_out`` test images that the row's evaluation images do not
    include (the private draw's next ones), at the row's step and budget: per attack, mean PSNR
    of every grid point and the chosen one."""
    import torch

    import adaptive  # noqa: F401  (registers the adaptive attacks)
    from attacks import ATTACKS
    from audit.core.metrics import psnr
    from audit.engine.audit import Audit, _private_batches, audit_settings
    from audit.engine.compose import reconstruct
    from audit.report.store import ResultStore

    call = dict(plan.call)
    flat = {k: v for k, v in call.items() if k not in ("defense", "defense_args")}
    auditor = Audit(call["defense"], defense_args=call["defense_args"], **audit_settings(**flat))
    store = ResultStore.create(call["out"], auditor.key_settings())
    step = plan.steps[0]
    states, failure = auditor.checkpoints(store, [step])
    if step not in states:
        raise RuntimeError(f"no model at step {step}: {failure}")
    model = copy.deepcopy(auditor.model)
    model.load_state_dict(states[step])
    held = _private_batches(auditor.dataset, call["images"] + held_out, 1, auditor.seed)[call["images"]:]
    observations = [auditor.observe(model, x, y, step, 100_000 + i) for i, (x, y) in enumerate(held)]
    table: Dict[str, List[List[float]]] = {}
    chosen: Dict[str, Dict[str, Any]] = {}
    fixed = {a.name: dict(a.args) for a in row.attacks}  # the row's own settings of each attack
    for name, (knob, values) in SEARCH.items():
        rows: List[List[float]] = []

        def measure(value: float) -> None:
            for lr in SEARCH_LR:
                attack = ATTACKS.build(name, **{**fixed.get(name, {}), knob: value, "lr": lr})
                scores = []
                for i, (obs, (x, _)) in enumerate(zip(observations, held)):
                    rec = reconstruct(attack, obs, call["budget"], 1000 + i, None)
                    scores.append(float(psnr(rec.inputs.clamp(0, 1), x).mean()) if rec.inputs is not None else 0.0)
                rows.append([value, lr, sum(scores) / len(scores)])

        searched_grid(values, measure, rows)
        best = max(rows, key=lambda r: r[2])
        table[name] = rows
        chosen[name] = {knob: best[0], "lr": best[1]}
    del torch
    return {"chosen": chosen, "table": table, "held_out": held_out}


def searched_grid(values: Sequence[float], measure: Callable[[float], None], rows: List[List[float]],
                  extend: int = SEARCH_EXTEND) -> None:
    """Measure every value (``measure`` appends ``[value, lr, score]`` rows), then, while the
    best lies at the edge of what was tried, a decade further that way, at most ``extend`` times."""
    for value in values:
        measure(value)
    for _ in range(extend):
        best = max(rows, key=lambda r: r[2])[0]
        tried = sorted({r[0] for r in rows})
        if best not in (tried[0], tried[-1]):
            return
        measure(best * 10 if best == tried[-1] else best / 10)


def search_edge(search: Dict[str, Any], name: str) -> str:
    """`` (at the searched grid's edge)`` when the chosen value of ``name``'s prior weight is the
    largest or smallest tried (the extensions ran out), else empty."""
    knob = SEARCH.get(name, (None,))[0]
    tried = sorted({row[0] for row in (search.get("table") or {}).get(name) or []})
    value = (search.get("chosen") or {}).get(name, {}).get(knob)
    return " (at the searched grid's edge)" if tried and value in (tried[0], tried[-1]) else ""
