"""What a client really uploads, measured: the cells of ``bench_strength.py --upload`` and
``--bn-weight`` (docs/strength.md, "The batch statistics in the upload").

* ``--bn-weight``: the bn-upload term's weight (:func:`attacks.side_information.upload_weight`)
  chosen on held-out embedded test images (not the benchmark photos), batch sizes 1 and 4.
* ``--upload``: BatchNorm in train mode, the client uploading its state after one local step:
  breaching's IG (its default configuration, which reads no buffers) against our ``ig`` with
  the buffers (and without them, same budget), at breaching's wall time (the two tools' speeds
  measured back to back, :func:`matched_budget`); FedAvg with 3 local
  steps of SGD with momentum 0.9 and of Adam: the attack that unrolls the client's real
  optimiser against one that assumes plain SGD, at the same budget.

Every finished cell is stored in ``bench/results/strength/results.jsonl`` (a line keyed
``strength-upload/<cell>-<hash of everything that changes its numbers>``), so a rerun resumes and
a changed setting reruns only its cells.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import statistics
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from scipy.stats import binomtest

from attacks import ATTACKS, local_surrogate, observe
from audit.core.data import load_dataset
from audit.core.local_training import LocalOptimizer
from attacks.feature_rule import observed_features
from attacks.side_information import upload_weight
from attacks.tv_rule import observed_tv
from audit.core.buffers import norm_layers
from bench.jsonl import Lines

RESULTS = Lines.of("strength")
#: the folder (beside the store) of the shared-form audits' reports, and their rows' key prefix
UPLOAD_AUDITS = "upload-audits"
WEIGHTS = (0.01, 0.03, 0.1, 0.3, 1.0)
FEDAVG_CELLS = {  # name -> (optimizer, local lr)
    "sgd-momentum": ("sgd:momentum=0.9", 0.01),  # Flower's PyTorch quickstart: SGD(lr=0.01, momentum=0.9)
    "adam": ("adam", 0.001),
}

#: the FedAvg cells' models and the mode their client trains in
FEDAVG_MODES = {"convnet-bn-train": "train", "convnet-nobn": "eval", "lenet": "eval"}


def _key(parts: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stored(parts: Dict[str, Any], compute: Callable[[], Dict[str, Any]], log) -> Dict[str, Any]:
    """The cell's stored result, or ``compute()``'s, stored before it is returned."""
    key = f"strength-upload/{parts['cell']}-{_key(parts)}"
    kept = RESULTS.get(key)
    if kept is not None:
        log(f"stored: {key}")
        return kept["result"]
    row = compute()
    RESULTS.put(key, {"key": parts, "result": row})
    return row


def _default_weight(model) -> float:
    """The bn-upload term's default weight on ``model`` (keys the cells that run it)."""
    return upload_weight(len(norm_layers(model)))


def _psnr(rec, truth) -> List[float]:
    return _psnr_of(rec.inputs, truth)


@functools.lru_cache(maxsize=None)
def _code_version(without: Tuple[str, ...] = ()) -> str:
    """The files that define what these cells measure (the bn-upload term, the unroll, the
    buffers, the ``ig`` preset and its TV, features and run-length rules; ``without`` those a
    cell does not consult), read once per run: editing them reruns the cells. Changes that
    keep the numbers (the engine's speed) do not."""
    root = Path(__file__).resolve().parent.parent
    files = [f for f in ("priors/batchnorm.py", "priors/features.py", "audit/core/unroll.py", "audit/core/buffers.py",
                         "audit/core/local_training.py", "attacks/presets.py", "attacks/tv_rule.py",
                         "attacks/feature_rule.py", "attacks/budget_rule.py")
             if f not in without]
    # the default weight is keyed where it is used (the cells that run "auto"), not through the code
    text = b"".join(line for f in files for line in (root / f).read_bytes().splitlines(keepends=True)
                    if not line.startswith(b"BN_UPLOAD_WEIGHT ="))
    return hashlib.sha256(text).hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def _file_version(name: str) -> str:
    """One file's content hash: keys the cells of the attack it defines (the portfolio's rules)."""
    return hashlib.sha256((Path(__file__).resolve().parent.parent / name).read_bytes()).hexdigest()[:12]


