"""Is the default budget enough? The default audit's per-step verdicts against a 10x budget.

For each defense (``prune`` and ``none`` by default) the default audit (cnn, 32x32 embedded
images, steps 0/1/5/20, 4 private images, attacks "auto") runs at ``--budget`` and at
``--factor`` times it; the table lists each step's verdict and worst-case PSNR side by side.
The default budget is adequate when every step's verdict is the same at both.

Usage (run on purpose, not in CI; ~30 minutes on 2 CPU cores)::

    python -m bench.bench_budget --budget 200 --factor 10 --out /tmp/budget-check
"""
from __future__ import annotations

import argparse
import os
import time

import torch

import audit
from bench.docs_table import add_docs_option, publish


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--defenses", default="prune,none")
    p.add_argument("--budget", type=int, default=200)
    p.add_argument("--factor", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="budget-check")
    add_docs_option(p, "docs/strength.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for defense in args.defenses.split(","):
        reports = {}
        for budget in (args.budget, args.factor * args.budget):
            start = time.perf_counter()
            reports[budget] = audit.run(defense=defense, budget=budget, utility=False, progress=False, seed=args.seed,
                                        device=args.device, out=os.path.join(args.out, f"{defense}-{budget}"))
            print(f"{defense} at budget {budget}: {time.perf_counter() - start:.0f} s, verdict {reports[budget].verdict}",
                  flush=True)
        low, high = reports[args.budget], reports[args.factor * args.budget]
        for a, b in zip(low.steps, high.steps):
            rows.append((defense, a["step"], a["verdict"]["label"], b["verdict"]["label"],
                         a["worst_case"].get("psnr"), b["worst_case"].get("psnr"),
                         a["worst_case"]["per_image"][0].get("best_attack") if a["worst_case"].get("per_image") else None))
    lines = [f"| defense | step | verdict at {args.budget} | verdict at {args.factor * args.budget} | "
             f"worst-case PSNR at {args.budget} | at {args.factor * args.budget} | same verdict |",
             "|---|---:|---|---|---:|---:|---|"]
    for defense, step, v1, v2, p1, p2, _ in rows:
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {defense} | {step} | {v1} | {v2} | {fmt(p1)} | {fmt(p2)} | {'yes' if v1 == v2 else 'NO'} |")
    table = "\n".join(lines)
    print("\n" + table)
    publish(args, "bench.bench_budget", argv, table, f"torch {torch.__version__}, {args.threads} thread(s), "
                                                   f"device {args.device}")
    return rows


if __name__ == "__main__":
    main()
