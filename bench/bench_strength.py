"""Attack strength at the field's standard settings, side by side with breaching 0.1.2.

For every cell (model x batch size x private batch of natural 32x32 photos that are not in
the embedded training crops) the bench makes the client's observation once, runs breaching's
``invertinggradients`` (1000 iterations) and ``deepleakage`` (300) on that very model (its
layers after our Normalize, the data set's mean / std as breaching's metadata), gradient and
labels, in this process; runs our attacks at **breaching's wall time** (a budget in gradient
evaluations calibrated by timed runs); and scores everything with the same code. ``--speed``
times one IG iteration against a forward + backward; ``--adaptive`` measures adaptive attacks
against the same attack on the clean gradient. ``--docs NAME`` writes the table into
``docs/strength.md``.

breaching is a bench-only extra (``pip install breaching==0.1.2 --no-deps hydra-core omegaconf
antlr4-python3-runtime==4.9.3``);
when it cannot be imported the bench says so and runs ours alone, at fixed budgets.

Usage (run on purpose, not in CI)::

    python -m bench.bench_strength --models convnet-nobn --batches 1 --images 2      # quick look
    python -m bench.bench_strength --threads 2 --json strength.json                 # the full matrix
    python -m bench.bench_strength --adaptive --images 4
    python -m bench.bench_strength --speed --models convnet-nobn,resnet18 --device cuda
    python -m bench.bench_strength --bn-weight --batches 1,4 --images 8 --budget 400   # the bn-upload weight
    python -m bench.bench_strength --bn-weight --weight-knob features --batches 1,4,8 --images 8 --budget 400  # the features weight
    python -m bench.bench_strength --upload --models convnet-bn-train --batches 1,4,8 --images 8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from attacks import ATTACKS, observe
from audit.core.errors import ConfigError, NotApplicable
from audit.core.metrics import score
from audit.core.models import build_model
from audit.core.registry import parse_kv_args
from audit.engine.settings import parse_attack_args
from bench.docs_table import add_docs_option, command_line, publish
from bench import strength_upload

# --------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class ModelCell:
    """A benchmark model: registered name, its arguments, the client's BatchNorm mode."""

    model: str
    args: Dict[str, Any] = field(default_factory=dict)
    mode: str = "eval"


BENCH_MODELS: Dict[str, ModelCell] = {
    "lenet": ModelCell("lenet", {}, "eval"),                       # DLG's sigmoid LeNet
    "convnet-nobn": ModelCell("convnet", {"batchnorm": False}, "eval"),
    "convnet-bn-train": ModelCell("convnet", {}, "train"),         # the audit's default client
    "convnet-bn-eval": ModelCell("convnet", {}, "eval"),
    "resnet18": ModelCell("resnet18", {}, "eval"),                 # CIFAR ResNet-18
    "resnet18-bn-train": ModelCell("resnet18", {}, "train"),       # the same, client in train mode
}
#: the matrix's attacks by default; conv-span applies only where a model's deep convolutions span
#: their inputs (ResNet-18), so it runs where asked for
DEFAULT_ATTACKS = ("dlg", "ig", "gi", "portfolio")
ATTACK_NAMES = DEFAULT_ATTACKS + ("conv-span",)
BREACHING_ITERATIONS = {"ig": 1000, "dlg": 300}
#: our attack -> the breaching attack whose wall time it gets
WALL_TIME_OF = {"dlg": "dlg", "ig": "ig", "gi": "ig", "portfolio": "ig", "conv-span": "ig"}

# natural photos shipped with scikit-learn, matplotlib and scikit-image, none of them (nor
# the crop regions of motorcycle_right) used by the embedded data set: (source, file, box)
# with box = (left, top, side) in pixels of the original picture
PHOTO_CROPS: List[Tuple[str, str, Tuple[int, int, int]]] = [
    ("sklearn", "china.jpg", (120, 40, 260)),      # temple roof
    ("sklearn", "flower.jpg", (160, 60, 300)),     # the flower
    ("matplotlib", "grace_hopper.jpg", (120, 60, 300)),  # face
    ("sklearn", "china.jpg", (380, 200, 200)),     # trees, lower right
    ("skimage", "motorcycle_right.png", (150, 60, 300)),
    ("sklearn", "flower.jpg", (20, 250, 170)),     # leaves, lower left
    ("matplotlib", "grace_hopper.jpg", (0, 300, 200)),   # uniform, lower left
    ("skimage", "motorcycle_right.png", (400, 150, 240)),
]