# --------------------------------------------------------------------------- the weight
def _held_out_batch(data, batch: int, group: int, distinct: bool):
    """Held-out batch ``group`` of the embedded test split (sorted by class): consecutive images,
    or (``distinct``) one image of each of ``batch`` consecutive classes, as the photos' cells
    label theirs, so every image has a label of its own."""
    if not distinct:
        return data.test_images[group * batch:(group + 1) * batch], data.test_labels[group * batch:(group + 1) * batch]
    by_class = {c: (data.test_labels == c).nonzero().flatten().tolist() for c in range(data.num_classes)}
    picks = [group * batch + k for k in range(batch)]
    index = [by_class[p % data.num_classes][p // data.num_classes] for p in picks]
    return data.test_images[index], data.test_labels[index]


#: ``--weight-knob run_length``: ``ig`` with its weights from the observation as the rules give
#: them for a run of unknown length (their 400-iteration values), or moved by the run's length
RUN_LENGTH = ("short", "auto")


def _knob_settings(knob: str, value, obs) -> Dict[str, Any]:
    """``ig``'s settings for one value of the swept knob."""
    if knob != "run_length":
        return {knob: value}
    return {"tv": observed_tv(obs), "features": observed_features(obs)} if value == "short" else {}


def weight_sweep(args, make_model, log) -> str:
    """PSNR of ``ig`` with one term (``--weight-knob``: the bn-upload term, the per-image
    features term, TV; or the learning rate, the schedule, the rules' run-length adjustment)
    at each value, on held-out embedded images."""
    knob = args.weight_knob
    unknown = [w for w in args.weights if knob == "run_length" and w not in RUN_LENGTH]
    if unknown:
        raise SystemExit(f"--weight-knob run_length takes the values {', '.join(RUN_LENGTH)}, got {unknown}")
    data = load_dataset("embedded")
    rows = []
    for batch in args.batches:
        count = max(1, args.images // batch)
        for group in range(count):
            # one image per class (the photos' draw); the bn-upload table's stored cells keep the first draw
            x, y = _held_out_batch(data, batch, group, distinct=knob != "bn_upload")
            for weight in args.weights:
                parts = dict(cell="bn-weight", batch=batch, group=group, weight=weight, budget=args.budget,
                             # a TV sweep sets the weight itself: the TV rule is not consulted
                             seed=args.seed, code=_code_version(("attacks/tv_rule.py",) if knob == "tv" else ()),
                             # the model, where it is not the first cells' (whose keys predate the option)
                             **({"model": args.bn_weight_model} if args.bn_weight_model != "convnet-bn-train" else {}),
                             **({"knob": knob, "draw": "distinct labels"} if knob != "bn_upload" else {}),
                             **({"compile": True} if args.upload_compile else {}))

                def compute():
                    model = make_model(args.bn_weight_model)
                    obs = observe(model, x, y, client_mode="train", shares="state", seed=args.seed)
                    settings = {**_knob_settings(knob, weight, obs), **({"compile": True} if args.upload_compile else {})}
                    rec = ATTACKS.build("ig", **settings).reconstruct(obs, args.budget, args.seed,
                                                                      progress=lambda *a: None)
                    return {"psnr": _psnr(rec, x)}

                row = dict(batch=batch, group=group, weight=weight, **stored(parts, compute, log))
                log(row)
                rows.append(row)
    column = knob if knob in ("lr", "schedule", "run_length") else "weight"
    lines = [f"| {column} | " + " | ".join(f"batch {b}: mean PSNR dB (images)" for b in args.batches) + " | mean |",
             "|---|" + "---|" * (len(args.batches) + 1)]
    for weight in args.weights:
        cells, means = [], []
        for b in args.batches:
            values = [v for r in rows if r["weight"] == weight and r["batch"] == b for v in r["psnr"]]
            means.append(statistics.fmean(values))
            cells.append(f"{means[-1]:.2f} ({len(values)})")
        label = f"{weight:g}" if isinstance(weight, float) else weight
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {statistics.fmean(means):.2f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- Adam's smoothing
@contextlib.contextmanager
def replica_smoothing(value: float):
    """The replica's Adam smoothing set to ``value`` (0: the exact rule) for one cell."""
    saved = local_surrogate.ADAM_RELATIVE_EPS
    local_surrogate.ADAM_RELATIVE_EPS = value
    try:
        yield
    finally:
        local_surrogate.ADAM_RELATIVE_EPS = saved


def adam_smoothing(args, make_model, log) -> str:
    """PSNR of ``ig`` against a client of 3 local Adam steps (the FedAvg Adam cell's setting)
    for each smoothing of the replica's Adam (:mod:`attacks.local_surrogate`; 0 is the exact
    rule) and for a replica that assumes plain SGD, on held-out embedded images."""
    spec, lr = FEDAVG_CELLS["adam"]
    data = load_dataset("embedded")
    rows = []
    for group in range(args.images):
        x, y = data.test_images[group:group + 1], data.test_labels[group:group + 1]
        for value in [*args.smoothings, "plain"]:
            parts = dict(cell="adam-smoothing", group=group, smoothing=value, optimizer=spec, lr=lr, steps=3,
                         budget=args.budget, seed=args.seed, code=_code_version())

            def compute():
                obs = observe(make_model("convnet-bn-train"), x, y, client_mode="train", local_steps=3, local_lr=lr,
                              optimizer=spec, shares="state", seed=args.seed)
                if value == "plain":
                    obs = dataclasses.replace(obs, training=dataclasses.replace(obs.training, optimizer=LocalOptimizer()))
                with replica_smoothing(0.0 if value == "plain" else float(value)):
                    rec = ATTACKS.build("ig").reconstruct(obs, args.budget, args.seed, progress=lambda *a: None)
                return {"psnr": _psnr(rec, x)}

            row = dict(group=group, smoothing=value, **stored(parts, compute, log))
            log(row)
            rows.append(row)
    lines = ["| replica's Adam | mean PSNR dB (images) |", "|---|---|"]
    for value in [*args.smoothings, "plain"]:
        values = [v for r in rows if r["smoothing"] == value for v in r["psnr"]]
        name = ("assumes plain SGD" if value == "plain" else "exact rule (eps as the client's)" if value == 0
                else f"eps + {value:g} x gradient RMS")
        lines.append(f"| {name} | {statistics.fmean(values):.2f} ({len(values)}) |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the upload
def upload_matrix(args, make_model, natural_images, run_breaching, timed, evaluate, log) -> str:
    """The BatchNorm-statistics cells beside breaching, then the FedAvg optimiser cells."""
    images, names = natural_images(max(args.images, max(args.batches), args.fedavg_images * args.fedavg_batch))
    log("images: " + ", ".join(names))
    if args.fedavg_only:
        first, fed = args.seed, []
        try:
            for seed in range(first, first + args.fedavg_seeds):  # another seed: another model and attack start
                args.seed = seed  # make_model reads the seed from args
                fed += [_fedavg_cell(args, cell, group, images, make_model, log)
                        for cell in args.fedavg_cells for group in range(args.fedavg_images)]
        finally:
            args.seed = first
        return _fedavg_table(fed, args)
    rows: List[Dict[str, Any]] = []
    for model_name in args.models:
        for batch in args.batches:
            for group in range(max(1, args.images // batch)):
                rows.append(_state_cell(args, model_name, batch, group, images, make_model, run_breaching,
                                        timed, evaluate, log))
    if args.breaching_only:
        return "breaching's cells stored; rerun without --breaching-only for the table"
    table = [_state_table(rows)]
    if args.fedavg:
        fed = [_fedavg_cell(args, cell, group, images, make_model, log)
               for cell in args.fedavg_cells for group in range(args.fedavg_images)]
        table.append(_fedavg_table(fed, args))
    return "\n\n".join(table)


def _state_cell(args, model_name, batch, group, images, make_model, run_breaching, timed, evaluate,
                log) -> Dict[str, Any]:
    iterations = args.breaching_iterations.get("ig", 1000 if model_name.startswith("convnet") else 200)
    x = images[group * batch:(group + 1) * batch]
    y = torch.tensor([(3 * (group * batch + i) + 1) % 10 for i in range(batch)])
    setting = dict(model=model_name, batch=batch, group=group, seed=args.seed, threads=args.threads)

    def client(shares):
        return observe(make_model(model_name), x, y, client_mode="train", shares=shares, seed=args.seed)

    def breaching():  # breaching's IG reads no buffers: the weights-only observation
        theirs, labels, seconds = run_breaching("ig", client("update"), y, iterations, args.seed)
        return {"seconds": seconds, **evaluate(theirs, labels, x, y, False), "per_image": _psnr_of(theirs, x)}

    theirs = stored(dict(cell="breaching-ig", iterations=iterations, **setting), breaching, log)
    if args.breaching_only:
        return {}

    settings = {"compile": True} if args.upload_compile else {}

    def ours():
        state = client("state")
        update = dataclasses.replace(state, training=dataclasses.replace(state.training, shares="update"), buffers=None)  # the same weights, no buffers
        budget, ratio, compiling = matched_budget(state, update, y, iterations, run_breaching, timed, args.seed,
                                                  settings)
        out = {"speed_ratio": ratio, **({"compile_seconds": round(compiling, 1)} if settings else {})}
        for name, obs in (("ours, with the buffers", state), ("ours, weights only", update)):
            rec, spent = timed(ATTACKS.build("ig", **settings), obs, budget, args.seed)
            out[name] = {"seconds": spent, "budget": budget, **evaluate(rec.inputs, rec.labels, x, y, False),
                         "per_image": _psnr(rec, x), "side_information": rec.trace.get("side_information")}
        return out

    mine = stored(dict(cell="state", breaching_seconds=round(theirs["seconds"], 1), code=_code_version(),
                       budget_rule="marginal cost, fixed cost apart" + (", compilation apart" if settings else ""),
                       weight=_default_weight(make_model(model_name)), **settings, **setting), ours, log)
    row = dict(model=model_name, batch=batch, group=group, breaching=theirs, **mine)
    if "portfolio" in args.upload_attacks:  # the audit's base portfolio, at ig's budget
        budget = mine["ours, with the buffers"]["budget"]

        def portfolio():
            import attacks.portfolio  # noqa: F401  (registers the portfolio)

            rec, spent = timed(ATTACKS.build("portfolio", **settings), client("state"), budget, args.seed)
            return {"seconds": spent, "budget": budget, **evaluate(rec.inputs, rec.labels, x, y, False),
                    "per_image": _psnr(rec, x)}

        row["portfolio, with the buffers"] = stored(dict(cell="state-portfolio", budget=budget, code=_code_version(),
                                                         portfolio=_file_version("attacks/portfolio.py"),
                                                         weight=_default_weight(make_model(model_name)),
                                                         **settings, **setting), portfolio, log)
    log(row)
    return row


def matched_budget(ours_obs, their_obs, labels, iterations: int, run_breaching, timed, seed: int,
                   settings: Optional[Dict[str, Any]] = None, lengths=(10, 50), rounds: int = 2):
    """Our budget at breaching's wall time for ``iterations``: each tool's cost per iteration
    (evaluation) and fixed cost per run, from runs at two lengths measured back to back in this
    process (ABBA, after a warm-up of both), so neither a change of the shared machine's load
    between the long runs nor one tool's setup cost spread over a short probe decides it. Our
    warm-up's time beyond a warm run's (``compile=true``'s one-off compilation, paid once per
    model and batch shape in an audit) is reported apart, as :func:`bench_strength.budget_for` does.
    Returns (budget, our cost per evaluation / breaching's per iteration, that compilation in s)."""
    attack = ATTACKS.build("ig", **(settings or {}))
    run_breaching("ig", their_obs, labels, 2, seed)
    warm_up = timed(attack, ours_obs, 2, seed)[1]
    spent = {(tool, n): 0.0 for tool in ("ours", "theirs") for n in lengths}
    for _ in range(rounds):
        for n in lengths:
            spent["ours", n] += timed(attack, ours_obs, n, seed)[1]
            spent["theirs", n] += run_breaching("ig", their_obs, labels, n, seed)[2]
            spent["theirs", n] += run_breaching("ig", their_obs, labels, n, seed)[2]
            spent["ours", n] += timed(attack, ours_obs, n, seed)[1]
    short, long = lengths

    def costs(tool):
        per = max((spent[tool, long] - spent[tool, short]) / (2 * rounds * (long - short)), 1e-6)
        return per, max(spent[tool, short] / (2 * rounds) - short * per, 0.0)

    (ours, ours_fixed), (theirs, theirs_fixed) = costs("ours"), costs("theirs")
    wall = theirs_fixed + iterations * theirs
    compiling = max(warm_up - ours_fixed - 2 * ours, 0.0) if settings and settings.get("compile") else 0.0
    return max(short, int((wall - ours_fixed) / ours)), round(ours / theirs, 3), compiling


def _psnr_of(images, truth) -> List[float]:
    """Each private image's PSNR against the reconstruction matched to it (a batch's
    reconstructions may come in any order)."""
    from audit.core.metrics import score

    labels = torch.zeros(len(truth), dtype=torch.long)
    return [round(float(v), 2) for v in score(images.cpu(), None, truth.cpu(), labels, lpips=False)["psnr"].per_image]


def _state_table(rows: List[Dict[str, Any]]) -> str:
    lines = ["| model (BN train) | batch | batches | breaching IG dB (s) | `ig` + buffers dB (budget, s) | "
             "`ig`, weights only dB | `ig` + buffers vs breaching | `portfolio` + buffers dB (vs breaching) | "
             "per batch: breaching / `ig` + buffers |", "|---|---|---|---|---|---|---|---|---|"]
    keys = []
    for r in rows:
        if (r["model"], r["batch"]) not in keys:
            keys.append((r["model"], r["batch"]))
    for model, batch in keys:
        group = [r for r in rows if (r["model"], r["batch"]) == (model, batch)]
        mean = lambda who, k="psnr": statistics.fmean(r[who][k] for r in group)  # noqa: E731
        theirs, ours, plain = mean("breaching"), mean("ours, with the buffers"), mean("ours, weights only")
        per = "; ".join(f"{r['breaching']['psnr']:.1f} / {r['ours, with the buffers']['psnr']:.1f}" for r in group)
        portfolio = ("-" if not all("portfolio, with the buffers" in r for r in group) else
                     f"{mean('portfolio, with the buffers'):.2f} ({mean('portfolio, with the buffers') - theirs:+.2f})")
        lines.append(f"| {model} | {batch} | {len(group)} | {theirs:.2f} ({mean('breaching', 'seconds'):.0f}) | "
                     f"{ours:.2f} ({group[0]['ours, with the buffers']['budget']} ev"
                     + (f", compile=true, its compilation {group[0]['compile_seconds']:.0f} s apart"
                        if 'compile_seconds' in group[0] else "") + ", "
                     f"{mean('ours, with the buffers', 'seconds'):.0f}) | {plain:.2f} | {ours - theirs:+.2f} | "
                     f"{portfolio} | {per} |")
    return "\n".join(lines)


def _fedavg_cell(args, cell: str, group: int, images, make_model, log) -> Dict[str, Any]:
    spec, lr = FEDAVG_CELLS[cell]
    parts = dict(cell="fedavg", psnr="matched", optimizer=spec, lr=lr, group=group, steps=3, budget=args.fedavg_budget,
                 batch=args.fedavg_batch, local_batch=args.fedavg_local_batch, shares=args.fedavg_shares, seed=args.seed,
                 # the model, where it is not the first cells' (whose keys predate the option)
                 **({"model": args.fedavg_model} if args.fedavg_model != "convnet-bn-train" else {}),
                 code=_code_version(), weight=_default_weight(make_model(args.fedavg_model)))
    if LocalOptimizer.parse(spec).name in local_surrogate.SMOOTHED:
        parts["smoothing"] = local_surrogate.ADAM_RELATIVE_EPS

    def compute():
        batch = args.fedavg_batch
        x = images[group * batch:(group + 1) * batch]
        y = torch.tensor([(3 * (group * batch + i) + 1) % 10 for i in range(batch)])
        real = observe(make_model(args.fedavg_model), x, y, client_mode=FEDAVG_MODES[args.fedavg_model],
                       local_steps=3, local_lr=lr,
                       local_batch_size=args.fedavg_local_batch, optimizer=spec, shares=args.fedavg_shares,
                       seed=args.seed)
        assumed = dataclasses.replace(real, training=dataclasses.replace(real.training, optimizer=LocalOptimizer()))  # the attacker assumes plain SGD
        out = {}
        for name, obs in (("unrolls the real optimizer", real), ("assumes plain SGD", assumed)):
            rec = ATTACKS.build("ig").reconstruct(obs, args.fedavg_budget, args.seed, progress=lambda *a: None)
            out[name] = {"per_image": _psnr(rec, x), "psnr": statistics.fmean(_psnr(rec, x))}
        return out

    row = dict(cell=cell, group=group, **stored(parts, compute, log))
    log(row)
    return row


def _fedavg_table(rows: List[Dict[str, Any]], args) -> str:
    lines = [f"| client optimizer ({args.fedavg_model}, 3 local steps on a batch of {args.fedavg_batch} in mini-batches of "
             f"{args.fedavg_local_batch}, uploading its {args.fedavg_shares}) | runs (batches x seeds) | "
             "attack unrolls the real optimizer dB | attack assumes plain SGD dB | difference | "
             "images where the unrolled attack is ahead (exact sign test) | per batch (real / plain) |",
             "|---|---|---|---|---|---|---|"]
    real_name, plain_name = "unrolls the real optimizer", "assumes plain SGD"
    for cell, (spec, lr) in FEDAVG_CELLS.items():
        group = [r for r in rows if r["cell"] == cell and cell in args.fedavg_cells]
        if not group:
            continue
        real = statistics.fmean(v for r in group for v in r[real_name]["per_image"])
        plain = statistics.fmean(v for r in group for v in r[plain_name]["per_image"])
        pairs = [(a, b) for r in group for a, b in zip(r[real_name]["per_image"], r[plain_name]["per_image"])]
        ahead = sum(a > b for a, b in pairs)
        decided = sum(a != b for a, b in pairs)
        sign_p = binomtest(ahead, decided).pvalue if decided else 1.0
        per = "; ".join(f"{r[real_name]['psnr']:.1f} / {r[plain_name]['psnr']:.1f}" for r in group)
        lines.append(f"| {spec}, lr {lr} | {len(group)} | {real:.2f} | {plain:.2f} | {real - plain:+.2f} | "
                     f"{ahead} of {len(pairs)} (p = {sign_p:.2g}) | {per} |")
    return "\n".join(lines)


def _number_or_name(value: str):
    try:
        return float(value)
    except ValueError:
        return value


def add_options(p) -> None:
    """The options of the two modes."""
    p.add_argument("--upload", action="store_true", help="the client's uploaded state and local optimiser")
    p.add_argument("--bn-weight", action="store_true", help="choose the bn-upload weight on held-out images")
    p.add_argument("--weights", type=lambda s: [_number_or_name(v) for v in s.split(",")], default=list(WEIGHTS),
                   help="the knob's values (numbers; names for --weight-knob schedule)")
    p.add_argument("--weight-knob", choices=("bn_upload", "features", "tv", "lr", "schedule", "run_length"),
                   default="bn_upload", help="with --bn-weight: the term whose weight (or the setting whose value) "
                   f"is swept (ig's knob; run_length: {', '.join(RUN_LENGTH)}, the TV and features weights as the "
                   "rules give them at 400 iterations or moved by the budget, attacks.budget_rule)")
    p.add_argument("--bn-weight-model", choices=("convnet-bn-train", "resnet18-bn-train"), default="convnet-bn-train")
    p.add_argument("--adam-smoothing", action="store_true",
                   help="choose the replica's Adam smoothing on held-out images (FedAvg, 3 Adam steps)")
    p.add_argument("--smoothings", type=lambda s: [float(v) for v in s.split(",")], default=[0.0, 1.0, 3.0, 10.0])
    p.add_argument("--upload-attacks", type=lambda v: v.split(","), default=["ig"],
                   help="--upload: ig, or ig,portfolio (the portfolio with the buffers at ig's budget)")
    p.add_argument("--upload-compile", action="store_true", help="--upload, --bn-weight: ours with compile=true "
                   "(its one-off compilation reported apart)")
    p.add_argument("--breaching-only", action="store_true", help="--upload: store breaching's cells only")
    p.add_argument("--fedavg-only", action="store_true", help="--upload: the FedAvg optimiser cells only")
    p.add_argument("--no-fedavg", dest="fedavg", action="store_false", help="--upload without the FedAvg cells")
    p.add_argument("--fedavg-images", type=int, default=1, help="private batches per FedAvg cell")
    p.add_argument("--fedavg-cells", type=lambda v: v.split(","), default=list(FEDAVG_CELLS),
                   help=f"FedAvg cells to run, of {', '.join(FEDAVG_CELLS)}")
    p.add_argument("--fedavg-batch", type=int, default=2)
    p.add_argument("--fedavg-seeds", type=int, default=1, help="--fedavg-only: seeds (models and attack starts) "
                   "per private batch")
    p.add_argument("--fedavg-model", choices=list(FEDAVG_MODES), default="convnet-bn-train")
    p.add_argument("--fedavg-local-batch", type=int, default=1, help="the client's mini-batch (its steps see "
                   "different images, so momentum changes the update's direction, not only its length)")
    p.add_argument("--fedavg-shares", default="state", help="what the FedAvg client uploads (update or state)")
    p.add_argument("--fedavg-budget", type=int, default=900, help="gradient evaluations (3 per iteration)")


# --------------------------------------------------------------------------- audits per shared form
#: the audited client of the finding: BatchNorm in train mode; FedSGD shares one gradient, the
#: FedAvg forms 2 local steps of SGD with momentum 0.9 (lr 0.05), weights only or with buffers
SHARED_FORMS = {
    "gradient": dict(shares="gradient"),
    "update": dict(shares="update", local_steps=2, local_lr=0.05, local_optimizer="sgd:momentum=0.9"),
    "state": dict(shares="state", local_steps=2, local_lr=0.05, local_optimizer="sgd:momentum=0.9"),
}


def shared_form_audits(args, log) -> str:
    """One audit per shared form of the same defended client (and the decoy's with its state):
    verdicts and recovered counts. Each audit writes its report under
    ``bench/results/strength/upload-audits/<defense>-<form>/``, and its row is kept in the
    bench's store (:func:`audit_row`)."""
    base = dict(model="convnet", image_size=32, steps=[0], images=args.audit_images, budget=args.audit_budget,
                attacks=args.audit_attacks, utility=False, progress=False, seed=args.seed, device=args.device,
                client_mode="train")
    runs = [(args.audit_defense, form, settings) for form, settings in SHARED_FORMS.items()]
    runs.append(("decoy", "state", SHARED_FORMS["state"]))
    lines = ["| defense | client shares | verdict | recovered (95% CI) | without the defense (positive control) | "
             "strongest attack: worst-case PSNR dB | bn-upload | attack s |", "|---|---|---|---|---|---|---|---|"]
    for defense, form, settings in runs:
        name = f"{UPLOAD_AUDITS}/{defense}-{form}"
        row = audit_row(name, dict(defense=defense, out=str(RESULTS.path.parent / name), **base, **settings))
        log(f"{defense} / {form}: {row['verdict']}")
        lines.append(f"| {defense} | {form} | {row['verdict']} | {row['recovered']} | {row['control']} | "
                     f"{row['worst']} | {row['bn_upload']} | {row['seconds']:.0f} |")
    return "\n".join(lines)


def audit_row(name: str, call: Dict[str, Any]) -> Dict[str, Any]:
    """The table's row of the audit ``call``, kept in the store under ``name`` with the engine's
    run key it ran under (``key``): reused while that key is today's, else the audit runs (resuming
    its own store under ``call["out"]``) and the new row is kept."""
    from audit.engine import audit
    from bench.bench_control import run_key

    key = run_key(call)
    kept = RESULTS.get(name)
    if isinstance(kept, dict) and kept.get("key") == key:
        return kept
    row = report_row(audit.run(**call).data)
    RESULTS.put(name, row)
    return row


def report_row(data: Dict[str, Any]) -> Dict[str, Any]:
    """What the table shows of an audit's report (``report.json``'s object), with its run key."""
    step = data["steps"][0] if data.get("steps") else {}
    side = (data.get("plan") or {}).get("side_information", {}).get("bn-upload", "")
    return {"key": data["run_key"], "verdict": data["verdict"]["label"], "recovered": _recovered(step),
            "control": _recovered(step.get("control") or {}), "worst": _worst(step), "bn_upload": side.split(":")[0],
            "seconds": sum(float(r.get("time_s") or 0) for r in data.get("results", []))}


def _recovered(step: Dict[str, Any]) -> str:
    """``k of n (low-high%)`` of a step's verdict (or of its control, which carries the rate itself)."""
    rate = (step.get("verdict") or {}).get("recovery_rate") or step.get("recovery_rate") or {}
    if not rate:
        return "-"
    return f"{rate['k']} of {rate['n']} ({100 * rate['low']:.0f}-{100 * rate['high']:.0f}%)"


def _worst(step: Dict[str, Any]) -> str:
    value = (step.get("worst_case") or {}).get("psnr")
    attack = (step.get("risk") or {}).get("strongest_attack", "")
    return "-" if value is None else f"{attack}: {value:.2f}"


def add_audit_options(p) -> None:
    p.add_argument("--shared-forms", action="store_true", help="one audit per shared form (and the decoy's)")
    p.add_argument("--audit-defense", default="gaussian")
    p.add_argument("--audit-images", type=int, default=8)
    p.add_argument("--audit-budget", type=int, default=200)
    p.add_argument("--audit-attacks", default="auto")
