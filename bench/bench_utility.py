"""Which utility recipe converges: candidate protocols trained without a defense on the default
model and data, their test accuracy over seeds (mean, spread), and what they cost.

    python -m bench.bench_utility [--protocols NAME,...] [--seeds 9] [--jobs 2] [--docs utility]

Each protocol runs on the audit's three utility seeds (those of ``seed=0``) and on further
seeds (those of ``seed=1, 2``): the spread of the three is what an audit shows, the spread of
all of them estimates it with an interval. Every finished run is stored in
``bench/results/utility/results.jsonl`` (a line keyed by the protocol's name and everything that
changes its number) and reused, so a rerun resumes. ``--docs utility`` writes the table into
``docs/evidence.md``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from audit.engine.utility import (PROTOCOL, UTILITY_THREADS, Protocol, train_over_seeds,
                                  utility_seeds)
from bench.docs_table import add_docs_option, publish
from bench.jsonl import Lines

STORE = Lines.of("utility")
MODEL, DATA, SIZE = "cnn", "embedded", 32
AUDIT_SEEDS = 3  # the utility seeds of one audit
BUDGET_S = 300.0  # the undefended measurement of an audit, on one core
TARGET_STD = 0.02  # the spread over the audit's seeds a protocol must reach

#: the candidates: the audit's former recipe (its FL settings, 100 rounds) and converging ones
CANDIDATES: Dict[str, Protocol] = {
    "fl-100": Protocol(100, 0.1, 8, "constant"),
    "b8-1500-cos": Protocol(1500, 0.05, 8, "cosine"),
    "b16-400-cos": Protocol(400, 0.05, 16, "cosine"),
    "b16-800-cos": Protocol(800, 0.05, 16, "cosine"),
    "b16-1600-cos": Protocol(1600, 0.05, 16, "cosine"),
    "b32-400-cos": Protocol(400, 0.1, 32, "cosine"),
    "b32-600-cos": Protocol(600, 0.1, 32, "cosine"),
    "b32-600-const": Protocol(600, 0.1, 32, "constant"),
    "avg4x4-25-cos": Protocol(25, 0.1, 32, "cosine", clients=4, local_steps=4),
}


def run_seeds(count: int) -> List[int]:
    """The audit's utility seeds first, then those of the next base seeds."""
    out: List[int] = []
    base = 0
    while len(out) < count:
        out += utility_seeds(base, AUDIT_SEEDS)
        base += 1
    return out[:count]


def run_key(protocol: Protocol, seed: int) -> Dict[str, Any]:
    return {"protocol": asdict(protocol), "model": MODEL, "data": DATA, "size": SIZE, "seed": seed,
            "threads": UTILITY_THREADS, "torch": torch.__version__.split("+")[0]}


def stored_run(name: str, protocol: Protocol, seed: int) -> Optional[Dict[str, Any]]:
    return STORE.get([name, run_key(protocol, seed)])


def save_run(name: str, run: Dict[str, Any]) -> None:
    STORE.put([name, run["key"]], run, sort_keys=True)


def train_one(protocol: Protocol, seed: int) -> Dict[str, Any]:
    """One undefended training run of ``protocol`` (what an audit's utility runs per seed)."""
    from audit.core.data import load_dataset
    from audit.engine.compose import resolve_defense

    data = load_dataset(DATA, size=SIZE)
    cpu = time.process_time()
    run = train_over_seeds(resolve_defense("none"), data, [seed], model=MODEL, model_args=None, protocol=protocol,
                           device=torch.device("cpu")).runs[0]
    return {"key": run_key(protocol, seed), "seed": seed, "accuracy": run.accuracy, "final_loss": run.final_loss,
            "diverged_at": run.diverged_at, "error": run.error, "wall_s": run.seconds,
            "cpu_s": time.process_time() - cpu}


def std_interval(std: float, n: int, level: float = 0.95) -> Tuple[float, float]:
    """The chi-square interval of a normal standard deviation from a sample std of ``n`` values."""
    from scipy.stats import chi2

    df = n - 1
    return (std * math.sqrt(df / chi2.ppf(0.5 + level / 2, df)), std * math.sqrt(df / chi2.ppf(0.5 - level / 2, df)))