def _open_photo(source: str, filename: str):
    from PIL import Image

    if source == "sklearn":
        import sklearn.datasets

        images = sklearn.datasets.load_sample_images()
        names = [os.path.basename(f) for f in images.filenames]
        return Image.fromarray(images.images[names.index(filename)])
    if source == "matplotlib":
        import matplotlib

        return Image.open(os.path.join(matplotlib.get_data_path(), "sample_data", filename)).convert("RGB")
    import skimage.data

    return Image.open(os.path.join(os.path.dirname(skimage.data.__file__), filename)).convert("RGB")


def natural_images(count: int, size: int = 32) -> Tuple[torch.Tensor, List[str]]:
    """``count`` natural ``size`` x ``size`` RGB crops in [0, 1] and their names."""
    from PIL import Image

    if not 1 <= count <= len(PHOTO_CROPS):
        raise SystemExit(f"--images must be in 1..{len(PHOTO_CROPS)}, got {count}")
    out, names = [], []
    for source, filename, (left, top, side) in PHOTO_CROPS[:count]:
        pic = _open_photo(source, filename).crop((left, top, left + side, top + side))
        pic = pic.resize((size, size), Image.BICUBIC)
        out.append(torch.from_numpy(np.asarray(pic, dtype=np.float32) / 255.0).permute(2, 0, 1))
        names.append(f"{filename.split('.')[0]}@{left},{top}")
    return torch.stack(out), names


# ImageNet statistics as the models' normalisation (what a CIFAR / ImageNet client declares)
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_model(cell: ModelCell, classes: int, seed: int, device) -> torch.nn.Module:
    return build_model(cell.model, (3, 32, 32), classes, mean=MEAN, std=STD, seed=seed, **cell.args).to(device)


# --------------------------------------------------------------------------- breaching


def breaching_status() -> Tuple[bool, str]:
    """Whether breaching 0.1.2 can be imported next to our torch, and why not."""
    try:
        import logging

        logging.getLogger("breaching").setLevel(logging.WARNING)
        import breaching  # noqa: F401
        from omegaconf import OmegaConf  # noqa: F401
    except Exception as err:  # noqa: BLE001  (any import failure means: run ours alone)
        return False, (f"breaching cannot be imported ({type(err).__name__}: {err}); "
                       "pip install breaching==0.1.2 --no-deps hydra-core omegaconf antlr4-python3-runtime==4.9.3 "
                       "-- running ours alone")
    import importlib.metadata as md

    version = md.version("breaching")
    return version == "0.1.2", f"breaching {version}"


def _breaching_config(kind: str, iterations: int):
    """breaching's own attack config (its YAML files, defaults merged), iterations set."""
    from omegaconf import OmegaConf
    import breaching

    root = os.path.join(os.path.dirname(breaching.__file__), "config", "attack")
    base = OmegaConf.load(os.path.join(root, "_default_optimization_attack.yaml"))
    name = {"ig": "invertinggradients", "dlg": "deepleakage"}[kind]
    own = OmegaConf.load(os.path.join(root, f"{name}.yaml"))
    own.pop("defaults", None)
    cfg = OmegaConf.merge(base, own)
    cfg.optim.max_iterations = int(iterations)
    cfg.optim.callback = 10 ** 9
    return cfg


