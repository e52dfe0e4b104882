"""A reference audit of one's own model: torchvision's ResNet-18 by ``package.module:attr`` on
CIFAR-10-format data from a local path, FedAvg clients, audited from scratch and at a
checkpoint trained for a few hundred FedAvg rounds on the same data, side by side: what leaks
at each state, which attacks carry it, and what the audit costs (seconds per (step, attack,
image) and in total). Both audits run the ``gia-audit audit`` command line printed first;
``--docs own-model`` rewrites the tables of ``docs/own-model.md``.

Usage (run on purpose, not in CI; the data ~5 s, the checkpoint ~15-30 min, the two audits
~30 min on 2 shared CPU cores)::

    python -m bench.bench_own_model --docs own-model
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

import cli
from audit.core.cache import CACHE_ENV
from audit.report.store import read_json
from bench import make_cifar_format, train_checkpoint
from bench.docs_table import add_docs_option, publish


def _command(args, out: Path, checkpoint: str = None) -> List[str]:
    """The ``gia-audit audit`` arguments of one of the two audits."""
    cmd = ["audit", "--model", args.model, "--dataset", "cifar10", "--data-path", args.data_path,
           "--defense", args.defense, "--batch-size", str(args.batch_size), "--images", str(args.images),
           "--steps", args.steps, "--clients", str(args.clients), "--local-steps", str(args.local_steps),
           "--lr", str(args.lr), "--train-batch-size", str(args.train_batch_size),
           "--utility-steps", str(args.utility_steps), "--seed", str(args.seed), "--quiet", "--out", str(out)]
    return cmd + (["--checkpoint", checkpoint] if checkpoint else [])


def _run(cmd: List[str]) -> Tuple[float, float]:
    """Wall and CPU seconds (this process, all threads) of one ``gia-audit`` command."""
    start, cpu = time.perf_counter(), time.process_time()
    try:
        cli.main(cmd, standalone_mode=False)
    except SystemExit as err:  # a one-line error: stop the bench with it
        if err.code:
            raise
    return time.perf_counter() - start, time.process_time() - cpu


def _fmt(value, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _leak_table(reports: Dict[str, Dict[str, Any]]) -> List[str]:
    """Per audited step and state: verdict, worst-case PSNR, the strongest attack, every attack's PSNR."""
    attacks = sorted({a for r in reports.values() for s in r["steps"] for a in s["attacks"]})
    lines = ["| model state | step | verdict | worst-case PSNR (dB) | strongest attack | "
             + " | ".join(f"{a} PSNR" for a in attacks) + " |",
             "|---|---:|---|---:|---|" + "---:|" * len(attacks)]
    for state, report in reports.items():
        for step in report["steps"]:
            per = step["attacks"]
            verdict = step["verdict"]
            lines.append(f"| {state} | {step['step']} | {verdict['label']} ({verdict.get('recovered', 0)} of "
                         f"{verdict.get('images', '?')} recovered) | {_fmt(step['worst_case'].get('psnr'), 2)} | "
                         f"{step.get('risk', {}).get('strongest_attack') or 'n/a'} | "
                         + " | ".join(_fmt(per.get(a, {}).get('psnr'), 2) for a in attacks) + " |")
    return lines


def _cost_table(reports: Dict[str, Dict[str, Any]], walls: Dict[str, Tuple[float, float]]) -> List[str]:
    """Seconds per (step, attack, image), by attack, and the audit's wall time and utility share."""
    lines = ["| model state | attack | results | s per (step, attack, image): mean | min | max |",
             "|---|---|---:|---:|---:|---:|"]
    for state, report in reports.items():
        by_attack: Dict[str, List[float]] = {}
        for rec in report["results"]:
            if rec.get("time_s") is not None:
                by_attack.setdefault(rec["attack"], []).append(float(rec["time_s"]))
        for attack, times in sorted(by_attack.items()):
            lines.append(f"| {state} | {attack} | {len(times)} | {statistics.mean(times):.1f} | {min(times):.1f} | "
                         f"{max(times):.1f} |")
    lines += ["", "| model state | whole audit: wall (s) | CPU (s) | of which utility training, all runs: CPU-thread (s) | "
                  "test accuracy after the utility's rounds, undefended: mean ± std (seeds) |", "|---|---:|---:|---:|---:|"]
    for state, report in reports.items():
        util = report.get("utility") or {}
        runs = [run for key in ("defended", "undefended") for run in ((util.get(key) or {}).get("runs") or ())]
        seconds = sum(run.get("seconds") or 0 for run in runs) or None
        base = util.get("undefended") or {}
        accuracy = (f"{base['mean']:.3f} ± {_fmt(base.get('std'), 3)} ({base.get('seeds')})"
                    if base.get("mean") is not None else util.get("unavailable") or "n/a")
        wall, cpu = walls[state]
        lines.append(f"| {state} | {wall:.0f} | {cpu:.0f} | {_fmt(seconds, 0)} | {accuracy} |")
    return lines


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    train_checkpoint.add_training_options(p)
    p.add_argument("--checkpoint", default="bench-data/resnet18-r300.pt", help="trained first when missing")
    p.add_argument("--defense", default="none")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--steps", default="0,10")
    p.add_argument("--utility-steps", type=int, default=50)
    p.add_argument("--out", default="bench-data/own-model")
    add_docs_option(p, "docs/own-model.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (Path(args.data_path) / "cifar-10-batches-py" / "test_batch").is_file():
        make_cifar_format.main(["--out", args.data_path, "--seed", str(args.seed)])
    trained = None
    if not Path(args.checkpoint).is_file():
        trained = train_checkpoint.train_from_options(args, Path(args.checkpoint))
    info = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    runs = {"from scratch": _command(args, Path(args.out) / "scratch"),
            f"checkpoint, round {info.get('rounds', '?')}": _command(args, Path(args.out) / "checkpoint",
                                                                     args.checkpoint)}
    walls, reports = {}, {}
    # a fresh cache of trained artefacts (the learned inverter): the wall time is a first audit's
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="own-model-cache-")
    for state, cmd in runs.items():
        print("gia-audit " + shlex.join(cmd), flush=True)
        walls[state] = _run(cmd)
        reports[state] = read_json(Path(cmd[cmd.index("--out") + 1]) / "report.json")
        print(f"{state}: {walls[state][0]:.0f} s wall, {walls[state][1]:.0f} s CPU, verdict "
              f"{reports[state]['verdict']}", flush=True)
    text = "\n".join([
        f"Machine: {args.threads} torch threads, {os.cpu_count()} CPU cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end, {platform.machine()}, torch {torch.__version__}. The checkpoint: "
        f"{info.get('rounds', '?')} FedAvg rounds ({info.get('clients', '?')} clients x {info.get('local_steps', '?')} "
        f"local steps, batch {info.get('batch_size', '?')}, lr {info.get('lr', '?')}), test accuracy "
        f"{_fmt(info.get('test_accuracy'), 3)}, trained in {_fmt(info.get('seconds'), 0)} s"
        + (" (this run)." if trained else "."), "",
        "The two commands:", "", "```bash",
        *[f"gia-audit {shlex.join(cmd)}" for cmd in runs.values()], "```", "",
        "What leaks, per audited step:", "", *_leak_table(reports), "",
        "What it costs (the seconds of a (step, attack, image) are its share of the (step, attack) group, "
        "which runs every private batch of the step at once):", "", *_cost_table(reports, walls)])
    print("\n" + text)
    publish(args, "bench.bench_own_model", argv, text)
    return text


if __name__ == "__main__":
    main()
