"""Before/after table: each adaptive attack against the naive attack it adapts, on the same
observations (small models, 16x16 embedded images, batch 1, fixed seeds).

``python -m bench.bench_adaptive [--images N] [--scenario NAME ...] [--docs adaptive]`` prints a
Markdown table of mean PSNR per attack (and writes it into ``docs/adaptive.md``);
:func:`run_scenarios` returns the rows.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from audit.core.models import build_model
from bench.docs_table import add_docs_option, publish

Attack = Tuple[str, Dict[str, Any]]


@dataclass
class Scenario:
    """A defense on a model, attacked by the naive attack and its adaptive counterparts."""

    name: str
    defense: str
    defense_args: Dict[str, Any]
    model: str
    attacks: List[Attack]
    budget: int = 200
    model_args: Dict[str, Any] = field(default_factory=dict)


TV = {"tv": 1e-2}
SCENARIOS = [
    Scenario("prune-90", "prune", {"ratio": 0.9}, "cnn",
             [("ig", TV), ("mask-replay", TV), ("through-defense", TV)]),
    Scenario("soteria-80", "soteria", {"ratio": 0.8, "layer": "largest"}, "cnn",
             [("ig", TV), ("layer-drop", TV), ("layer-drop", {**TV, "layers": "search"}), ("mask-replay", TV)]),
    Scenario("precode-mlp", "precode", {}, "mlp", [("ig", TV), ("analytic", {}), ("precode-latent", {})], 50),
    Scenario("precode-cnn", "precode", {}, "cnn", [("ig", TV), ("precode-latent", TV)], 150),
    Scenario("soft-prune-90", "soft-prune", {"prune_prob": 0.9, "sigma": 1e-4}, "cnn",
             [("ig", TV), ("through-defense", {**TV, "samples": 4})], 100),
    Scenario("gaussian-0.01", "gaussian", {"sigma": 0.01}, "cnn",
             [("ig", TV), ("bayes-l2", {}), ("through-defense", {**TV, "samples": 4})], 100),
    Scenario("svdefense", "svdefense", {}, "cnn",
             [("ig", TV), ("svd-subspace", TV), ("through-defense", TV), ("analytic", {})]),
    Scenario("censor", "censor", {}, "cnn",
             [("ig", TV), ("censor-invariants", TV), ("through-defense", {**TV, "samples": 2})], 100),
    Scenario("none", "none", {}, "cnn", [("ig", TV)]),
]


def _model(s: Scenario, data, seed: int) -> nn.Module:
    return build_model(s.model, data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=seed,
                       **s.model_args)


def run_scenarios(names: Optional[Sequence[str]] = None, images: int = 4, size: int = 16, seed: int = 0,
                  device="cpu", log: Callable[[str], None] = print) -> List[Dict[str, Any]]:
    """One row per (scenario, attack): mean PSNR over ``images`` private images and time."""
    import adaptive  # noqa: F401  (registers the adaptive attacks)
    from attacks import ATTACKS
    from audit.core.data import load_dataset
    from audit.core.metrics import psnr
    from audit.client.observe import observe
    from defenses import build_defense

    data = load_dataset("embedded", size=size)
    chosen = [s for s in SCENARIOS if names is None or s.name in names]
    rows = []
    for s in chosen:
        results: Dict[int, List[float]] = {i: [] for i in range(len(s.attacks))}
        seconds = [0.0] * len(s.attacks)
        for index in range(images):
            x, y = data.train_images[index:index + 1].to(device), data.train_labels[index:index + 1].to(device)
            defense = build_defense(s.defense, **s.defense_args)
            model = defense.wrap_model(_model(s, data, seed).to(device))
            obs = observe(model, x, y, defense, share_labels=True, seed=seed + index)
            for i, (attack, settings) in enumerate(s.attacks):
                start = time.perf_counter()
                rec = ATTACKS.build(attack, **settings).reconstruct(obs, s.budget, seed)
                seconds[i] += time.perf_counter() - start
                results[i].append(float(psnr(rec.inputs, x).mean()) if rec.applicable else float("nan"))
        for i, (attack, settings) in enumerate(s.attacks):
            label = attack + (f" ({', '.join(f'{k}={v}' for k, v in settings.items() if k != 'tv')})"
                              if any(k != "tv" for k in settings) else "")
            row = {"scenario": s.name, "model": s.model, "attack": label, "budget": s.budget,
                   "psnr": sum(results[i]) / len(results[i]), "per_image": results[i],
                   "seconds": seconds[i] / images}
            rows.append(row)
            log(f"{row['scenario']:<14} {row['attack']:<34} {row['psnr']:7.2f} dB  "
                f"{row['seconds']:6.1f} s/image  {[round(v, 1) for v in row['per_image']]}")
    return rows


def markdown(rows: List[Dict[str, Any]]) -> str:
    lines = ["| scenario | model | attack | iterations | mean PSNR (dB) | per image | s / image |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{v:.1f}" for v in r["per_image"])
        lines.append(f"| {r['scenario']} | {r['model']} | {r['attack']} | {r['budget']} | {r['psnr']:.2f} | "
                     f"{per} | {r['seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--scenario", action="append", choices=[s.name for s in SCENARIOS])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest here)")
    add_docs_option(parser, "docs/adaptive.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = markdown(run_scenarios(args.scenario, args.images))
    print(table)
    publish(args, "bench.bench_adaptive", argv, table, f"torch {torch.__version__}, {args.threads} thread(s), cpu")


if __name__ == "__main__":
    main()