def run_breaching(kind: str, obs, labels: torch.Tensor, iterations: int, seed: int):
    """breaching's attack on the observation's model (after our Normalize layer) and gradient;
    ``labels`` given for IG, optimised jointly for DLG. Returns (images in [0, 1], labels, s)."""
    from omegaconf import OmegaConf
    import breaching

    device = obs.device
    body = obs.model[1:]  # our Normalize is breaching's metadata mean / std
    mean = obs.model[0].mean.flatten().tolist()
    std = obs.model[0].std.flatten().tolist()
    cfg = _breaching_config(kind, iterations)
    loss = torch.nn.CrossEntropyLoss()
    setup = dict(device=device, dtype=torch.float)
    attacker = breaching.attacks.prepare_attack(body, loss, cfg, setup)
    metadata = OmegaConf.create(dict(shape=list(obs.input_shape), mean=mean, std=std, modality="vision",
                                     classes=obs.num_classes, task="classification"))
    buffers = None if obs.client_mode == "train" else [b.detach() for b in body.buffers()]
    payload = [dict(parameters=[p.detach() for p in body.parameters()], buffers=buffers, metadata=metadata)]
    shared = [dict(gradients=[g.detach().clone() for g in obs.gradients], buffers=None,
                   metadata=dict(num_data_points=obs.batch_size, labels=None if kind == "dlg" else labels.to(device),
                                 local_hyperparams=None))]
    torch.manual_seed(seed)
    _sync(device)
    start = time.perf_counter()
    rec, _ = attacker.reconstruct(payload, shared, {}, dryrun=False)
    _sync(device)
    seconds = time.perf_counter() - start
    dm = torch.as_tensor(mean, device=device).view(1, -1, 1, 1)
    ds = torch.as_tensor(std, device=device).view(1, -1, 1, 1)
    out_labels = rec["labels"]
    if out_labels is not None and out_labels.dim() > 1:
        out_labels = out_labels.argmax(-1)
    return (rec["data"] * ds + dm).clamp(0, 1), out_labels, seconds


# --------------------------------------------------------------------------- ours


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(attack, obs, budget: int, seed: int):
    _sync(obs.device)
    start = time.perf_counter()
    rec = attack.reconstruct(obs, budget, seed, progress=lambda *a: None)
    _sync(obs.device)
    return rec, time.perf_counter() - start


def budget_for(name: str, obs, seconds: float, seed: int, settings: Optional[dict] = None) -> int:
    """Gradient evaluations of attack ``name`` that fit in ``seconds`` of wall time: after a
    warm-up run (which pays ``compile=true``'s one-off compilation, reported separately), the
    per-evaluation cost and fixed overhead from two short timed runs (8 and 40 evaluations),
    then checked by a run at a fifth of that budget (longer runs cost more per evaluation,
    e.g. L-BFGS's growing history), whose mean cost per evaluation is the floor."""
    attack = ATTACKS.build(name, **(settings or {}))
    timed(attack, obs, 2, seed)  # warm-up: a one-off compilation (compile=true) is not a per-evaluation cost
    small, large = 8, 40
    _, t_small = timed(attack, obs, small, seed)
    _, t_large = timed(attack, obs, large, seed)
    # the slope of the two runs, but never below a quarter of the larger run's mean cost: an
    # attack that stopped early (or timer noise) must not turn a second into a million evaluations
    per = max((t_large - t_small) / (large - small), 0.25 * t_large / large, 1e-6)
    overhead = max(t_small - small * per, 0.0)
    budget = max(small, int((seconds - overhead) / per))
    probe = budget // 5
    if probe > large:
        _, t_probe = timed(attack, obs, probe, seed)
        per = max(per, (t_probe - overhead) / probe)
        budget = max(small, int((seconds - overhead) / per))
    return budget


def evaluate(images, labels, truth, truth_labels, lpips: bool) -> Dict[str, float]:
    s = score(images, labels, truth, truth_labels, lpips=lpips)

    def value(k):
        v = s[k]
        return float(np.mean(v.value)) if getattr(v, "available", True) and v.value is not None else float("nan")

    return {k: value(k) for k in ("psnr", "ssim", "lpips", "label_accuracy")}


# --------------------------------------------------------------------------- one cell


