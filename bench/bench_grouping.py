"""Model calls of an audit at 1 and at N private images, per attack: the launch proxy.

On a GPU the audit is bound by kernel launches, and each Python call of the model's
``forward`` launches its kernels once, whatever the batch. A (step, attack) group that runs
as one batched program calls the model about as often for N images as for 1; an attack that
runs image by image calls it N times as often. This bench audits a small BatchNorm CNN whose
``forward`` counts its calls (step 0, no utility), once with 1 private image and once with
N, and prints the calls of every attack (and of the rest: probing, training, scoring) side
by side with their ratio. Calls are counts, not times: the ratios hold on any machine.

Usage (run on purpose, not in CI)::

    python -m bench.bench_grouping --images 8 --defenses prune,gaussian --docs grouping
"""
from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict
from typing import Dict, List

import torch
from torch import nn

from bench.docs_table import add_docs_option, publish


class CountingNet(nn.Module):
    """A small CNN with BatchNorm whose Python ``forward`` counts its calls."""

    calls = 0

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
            nn.Flatten(), nn.Linear(512, num_classes))

    def forward(self, x):
        CountingNet.calls += 1
        return self.body(x)


def counted_audit(defense: str, images: int, budget: int, seed: int, device: str,
                  attacks: str) -> Dict[str, int]:
    """Model calls per attack (and ``"other"``: everything else) of one step-0 audit."""
    from audit.engine import audit as engine, schedule

    per_attack: Dict[str, int] = defaultdict(int)
    original = schedule.attack_claimed

    def counting_step(self, store, spec, observations, step, group_images, bar):
        before = CountingNet.calls
        try:
            return original(self, store, spec, observations, step, group_images, bar)
        finally:
            per_attack[spec.id] += CountingNet.calls - before

    CountingNet.calls = 0
    schedule.attack_claimed = counting_step
    try:
        with tempfile.TemporaryDirectory() as out:
            engine.run(defense=defense, model=CountingNet, model_normalize="none", steps=[0], images=images,
                       budget=budget, seed=seed, out=out, utility=False, progress=False, device=device,
                       attacks=attacks)
    finally:
        schedule.attack_claimed = original
    per_attack = dict(per_attack)
    per_attack["other"] = CountingNet.calls - sum(per_attack.values())
    per_attack["total"] = CountingNet.calls
    return per_attack


def table(rows: List[List[str]]) -> str:
    head = ["defense", "attack", "calls, 1 image", "calls, N images", "N / 1"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--defenses", default="prune", help="built-in defenses, comma-separated")
    p.add_argument("--images", type=int, default=8, help="N, the private images of the second audit")
    p.add_argument("--budget", type=int, default=100)
    p.add_argument("--attacks", default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    add_docs_option(p, "docs/performance.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for defense in args.defenses.split(","):
        one = counted_audit(defense, 1, args.budget, args.seed, args.device, args.attacks)
        many = counted_audit(defense, args.images, args.budget, args.seed, args.device, args.attacks)
        for name in [k for k in one if k not in ("other", "total")] + ["other", "total"]:
            a, b = one.get(name, 0), many.get(name, 0)
            ratio = f"{b / a:.2f}" if a else "n/a"
            label = f"**{name}**" if name == "total" else name
            rows.append([defense, label, str(a), str(b), f"**{ratio}**" if name == "total" else ratio])
            print(f"{defense:>10} {name:>20} {a:>7} {b:>7} {ratio:>6}", flush=True)
    setting = f"N = {args.images}, budget {args.budget}, step 0, no utility, {args.device}, torch {torch.__version__}"
    publish(args, "bench.bench_grouping", argv, table(rows), setting)


if __name__ == "__main__":
    main()
