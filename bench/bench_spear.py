"""SPEAR against batch size and gaussian noise, side by side with `analytic` and `ig` on the
same private batches (``gia-audit attack`` end to end; docs/strength.md (SPEAR)).

An image counts as exact at PSNR >= 50 dB; "certified" says whether SPEAR's recovered batch
reproduced the upload within its tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.docs_table import add_docs_option, publish  # noqa: E402
from audit.engine.single import run_attack  # noqa: E402

EXACT_DB = 50.0


def cell(attack: str, model: str, batch: int, sigma: float, args) -> dict:
    """One attack on ``args.repeats`` private batches in a row (from ``args.index``)."""
    settings = {"samples": args.samples} if attack.startswith("spear") else {}
    psnrs, certified, seconds, applicable = [], 0, 0.0, True
    for k in range(args.repeats):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            metrics = run_attack(attack, model=model, batch=batch, index=args.index + k * batch, attack_args=settings,
                                 budget=None if attack == "spear" else args.budget,
                                 defense="gaussian" if sigma else None,
                                 defense_args={"sigma": sigma} if sigma else None, out=out, seed=args.seed,
                                 progress=False)
        seconds += time.perf_counter() - start
        if not metrics["applicable"]:
            applicable = False
            continue
        psnrs += [min(p, 200.0) for p in metrics["scores"]["psnr"].per_image]
        trace = metrics["trace"]
        inner = trace.get("spear")  # spear-ig: SPEAR's summary where its features were certified, else why not
        certified += bool(trace.get("certified") or isinstance(inner, dict))
    if not applicable and not psnrs:
        return {"exact": "n/a", "psnr": "n/a", "certified": "n/a", "seconds": f"{seconds:.0f}"}
    exact = sum(p >= EXACT_DB for p in psnrs)
    return {"exact": f"{exact}/{len(psnrs)}", "psnr": f"{sum(psnrs) / len(psnrs):.1f}",
            "certified": f"{certified}/{args.repeats}" if attack.startswith("spear") else "-",
            "seconds": f"{seconds / args.repeats:.0f}"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--batches", default="8,16")
    parser.add_argument("--sigmas", default="0,1e-5,1e-4")
    parser.add_argument("--attacks", default="spear,analytic,ig")
    parser.add_argument("--samples", type=int, default=1 << 18, help="SPEAR's most sampled row subsets")
    parser.add_argument("--budget", type=int, default=200, help="ig's gradient evaluations")
    parser.add_argument("--index", type=int, default=0, help="first held-out image of the first private batch")
    parser.add_argument("--repeats", type=int, default=1, help="private batches per cell, one after another")
    parser.add_argument("--seed", type=int, default=0)
    add_docs_option(parser, "docs/strength.md")
    args = parser.parse_args(argv)
    lines = ["| model | batch | gaussian sigma | attack | exact (PSNR >= 50 dB) | mean PSNR (dB) | certified batches "
             "| wall per batch (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            for sigma in map(float, args.sigmas.split(",")):
                for attack in args.attacks.split(","):
                    r = cell(attack, model, batch, sigma, args)
                    lines.append(f"| {model} | {batch} | {sigma:g} | {attack} | {r['exact']} | {r['psnr']} | "
                                 f"{r['certified']} | {r['seconds']} |")
                    print(lines[-1], flush=True)
    publish(args, "bench_spear.py", argv, "\n".join(lines))


if __name__ == "__main__":
    main()