def run_cell(model_name: str, batch: int, group: int, images: torch.Tensor, args, use_breaching: bool,
             log) -> List[Dict[str, Any]]:
    """Every attack (ours and breaching's) on one observation."""
    cell = BENCH_MODELS[model_name]
    device = torch.device(args.device)
    x = images[group * batch:(group + 1) * batch].to(device)
    y = torch.tensor([(3 * (group * batch + i) + 1) % 10 for i in range(batch)], device=device)
    model = make_model(cell, 10, args.seed, device)
    obs = observe(model, x, y, client_mode=cell.mode, seed=args.seed)
    lp = args.lpips
    rows, wall = [], {}
    base = dict(model=model_name, mode=cell.mode, batch=batch, group=group)
    if use_breaching:
        for kind in ("ig", "dlg"):
            if kind not in args.breaching_attacks:
                continue
            iterations = args.breaching_iterations.get(kind, BREACHING_ITERATIONS[kind])
            rec, lab, seconds = run_breaching(kind, obs, y, iterations, args.seed)
            wall[kind] = seconds
            row = dict(base, tool="breaching", attack=kind, budget=f"{iterations} it",
                       seconds=seconds, **evaluate(rec, lab, x, y, lp))
            rows.append(row)
            log(row)
    for name in args.attacks:
        seconds_target = wall.get(WALL_TIME_OF[name])
        try:
            settings = args.attack_args.get(name, {})
            timed_budget = seconds_target is not None and not args.fixed_budget
            budget = budget_for(name, obs, seconds_target, args.seed, settings) if timed_budget else args.budget
            rec, seconds = timed(ATTACKS.build(name, **settings), obs, budget, args.seed)
        except NotApplicable as err:  # e.g. gi's BN prior on a model without BatchNorm
            log(f"{model_name} batch {batch}: {name} does not apply ({err})")
            continue
        row = dict(base, tool="gia-audit", attack=name, budget=f"{budget} ev", seconds=seconds,
                   failed=bool(rec.trace.get("failed_to_optimise", False)),
                   **evaluate(rec.inputs, rec.labels, x, y, lp))
        rows.append(row)
        log(row)
    return rows