def summarise(name: str, protocol: Protocol, seeds: Sequence[int]) -> Optional[Dict[str, Any]]:
    runs = [stored_run(name, protocol, s) for s in seeds]
    done = [r for r in runs if r is not None]
    audit = [r for r in runs[:AUDIT_SEEDS] if r is not None]
    if len(audit) < AUDIT_SEEDS:
        return None
    acc = [r["accuracy"] for r in done if r["accuracy"] is not None]
    audit_acc = [r["accuracy"] for r in audit if r["accuracy"] is not None]
    std_all = statistics.stdev(acc) if len(acc) >= 2 else None
    return {"name": name, "protocol": protocol, "runs": len(done), "mean": statistics.fmean(acc),
            "std": std_all, "std_ci": std_interval(std_all, len(acc)) if std_all is not None else None,
            "min": min(acc), "max": max(acc), "audit_mean": statistics.fmean(audit_acc),
            "audit_std": statistics.stdev(audit_acc) if len(audit_acc) >= 2 else None,
            "diverged": sum(r["diverged_at"] is not None for r in done),
            "cpu_s": AUDIT_SEEDS * statistics.fmean(r["cpu_s"] for r in done),
            "wall_s": sum(r["wall_s"] for r in audit)}


def _pts(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def table(rows: Sequence[Dict[str, Any]]) -> str:
    lines = ["| protocol | recipe | images seen | test accuracy over all seeds: mean ± std (min-max; runs) | "
             "std, 95% CI | the audit's 3 seeds: mean ± std | CPU s, 3 seeds | wall s, 3 seeds | chosen |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["protocol"]
        seen = p.rounds * p.clients * p.local_steps * p.batch_size
        lo, hi = r["std_ci"] or (None, None)
        div = f"; {r['diverged']} diverged" if r["diverged"] else ""
        chosen = "**yes**" if p == PROTOCOL else ""
        lines.append(f"| {r['name']} | {p.text()} | {seen:,} ({seen / 480:.0f} epochs) | "
                     f"{_pts(r['mean'])}% ± {_pts(r['std'])} ({_pts(r['min'])}-{_pts(r['max'])}; {r['runs']}{div}) | "
                     f"{_pts(lo)}-{_pts(hi)} | {_pts(r['audit_mean'])}% ± {_pts(r['audit_std'])} | "
                     f"{r['cpu_s']:.0f} | {r['wall_s']:.0f} | {chosen} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocols", default=",".join(CANDIDATES), help="comma-separated candidate names")
    parser.add_argument("--seeds", type=int, default=9, help="training seeds per protocol (the audit's 3 first)")
    parser.add_argument("--jobs", type=int, default=2, help="training runs at once (one thread each)")
    add_docs_option(parser, "docs/evidence.md")
    args = parser.parse_args(argv)
    names = [n for n in args.protocols.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown protocol(s) {', '.join(unknown)}; known: {', '.join(CANDIDATES)}")
    seeds = run_seeds(args.seeds)
    todo = [(n, s) for s in seeds for n in names if stored_run(n, CANDIDATES[n], s) is None]  # seed-major
    print(f"{len(todo)} training runs to go ({len(names) * len(seeds) - len(todo)} stored)", flush=True)
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=get_context("spawn")) as pool:
        futures = {pool.submit(train_one, CANDIDATES[n], s): n for n, s in todo}
        for future in as_completed(futures):
            name, run = futures[future], future.result()
            save_run(name, run)
            print(f"{name} seed {run['seed']}: {_pts(run['accuracy'])}% in {run['cpu_s']:.0f} CPU s", flush=True)
    rows = [r for r in (summarise(n, CANDIDATES[n], seeds) for n in names) if r is not None]
    text = table(rows)
    print(text)
    publish(args, "bench.bench_utility", argv, text,
            f"torch {torch.__version__.split('+')[0]}, {UTILITY_THREADS} thread per run, model {MODEL}, data {DATA}")


if __name__ == "__main__":
    main()
