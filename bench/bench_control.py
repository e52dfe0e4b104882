"""Attack power: the positive control's budget search on every registered model, undefended.

For each model, at batch 1 and 4 and (for a model with BatchNorm) in train and eval mode,
``gia-audit audit --model M --defense none --steps 0 --batch B --client-mode MODE --budget auto
--no-utility`` on 4 images: the planned attacks run on the undefended client at 200 gradient
evaluations, doubled until they recover half the images or reach a ceiling (``--max-budget``,
``--max-minutes``). The table says, per cell, the budget found (or which ceiling ended the
search: then every audit of that model there is inconclusive without more power) and the
control's k of n.

Each finished cell is kept in ``bench/results/control/results.jsonl`` (a line keyed by the cell's
name) with the engine's run key it ran under; a rerun skips a cell whose key is today's and redoes
one whose key changed (an attack's, model's or setting's change). The engine's own stores go
under ``--out`` (resumed within a sitting).

    python -m bench.bench_control --docs power
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.docs_table import add_docs_option, publish
from bench.jsonl import Lines

MODELS = ("lenet", "mlp", "cnn", "convnet", "convbig", "convnet9", "resnet18")
#: the models whose client mode matters: they hold BatchNorm layers
BATCHNORM = ("convnet", "convnet9", "resnet18")
RESULTS = Lines.of("control").path


def cells(models: Sequence[str], batches: Sequence[int], modes: Sequence[str]) -> List[Dict[str, Any]]:
    """Every (model, batch, mode) cell; a model without BatchNorm runs in one mode (train)."""
    return [{"model": m, "batch": b, "mode": mode} for m in models for b in batches
            for mode in (modes if m in BATCHNORM else modes[:1])]


def call_of(cell: Dict[str, Any], images: int, max_budget: int, max_minutes: float, seed: int, device: str,
            out: Path) -> Dict[str, Any]:
    """The ``audit.run`` fields of one cell: ``images`` private images in batches of its size."""
    return dict(defense="none", model=cell["model"], steps=[0], images=max(1, images // cell["batch"]),
                batch_size=cell["batch"], client_mode=cell["mode"], budget="auto", max_budget=max_budget,
                max_minutes=max_minutes, utility=False, progress=False, seed=seed, device=device, out=str(out))


def run_key(call: Dict[str, Any]) -> str:
    """The engine's run key of ``call`` today (a changed attack, model or setting changes it)."""
    from audit.engine.audit import Audit
    from audit.engine.config import config_of_call
    from audit.report.store import settings_key

    return settings_key(Audit.from_config(config_of_call(**call)).key_settings())


def measure(cell: Dict[str, Any], call: Dict[str, Any], key: str) -> Dict[str, Any]:
    """One cell's undefended audit with the budget search; its row."""
    import audit

    start = time.perf_counter()
    data = audit.run(**call).data
    step = data["steps"][0]
    search = data["control"].get("search", {})
    return {**cell, "key": key, "attacks": data["control"]["attacks"], "tried": search.get("tried", []),
            "budget": search.get("budget"), "stopped_by": search.get("stopped_by", ""),
            "recovered": step["verdict"]["recovered"], "images": step["verdict"]["images"],
            "rate": step["verdict"]["recovery_rate"], "verdict": data["verdict"]["label"],
            "seconds": round(time.perf_counter() - start, 1)}


def stored(lines: Lines, name: str, key: str) -> Optional[Dict[str, Any]]:
    """The row kept under ``name`` when it ran under ``key``; None (to be run) otherwise."""
    row = lines.get(name)
    return row if isinstance(row, dict) and row.get("key") == key else None


STOPS = {"recovered": "{budget}", "max_budget": "none up to {max_budget} (the budget ceiling)",
         "max_minutes": "none within {max_minutes:g} min (the time ceiling; {budget} tried last)"}


def table(rows: Sequence[Dict[str, Any]], max_budget: int, max_minutes: float) -> str:
    lines = ["| model | client mode | batch | attacks planned | recovered at each budget tried | budget found | "
             "control recovers, 95% CI | verdict undefended | minutes |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "tried" not in r:  # a cell not run under today's key yet
            mode = r["mode"] if r["model"] in BATCHNORM else "(no BatchNorm)"
            lines.append(f"| {r['model']} | {mode} | {r['batch']} | not measured yet | | | | | |")
            continue
        tried = ", ".join(f"{t['recovered']}/{t['images']} at {t['budget']}" for t in r["tried"])
        found = STOPS.get(r["stopped_by"], "{budget}").format(budget=r["budget"], max_budget=max_budget,
                                                               max_minutes=max_minutes)
        mode = r["mode"] if r["model"] in BATCHNORM else "(no BatchNorm)"
        rate = r["rate"]
        lines.append(f"| {r['model']} | {mode} | {r['batch']} | {', '.join(r['attacks'])} | {tried} | {found} | "
                     f"{rate['k']} of {rate['n']} ({rate['low']:.0%}-{rate['high']:.0%}) | {r['verdict']} | "
                     f"{r['seconds'] / 60:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="registered models, comma-separated")
    parser.add_argument("--batches", default="1,4", help="private batch sizes, comma-separated")
    parser.add_argument("--modes", default="train,eval", help="client modes of the models with BatchNorm")
    parser.add_argument("--images", type=int, default=4, help="private images per cell")
    parser.add_argument("--max-budget", type=int, default=None, help="the search's ceiling  [default: the audit's]")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="the search's time ceiling  [default: the audit's]")
    parser.add_argument("--out", default="bench-out/control", help="where each cell's audit is kept (resumed)")
    parser.add_argument("--results", default=str(RESULTS), help="the finished cells (a JSON Lines store)")
    parser.add_argument("--render", action="store_true", help="write the table from the kept cells; run nothing")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    add_docs_option(parser, "docs/evidence.md")
    args = parser.parse_args(argv)
    import torch

    from audit.engine.fields import default_of

    if args.threads:
        torch.set_num_threads(args.threads)
    ceiling = args.max_budget or default_of("max_budget")
    minutes = args.max_minutes or default_of("max_minutes")
    results = Lines(Path(args.results))
    rows = []
    todo = cells([m for m in args.models.split(",") if m], [int(b) for b in args.batches.split(",")],
                 [m for m in args.modes.split(",") if m])
    for cell in todo:
        name = f"{cell['model']}-b{cell['batch']}-{cell['mode']}-i{args.images}-s{args.seed}-{args.device}"
        call = call_of(cell, args.images, ceiling, minutes, args.seed, args.device, Path(args.out) / name)
        key = run_key(call)
        row = stored(results, name, key)
        if row is None and args.render:
            row = cell
        elif row is None:
            row = measure(cell, call, key)
            results.put(name, row)
        rows.append(row)
        print(table(rows[-1:], ceiling, minutes).splitlines()[-1], flush=True)
    text = table(rows, ceiling, minutes)
    print(text)
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--render"]
    publish(args, "bench.bench_control", argv, text, f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