def run_matrix(args, log) -> Tuple[List[Dict[str, Any]], str]:
    ok, note = breaching_status() if args.breaching else (False, "breaching off (--no-breaching)")
    log(note)
    images, names = natural_images(args.images)
    log("images: " + ", ".join(names))
    rows = []
    for model_name in args.models:
        for batch in args.batches:
            for group in range(max(1, args.images // batch) if batch <= args.images else 0):
                rows += run_cell(model_name, batch, group, images, args, ok, log)
    return rows, note


# --------------------------------------------------------------------------- tables


def summarise(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Mean per (model, batch, tool, attack) over the private batches."""
    keys = []
    for r in rows:
        k = (r["model"], r["batch"], r["tool"], r["attack"])
        if k not in keys:
            keys.append(k)
    out = []
    for k in keys:
        group = [r for r in rows if (r["model"], r["batch"], r["tool"], r["attack"]) == k]
        mean = {m: statistics.fmean(r[m] for r in group) for m in ("psnr", "ssim", "lpips", "label_accuracy", "seconds")}
        out.append(dict(model=k[0], batch=k[1], tool=k[2], attack=k[3], n=len(group),
                        budget=group[0]["budget"], per_image=[round(r["psnr"], 1) for r in group],
                        failed=sum(bool(r.get("failed")) for r in group), **mean))
    return out


def markdown(summary: List[Dict[str, Any]]) -> str:
    lines = ["| model | batch | tool | attack | budget (first batch) | s | PSNR dB | per batch | SSIM | LPIPS | label acc | "
             "vs breaching IG / DLG (dB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        ref = {s["attack"]: s["psnr"] for s in summary
               if s["tool"] == "breaching" and s["model"] == r["model"] and s["batch"] == r["batch"]}
        versus = ""
        if r["tool"] != "breaching" and ref:
            versus = " / ".join(f"{r['psnr'] - ref[k]:+.1f}" if k in ref else "-" for k in ("ig", "dlg"))
        fail = f" ({r['failed']} failed)" if r.get("failed") else ""
        lines.append(f"| {r['model']} | {r['batch']} | {r['tool']} | {r['attack']}{fail} | {r['budget']} | "
                     f"{r['seconds']:.1f} | {r['psnr']:.2f} | {', '.join(map(str, r['per_image']))} | "
                     f"{r['ssim']:.3f} | {r['lpips']:.3f} | {r['label_accuracy']:.2f} | {versus} |")
    return "\n".join(lines)


def targets(summary: List[Dict[str, Any]]) -> str:
    """The strength targets as differences to breaching, from the same run."""
    def get(model, batch, tool, attack):
        for r in summary:
            if (r["model"], r["batch"], r["tool"], r["attack"]) == (model, batch, tool, attack):
                return r["psnr"]
        return None

    checks = [("IG +4 dB over breaching IG, convnet-nobn b1", "convnet-nobn", 1, "ig", "ig", 4.0),
              ("IG +3 dB over breaching IG, resnet18 b1", "resnet18", 1, "ig", "ig", 3.0),
              ("IG +3 dB over breaching IG, resnet18 b4", "resnet18", 4, "ig", "ig", 3.0),
              ("DLG >= breaching DLG, lenet b1", "lenet", 1, "dlg", "dlg", 0.0)]
    lines = ["| target | ours dB | breaching dB | difference | met |", "|---|---|---|---|---|"]
    for text, model, batch, ours, theirs, margin in checks:
        a, b = get(model, batch, "gia-audit", ours), get(model, batch, "breaching", theirs)
        if a is None or b is None:
            continue
        lines.append(f"| {text} | {a:.2f} | {b:.2f} | {a - b:+.2f} | {'yes' if a - b >= margin else 'no'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- speed


def speed(args, log) -> str:
    """ms per forward+backward of the model on the batch vs one IG iteration (ours, breaching)."""
    ok, _ = breaching_status() if args.breaching else (False, "")
    images, _ = natural_images(max(args.batches))
    device = torch.device(args.device)
    lines = ["| model | batch | fwd+bwd ms | our IG iteration ms | ratio | ours, `compile=true`, ms | ratio "
             "| its one-off compilation, s | breaching IG iteration ms | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model_name in args.models:
        cell = BENCH_MODELS[model_name]
        for batch in args.batches:
            x = images[:batch].to(device)
            y = torch.arange(batch, device=device) % 10
            model = make_model(cell, 10, args.seed, device)
            model.train(cell.mode == "train")
            obs = observe(model, x, y, client_mode=cell.mode, seed=args.seed)
            n = args.speed_iterations

            def fwd_bwd():
                for _ in range(n):
                    model.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(model(x), y).backward()

            def ours(k=n):
                ATTACKS.build("ig").reconstruct(obs, k, args.seed, progress=lambda *a: None)

            def compiled(k=n):  # each reconstruct compiles (a cache hit after the first)
                ATTACKS.build("ig", compile=True).reconstruct(obs, k, args.seed, progress=lambda *a: None)

            def theirs(k=n):
                run_breaching("ig", obs, y, k, args.seed)

            # an attack's per-iteration cost is the difference between runs of 2n and n iterations
            # (its set-up -- label inference, initialisation, the final evaluation -- cancels out);
            # each is divided by a forward + backward timed just before it, and the ratios' median
            # is reported: on shared cores the load drifts between the timings of one repeat
            timers = {"ours": (ours, lambda: ours(2 * n)), "compiled": (compiled, lambda: compiled(2 * n)),
                      **({"theirs": (theirs, lambda: theirs(2 * n))} if ok else {})}
            first = {}
            for k, (fn, _) in {"fwd_bwd": (fwd_bwd, None), **timers}.items():
                t = time.perf_counter()
                fn()  # warm-up (the compiled attack's first call compiles)
                first[k] = time.perf_counter() - t

            def seconds(fn) -> float:
                _sync(device)
                t = time.perf_counter()
                fn()
                _sync(device)
                return time.perf_counter() - t

            ms, ratio = {}, {}
            for _ in range(args.repeats):
                for k, (fn, double) in timers.items():
                    fb = seconds(fwd_bwd) / n
                    per = (seconds(double) - seconds(fn)) / n
                    ms.setdefault("fwd_bwd", []).append(fb)
                    ms.setdefault(k, []).append(per)
                    ratio.setdefault(k, []).append(per / fb)
            ms = {k: statistics.median(v) for k, v in ms.items()}
            ratio = {k: statistics.median(v) for k, v in ratio.items()}
            th = f"{1e3 * ms['theirs']:.2f} | {ratio['theirs']:.2f}" if "theirs" in ms else "- | -"
            compile_s = first["compiled"] - first["ours"]  # both ran n iterations and their set-up
            line = (f"| {model_name} | {batch} | {1e3 * ms['fwd_bwd']:.2f} | {1e3 * ms['ours']:.2f} | {ratio['ours']:.2f} "
                    f"| {1e3 * ms['compiled']:.2f} | {ratio['compiled']:.2f} | {compile_s:.1f} | {th} |")
            log(line)
            lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- adaptive

ADAPTIVE_SCENARIOS = [
    # (name, defense, defense args, adaptive attack, its settings)
    ("prune-90", "prune", {"ratio": 0.9}, "mask-replay", {}),
    ("prune-90", "prune", {"ratio": 0.9}, "through-defense", {}),
    ("soteria-80", "soteria", {"ratio": 0.8, "layer": "largest"}, "layer-drop", {}),
]


def adaptive_gap(args, log) -> str:
    """Each adaptive attack on its defense against the same base attack on the clean gradient:
    by default DLG's LeNet at 16x16 (``--adaptive-model``, ``--adaptive-model-arg``,
    ``--adaptive-size``), batch 1, same image, model, labels (shared) and budget."""
    import adaptive  # noqa: F401  (registers the adaptive attacks)
    from defenses import build_defense

    device = torch.device(args.device)
    size = args.adaptive_size
    images, names = natural_images(args.images, size=size)
    lines = ["| defense | attack | base attack on the clean gradient dB | base attack through the defense dB | "
             "adaptive attack dB | gap to clean (dB) | per image (clean / adaptive) |", "|---|---|---|---|---|---|---|"]
    base = {"tv": args.adaptive_tv} if args.adaptive_tv else {}
    for name, defense_name, dargs, attack, settings in ADAPTIVE_SCENARIOS:
        clean, naive, adapted = [], [], []
        for i in range(args.images):
            x, y = images[i:i + 1].to(device), torch.tensor([i % 10], device=device)
            model = build_model(args.adaptive_model, (3, size, size), 10, mean=MEAN, std=STD, seed=args.seed,
                                **args.adaptive_model_args).to(device)
            defense = build_defense(defense_name, **dargs)
            model = defense.wrap_model(model)
            obs_clean = observe(model, x, y, share_labels=True, seed=args.seed)
            obs_def = observe(model, x, y, defense, share_labels=True, seed=args.seed)
            for store, attack_name, extra, obs in ((clean, args.adaptive_base, {}, obs_clean),
                                                   (naive, args.adaptive_base, {}, obs_def),
                                                   (adapted, attack, settings, obs_def)):
                rec = ATTACKS.build(attack_name, **base, **extra).reconstruct(obs, args.adaptive_budget, args.seed,
                                                                            progress=lambda *a: None)
                store.append(evaluate(rec.inputs, rec.labels, x, y, False)["psnr"])
        c, n, a = (statistics.fmean(v) for v in (clean, naive, adapted))
        line = (f"| {name} | {attack} | {c:.2f} | {n:.2f} | {a:.2f} | {a - c:+.2f} | "
                f"{', '.join(f'{u:.1f}/{v:.1f}' for u, v in zip(clean, adapted))} |")
        log(line)
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def _csv(text: str) -> List[str]:
    return [t for t in text.split(",") if t]


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_csv, default=list(BENCH_MODELS), help=f"comma list of {list(BENCH_MODELS)}")
    p.add_argument("--batches", type=lambda s: [int(v) for v in _csv(s)], default=[1, 4, 8])
    p.add_argument("--images", type=int, default=8, help="natural photos in the pool (batch B uses images // B batches)")
    p.add_argument("--attacks", type=_csv, default=list(DEFAULT_ATTACKS))
    p.add_argument("--breaching-attacks", type=_csv, default=["ig", "dlg"])
    p.add_argument("--no-breaching", dest="breaching", action="store_false")
    p.add_argument("--breaching-iterations", type=lambda s: {k: int(v) for k, v in (kv.split("=") for kv in _csv(s))},
                   default={}, help="e.g. ig=200: fewer breaching iterations than its configs' (slow models on a CPU)")
    p.add_argument("--attack-arg", dest="attack_args", action="append", default=[], metavar="ATTACK.KEY=VALUE",
                   help="a setting of one of our attacks, e.g. dlg.restarts=1 (repeatable)")
    p.add_argument("--budget", type=int, default=1000, help="gradient evaluations when breaching is not run")
    p.add_argument("--fixed-budget", action="store_true",
                   help="give our attacks --budget even beside breaching, both wall times in the table (an attack "
                        "whose fixed costs swamp short timed runs, as conv-span's colour fit, is mis-sized by them)")
    p.add_argument("--lpips", action="store_true", help="score LPIPS (needs `gia-audit weights lpips`)")
    p.add_argument("--speed", action="store_true", help="only time an IG iteration against fwd+bwd")
    p.add_argument("--speed-iterations", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--adaptive", action="store_true", help="only the adaptive-attack gap")
    p.add_argument("--adaptive-model", default="lenet")
    p.add_argument("--adaptive-model-arg", dest="adaptive_model_args", action="append", default=[],
                   metavar="KEY=VALUE", help="a model argument, e.g. batchnorm=false")
    p.add_argument("--adaptive-size", type=int, default=16, help="image side for --adaptive")
    p.add_argument("--adaptive-base", default="ig")
    p.add_argument("--adaptive-budget", type=int, default=2000)
    p.add_argument("--adaptive-tv", type=float, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the raw rows here")
    strength_upload.add_options(p)
    strength_upload.add_audit_options(p)
    add_docs_option(p, "docs/strength.md", results="bench/results/strength/strength.md")
    args = p.parse_args(argv)
    try:  # the CLI's own parsers: the same value syntax as `gia-audit --attack-arg / --model-arg`
        args.attack_args = parse_attack_args(args.attack_args)
        args.adaptive_model_args = parse_kv_args(args.adaptive_model_args)
    except ConfigError as err:
        raise SystemExit(str(err))
    unknown = [m for m in args.models if m not in BENCH_MODELS] + [a for a in args.attacks if a not in ATTACK_NAMES]
    if unknown:
        raise SystemExit(f"unknown models / attacks {unknown}; models: {list(BENCH_MODELS)}, attacks: {ATTACK_NAMES}")
    torch.set_num_threads(args.threads)
    if "portfolio" in args.attacks:
        import attacks.portfolio  # noqa: F401  (registers the portfolio attack)

    def log(item):
        print(item if isinstance(item, str) else {k: (round(v, 3) if isinstance(v, float) else v)
                                                  for k, v in item.items()}, flush=True)

    command = command_line("bench.bench_strength", argv)
    setting = (f"torch {torch.__version__}, {args.threads} thread(s), device {args.device}"
               + (f" ({torch.cuda.get_device_name(0)})" if args.device.startswith("cuda") else ""))
    header = f"`{command}` -- {setting}"
    result: Dict[str, Any] = {"command": command, "header": header}
    device = torch.device(args.device)

    def model_named(name: str) -> torch.nn.Module:
        return make_model(BENCH_MODELS[name], 10, args.seed, device)

    if args.shared_forms:
        result["shared_forms"] = table = strength_upload.shared_form_audits(args, log)
        print(header + "\n\n" + table)
    elif args.adam_smoothing:
        result["adam_smoothing"] = table = strength_upload.adam_smoothing(args, model_named, log)
        print(header + "\n\n" + table)
    elif args.bn_weight:
        result["bn_weight"] = table = strength_upload.weight_sweep(args, model_named, log)
        print(header + "\n\n" + table)
    elif args.upload:
        ok, note = breaching_status() if args.breaching else (False, "breaching off (--no-breaching)")
        if not ok:
            raise SystemExit(f"--upload compares with breaching's IG, which is not available: {note}")
        result["upload"] = table = strength_upload.upload_matrix(args, model_named, natural_images, run_breaching,
                                                                  timed, evaluate, log)
        print(header + "\n\n" + table)
    elif args.speed:
        result["speed"] = table = speed(args, log)
        print(header + "\n\n" + table)
    elif args.adaptive:
        result["adaptive"] = table = adaptive_gap(args, log)
        print(header + "\n\n" + table)
    else:
        rows, note = run_matrix(args, log)
        summary = summarise(rows)
        result.update(rows=rows, summary=summary, breaching=note)
        table = markdown(summary)
        print("\n" + header + f"\n\n{note}\n\n" + table + "\n\n" + targets(summary))
    publish(args, "bench.bench_strength", argv, table, setting)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    return result


if __name__ == "__main__":
    main()
