"""The Bayes-optimal adversary and the learned inverter: the Bayes paper's Table 2 and
synthetic check, and the learned inverter under defenses.

Three tables, each printed as Markdown:

* ``table2`` -- PSNR of the Bayes-optimal adversary against the L2 / L1 / cosine baselines
  (``bayes-l2`` / ``bayes-l1`` / ``bayes-cos``) under Gaussian, Laplacian, soft-prune +
  Gaussian and soft-prune + Laplacian noise, on held-out embedded images, at step 0 and
  after ``--late-step`` FL training steps. Every attack gets the same budget, init and
  optimiser and the same two-stage prior-weight search: decades 1e-2 .. 1e4 on the first
  image, then x{1/3, 1, 3} around the best on all images; the best mean is reported.
* ``synthetic`` -- x ~ N(0, I_20), y = argmax(Wx), 2-layer MLP, Laplace noise: mean
  distance ||x_hat - x|| of the four (prior, conditional) choices among Gaussian / Laplace.
* ``inverter`` -- the learned inverter (trained), the same inverter untrained, and IG, on
  held-out images under defenses that cripple gradient matching.

Usage::

    python -m bench.bench_bayes table2 --images 4 --iterations 100 --late-step 100
    python -m bench.bench_bayes synthetic --samples 16 --seeds 0,1,2
    python -m bench.bench_bayes inverter --images 8 --budget 200

Run on purpose, not in CI (minutes on a CPU).
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from adaptive.bayes.optimal import BayesOptimalAttack
from adaptive.bayes.priors import GaussianPrior, LaplacePrior
from adaptive.inverter.attack import LearnedInverter
from attacks import ATTACKS
from audit.core.data import load_dataset
from audit.client.fl import train
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.client.observe import observe
from defenses import build_defense

COARSE = tuple(10.0 ** e for e in range(-2, 5))
REFINE = (1 / 3, 1.0, 3.0)


def held_out(dataset, n: int, offset: int = 0) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``n`` test-split images spread evenly over the split (so over the classes), batch size 1."""
    stride = max(1, len(dataset.test_labels) // n)
    return [(dataset.test_images[i:i + 1], dataset.test_labels[i:i + 1])
            for i in (offset + j * stride for j in range(n))]


def colour_floor(private) -> float:
    """Mean PSNR of each private image's own mean colour (a flat image): what a reconstruction
    that recovers nothing but the average colour scores; low-contrast tiles score high."""
    return sum(float(psnr(x.mean(dim=(2, 3), keepdim=True).expand_as(x), x)) for x, _ in private) / len(private)


def mean_psnr(build: Callable, observations, iterations: int) -> float:
    scores = [float(psnr(build().reconstruct(obs, iterations, 0).inputs, x).mean()) for obs, x in observations]
    return sum(scores) / len(scores)


def tuned(build: Callable[[float], object], observations, iterations: int) -> Tuple[float, float]:
    """The two-stage prior-weight search; ``(best mean PSNR, its weight)``."""
    coarse = {w: mean_psnr(lambda: build(w), observations[:1], iterations) for w in COARSE}
    centre = max(coarse, key=coarse.get)
    fine = {centre * f: mean_psnr(lambda: build(centre * f), observations, iterations) for f in REFINE}
    best = max(fine, key=fine.get)
    return fine[best], best


# --------------------------------------------------------------------------- Table 2
def table2(args) -> None:
    data = load_dataset("embedded", size=args.size)
    s = args.noise
    defenses = {  # name -> (defense, unit of the Bayes prior weight: the likelihood's scale)
        "Gaussian": (build_defense("gaussian", sigma=s), 1 / (2 * s ** 2)),
        "Laplacian": (build_defense("laplacian", sigma=s), 1 / s),
        "Prune+Gauss": (build_defense("soft-prune", prune_prob=0.5, sigma=s, noise="gaussian"), 1 / (2 * s ** 2)),
        "Prune+Lap": (build_defense("soft-prune", prune_prob=0.5, sigma=s, noise="laplacian"), 1 / s),
    }
    attacks: Dict[str, Callable[[float, float], object]] = {
        "Bayes": lambda w, unit: ATTACKS.build("bayes-optimal", beta=w * unit),
        "L2": lambda w, unit: ATTACKS.build("bayes-l2", tv=w),
        "L1": lambda w, unit: ATTACKS.build("bayes-l1", tv=w),
        "Cos": lambda w, unit: ATTACKS.build("bayes-cos", tv=w),
    }
    model0 = build_model("cnn", data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=args.seed)
    late = build_model("cnn", data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=args.seed)
    train(late, data, None, args.late_step, lr=0.1, batch_size=8, seed=args.seed)
    private = held_out(data, args.images)
    header = "| defense | " + " | ".join(f"{a} @{st}" for st in (0, args.late_step) for a in attacks) + " |"
    print(f"\nTable 2 analogue: embedded {args.size}x{args.size}, Bayes-paper CNN, noise {s}, "
          f"{args.images} held-out images, {args.iterations} Adam iterations, PSNR dB (prior weight)\n")
    print(f"(reference: the private images' own flat mean colour scores {colour_floor(private):.2f} dB)\n")
    print(header)
    print("|" + "---|" * (1 + 2 * len(attacks)))
    for dname, (defense, unit) in defenses.items():
        cells = []
        for model in (model0, late):
            obs = [(observe(model, x, y, defense, seed=i), x) for i, (x, y) in enumerate(private)]
            for build in attacks.values():
                value, weight = tuned(lambda w: build(w, unit), obs, args.iterations)
                cells.append(f"{value:.2f} ({weight:.2g})")
        print(f"| {dname} | " + " | ".join(cells) + " |", flush=True)


# --------------------------------------------------------------------------- synthetic check
def synthetic(args) -> None:
    d, classes, scale, b = 20, 5, 0.125, args.noise
    priors = {"Gaussian": GaussianPrior(0.5, scale), "Laplace": LaplacePrior(0.5, scale / math.sqrt(2))}
    likelihoods = {"Laplace": {"likelihood": "laplacian", "b": b},
                   "Gaussian": {"likelihood": "gaussian", "sigma": b * math.sqrt(2)}}
    print(f"\nSynthetic check: x ~ N(0, I_{d}), y = argmax(Wx) ({classes} classes), MLP 20-32-{classes}, "
          f"Laplace({b}) noise; mean ||x_hat - x|| over {args.samples} samples (||x|| ~ {math.sqrt(d):.1f})\n")
    seeds = [int(s) for s in args.seeds.split(",")]
    print("| prior | conditional | " + " | ".join(f"seed {s}" for s in seeds) + " |")
    print("|---|---|" + "---|" * len(seeds))
    results = {(p, c): [] for p in priors for c in likelihoods}
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(classes, d, generator=gen)
        model = build_model("mlp", (1, 1, d), classes, mean=(0.5,), std=(scale,), seed=seed, hidden=(32,))
        defense = build_defense("laplacian", sigma=b)
        dist = {k: [] for k in results}
        for n in range(args.samples):
            x = torch.randn(1, d, generator=gen)
            pixels = (0.5 + scale * x).view(1, 1, 1, d)
            obs = observe(model, pixels, (x @ w.T).argmax(1), defense, share_labels=True, seed=n)
            for (p, c) in dist:
                attack = BayesOptimalAttack(prior=priors[p], beta=1.0, box="none", init="gray", lr=0.03,
                                            iterations=args.iterations, **likelihoods[c])
                dist[(p, c)].append(float(((attack.reconstruct(obs, seed=n).inputs - pixels) / scale).norm()))
        for k, v in dist.items():
            results[k].append(sum(v) / len(v))
    for (p, c), v in results.items():
        mark = " (true)" if (p, c) == ("Gaussian", "Laplace") else ""
        print(f"| {p}{mark} | {c}{mark} | " + " | ".join(f"{a:.3f}" for a in v) + " |")


# --------------------------------------------------------------------------- learned inverter
def inverter(args) -> None:
    data = load_dataset("embedded", size=args.size)
    model = build_model("lenet", data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=args.seed)
    defenses = {
        "prune 99%": build_defense("prune", ratio=0.99),
        "quantize 1 bit": build_defense("quantize", bits=1),
        "soft-prune + noise 0.05": build_defense("soft-prune", sigma=0.05),
        "svdefense": build_defense("svdefense"),
        "none": None,
    }
    inv = LearnedInverter(pairs=args.pairs, hidden=args.hidden, progress=False, cache=False)
    private = held_out(data, args.images, offset=3)
    print(f"\nLearned inverter: embedded {args.size}x{args.size} (aux = train split, {len(data.train_labels)} "
          f"images; private = test split), LeNet, {args.pairs} pairs, MLP {args.hidden}, {args.budget} "
          f"training steps; mean PSNR dB over {args.images} held-out images (their own flat mean colour "
          f"scores {colour_floor(private):.2f} dB)\n")
    print("| defense | trained inverter | untrained inverter | IG (cosine+TV, 200 it.) | train time s |")
    print("|---|---|---|---|---|")
    for name, defense in defenses.items():
        obs = [(observe(model, x, y, defense, seed=i), x) for i, (x, y) in enumerate(private)]
        start = time.process_time()
        trained = inv.fit(obs[0][0], args.budget)
        seconds = time.process_time() - start
        untrained = inv.fit(obs[0][0], 0)
        row = []
        for net in (trained, untrained):
            row.append(sum(float(psnr(net.invert(o.gradients).clamp(0, 1), x)) for o, x in obs) / len(obs))
        row.append(mean_psnr(lambda: ATTACKS.build("ig"), obs, 200))
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in row) + f" | {seconds:.1f} |", flush=True)


def main(argv: Sequence[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("table", choices=("table2", "synthetic", "inverter"))
    parser.add_argument("--size", type=int, default=16, help="image side")
    parser.add_argument("--images", type=int, default=4, help="held-out images")
    parser.add_argument("--iterations", type=int, default=100, help="attack iterations")
    parser.add_argument("--late-step", type=int, default=100, help="FL steps before the second column block")
    parser.add_argument("--noise", type=float, default=None, help="noise scale (table2: 0.01, synthetic: 0.3)")
    parser.add_argument("--samples", type=int, default=16, help="synthetic inputs per seed")
    parser.add_argument("--seeds", default="0,1,2", help="synthetic: comma-separated seeds")
    parser.add_argument("--budget", type=int, default=200, help="inverter training steps")
    parser.add_argument("--pairs", type=int, default=1024, help="inverter training pairs")
    parser.add_argument("--hidden", type=int, default=512, help="inverter MLP width")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.noise is None:
        args.noise = 0.3 if args.table == "synthetic" else 0.01
    start = time.time()
    {"table2": table2, "synthetic": synthetic, "inverter": inverter}[args.table](args)
    print(f"\n({time.time() - start:.0f} s wall)")


if __name__ == "__main__":
    main()
