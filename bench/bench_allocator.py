"""The kept heap against glibc's defaults: one short audit, side by side in the same run.

Each case runs ``gia-audit audit --attacks ig --budget B --steps 0 --no-utility`` in a fresh
process, once with the heap kept (:mod:`audit.core.allocator`, the default) and once with
``GIA_AUDIT_KEEP_MEMORY=0``, alternating, and prints wall, user and system seconds and the
page faults of each, with their ratio. The ratio is the measurement; absolute times depend
on the machine.

Usage (run on purpose, not in CI)::

    python -m bench.bench_allocator --models resnet18,cnn --images 8 --budget 20 --docs allocator
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from audit.core.allocator import OPT_OUT
from bench.docs_table import add_docs_option, publish

MODES = {"kept": "1", "glibc default": "0"}


def one_audit(model: str, images: int, budget: int, kept: str, seed: int, device: str) -> Dict[str, float]:
    """Wall, user and system seconds and minor page faults of one audit in a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "cli", "audit", "--model", model, "--defense", "none", "--steps", "0",
                   "--images", str(images), "--no-utility", "--attacks", "ig", "--budget", str(budget),
                   "--seed", str(seed), "--device", device, "--out", out]
        started = time.perf_counter()
        subprocess.run(command, env=dict(os.environ, **{OPT_OUT: kept}), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime,
            "faults": after.ru_minflt - before.ru_minflt}


def table(rows: List[List[str]]) -> str:
    head = ["model", "heap", "wall s", "user s", "system s", "page faults", "wall vs default"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet18,cnn")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--budget", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each case, alternating; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    add_docs_option(parser, "docs/device.md")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        best: Dict[str, Dict[str, float]] = {}
        for _ in range(args.repeats):
            for mode, value in MODES.items():
                got = one_audit(model, args.images, args.budget, value, args.seed, args.device)
                print(model, mode, {k: round(v, 1) for k, v in got.items()}, flush=True)
                if mode not in best or got["wall"] < best[mode]["wall"]:
                    best[mode] = got
        for mode, got in best.items():
            ratio = got["wall"] / best["glibc default"]["wall"]
            rows.append([model, mode, f"{got['wall']:.1f}", f"{got['user']:.1f}", f"{got['sys']:.1f}",
                         f"{got['faults'] / 1e6:.2f}M", f"{ratio:.2f}x"])
    text = table(rows)
    print(text)
    setting = f"{args.images} images, ig at budget {args.budget}, {os.cpu_count()} CPU cores, device {args.device}"
    publish(args, "bench.bench_allocator", argv, text, setting)


if __name__ == "__main__":
    main()
