"""Attack power: the positive control's budget search on every registered model, undefended.

For each model, ``gia-audit audit --model M --defense none --steps 0 --images 4 --budget auto
--no-utility``: the planned attacks (the base attacks, the model's classic attack, the planner's)
run on the undefended client at 200 gradient evaluations, doubled until they recover half the
images or reach the ceiling. The table says, per model, the budget each needs (or that the
ceiling was not enough: then every audit of that model is inconclusive without more power).
Each model's audit is stored under ``--out`` as it finishes and resumes from there (its run key
decides: a changed attack or setting recomputes).

    python -m bench.bench_control --docs power
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.docs_table import add_docs_option, publish

MODELS = ("lenet", "cnn", "mlp", "convnet", "convbig", "convnet9", "resnet18")


def measure(model: str, out: Path, images: int, max_budget: int, seed: int, device: str) -> Dict[str, Any]:
    """One model's undefended audit with the budget search; its row (kept in ``out/row.json``)."""
    import audit

    kept = out / "row.json"
    start = time.perf_counter()
    report = audit.run(defense="none", model=model, steps=[0], images=images, budget="auto", max_budget=max_budget,
                       utility=False, progress=False, out=out, seed=seed, device=device)
    data = report.data
    step = data["steps"][0]
    search = data["control"].get("search", {})
    row = {"model": model, "attacks": data["control"]["attacks"], "tried": search.get("tried", []),
           "budget": search.get("budget"), "recovered": step["verdict"]["recovered"], "images": step["verdict"]["images"],
           "rate": step["verdict"]["recovery_rate"], "verdict": data["verdict"]["label"],
           "best_attack": [e.get("best_attack") for e in step["worst_case"]["per_image"]],
           "seconds": round(time.perf_counter() - start, 1), "run_key": data["run_key"]}
    before = json.loads(kept.read_text()) if kept.is_file() else {}
    if before.get("run_key") == row["run_key"]:  # resumed from the stored results: keep the first run's time
        row["seconds"] = before["seconds"]
    kept.write_text(json.dumps(row, indent=2))
    return row


def table(rows: Sequence[Dict[str, Any]], max_budget: int) -> str:
    lines = ["| model | attacks planned | recovered at each budget tried | budget found | verdict undefended | "
             "recovered, 95% CI | seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        tried = ", ".join(f"{t['recovered']}/{t['images']} at {t['budget']}" for t in r["tried"])
        found = r["budget"] if r["recovered"] * 2 >= r["images"] else f"none up to {max_budget}"
        rate = r["rate"]
        lines.append(f"| {r['model']} | {', '.join(r['attacks'])} | {tried} | {found} | {r['verdict']} | "
                     f"{rate['k']} of {rate['n']} ({rate['low']:.0%}-{rate['high']:.0%}) | {r['seconds']} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="registered models, comma-separated")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--max-budget", type=int, default=None, help="the search's ceiling  [default: the audit's]")
    parser.add_argument("--out", default="bench-out/control", help="where each model's audit is kept (resumed)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    add_docs_option(parser, "docs/evidence.md")
    args = parser.parse_args(argv)
    import torch

    from audit.engine.settings import DEFAULT_MAX_BUDGET

    if args.threads:
        torch.set_num_threads(args.threads)
    ceiling = args.max_budget or DEFAULT_MAX_BUDGET
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        rows.append(measure(model, Path(args.out) / f"{model}-{args.images}-{ceiling}-{args.seed}", args.images,
                            ceiling, args.seed, args.device))
        print(table(rows[-1:], ceiling).splitlines()[-1], flush=True)
    text = table(rows, ceiling)
    print(text)
    publish(args, "bench.bench_control", argv, text, f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
