"""What a defense costs: one call against a clean gradient and against its algorithmic floor,
and each defense's default audit against the default ``prune`` audit.

**Calls** (``--calls``): for every model configuration (``--configs``, default the ``cnn``
at batch 1 and ResNet-18 at batch 1 and 8, 32x32, client in train mode) and every built-in
defense, one defense call on one private batch, timed right after a clean gradient of the
same batch; the ratio is taken per repeat and its median reported (the shared cores drift,
ratios taken side by side do not). The floor is what the defense's published algorithm
cannot skip, in units measured in the same repeat: forward+backward passes, forwards,
input-gradient (VJP) passes, the random numbers it draws, and for SVDefense one Gram
matrix + symmetric eigendecomposition per weight tensor (:data:`FLOORS` says which, per
defense).

**Audits** (``--audits``): ``gia-audit audit`` of each named defense (``--audit-defenses``)
as a subprocess on ``--threads`` threads with a fresh cache (Refiner's network copied in):
wall, utility and per-attack times, beside the default ``prune`` audit in the same run.

Usage (run on purpose, not in CI)::
    python -m bench.bench_defenses --calls --threads 2 --docs defenses
    python -m bench.bench_defenses --audits --threads 2 --docs defense-audits
    python -m bench.bench_defenses --audits --audit-defenses prune --audit-args "" --baseline-tree OLD --order abba --docs default-audit
    python -m bench.bench_defenses --calls --configs cnn:1 --defenses censor,refiner

``--docs NAME`` writes the part's table into ``docs/performance.md``; ``--json PATH`` keeps the
rows measured so far; ``--from-json PATH`` publishes a finished run's rows without measuring.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from audit.core.models import build_model, last_linear
from audit.core.types import clean_gradients, trainable_parameters
from bench.docs_table import ROOT, add_docs_option, publish, without_options
from defenses import DEFENSES, build_defense
from defenses.streams import fill_normal

CALL_MARK = "defenses"
AUDIT_MARK = "defense-audits"
BASELINE_MARK = "default-audit"  # --audits with --baseline-tree: this tree's audit beside another tree's
PAGE = "docs/performance.md"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
BEST_OF_SECONDS = 1.0  # a timing repeats its call while it has taken less than this, at most 5 times


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of ``fn()``: the least of up to 5 back-to-back runs within
    :data:`BEST_OF_SECONDS` (a shared machine's descheduling only ever adds time)."""
    now, best, spent = CLOCK[_CLOCK[0]], math.inf, 0.0
    for _ in range(5):
        _sync(device)
        start = now()
        fn()
        _sync(device)
        took = now() - start
        best, spent = min(best, took), spent + took
        if spent > BEST_OF_SECONDS:
            break
    return best


_CLOCK = ["wall"]


# --------------------------------------------------------------------------- floor units
@dataclass
class Units:
    """Timers of the floor's units for one model configuration (each returns seconds)."""

    fb: Callable[[], float]  # clean gradient (forward + backward), batch B
    fb1: Callable[[], float]  # clean gradient of one example
    fwd64: Callable[[], float]  # forward in float64, batch B, no grad
    match: Callable[[], float]  # one gradient-matching step w.r.t. the input, batch B
    vjp_x: Callable[[], float]  # one VJP from the last linear layer's input to the input
    evaluator_fb: Callable[[], float]  # Refiner's evaluation network, forward + input gradient
    normals: Callable[[int], float]
    uniforms: Callable[[int], float]
    gram_eigh: Callable[[], float]  # Gram matrix + eigh of every weight gradient
    topk: Callable[[], float]  # torch.topk of every gradient's magnitudes, 10% kept (the selection)


def units_for(model: nn.Module, x, y, device, evaluator: Optional[nn.Module]) -> Units:
    params = trainable_parameters(model)
    n_params = sum(p.numel() for p in params)
    model64 = copy.deepcopy(model).double()
    x64 = x.double()
    gen = torch.Generator(device=device).manual_seed(0)
    clean = [g.detach() for g in clean_gradients(model, x, y)]
    mats = [g.reshape(g.shape[0], -1) for g in clean if g.dim() >= 2]
    _, head = last_linear(model)
    captured: Dict[str, torch.Tensor] = {}
    head.register_forward_hook(lambda m, i, o: captured.__setitem__("r", i[0]))

    def fb() -> float:
        return timed(lambda: clean_gradients(model, x, y), device)

    def fb1() -> float:
        return timed(lambda: clean_gradients(model, x[:1], y[:1]), device)

    def fwd64() -> float:
        with torch.no_grad():
            return timed(lambda: model64(x64), device)

    def match() -> float:
        def step():
            dummy = x.detach().clone().requires_grad_(True)
            grads = clean_gradients(model, dummy, y, create_graph=True)
            loss = sum(((g - c) ** 2).sum() for g, c in zip(grads, clean))
            torch.autograd.grad(loss, dummy)
        return timed(step, device)

    def vjp_x() -> float:
        dummy = x.detach().clone().requires_grad_(True)
        model(dummy)
        r = captured["r"]
        seed = torch.zeros_like(r)
        seed[:, 0] = 1
        return timed(lambda: torch.autograd.grad(r, dummy, seed, retain_graph=True), device)

    def evaluator_fb() -> float:
        if evaluator is None:
            return 0.0
        def step():
            dummy = x.detach().clone().requires_grad_(True)
            torch.autograd.grad(evaluator(dummy).sum(), dummy)
        return timed(step, device)

    def normals(count: int) -> float:
        return timed(lambda: torch.randn(count, generator=gen, device=device), device)

    def uniforms(count: int) -> float:
        return timed(lambda: torch.rand(count, generator=gen, device=device), device)

    def gram_eigh() -> float:
        def work():
            for m in mats:
                t = (m if m.shape[0] <= m.shape[1] else m.T).double()
                torch.linalg.eigh(t @ t.T)
        return timed(work, device)

    def topk() -> float:
        def work():
            for g in clean:
                flat = g.reshape(-1).abs()
                torch.topk(flat, max(1, flat.numel() - round(0.9 * flat.numel())), sorted=False)
        return timed(work, device)

    units = Units(fb, fb1, fwd64, match, vjp_x, evaluator_fb, normals, uniforms, gram_eigh, topk)
    units.n_params = n_params  # type: ignore[attr-defined]
    units.n_features = head.in_features  # type: ignore[attr-defined]
    units.input_numel = x.numel()  # type: ignore[attr-defined]
    return units


# defense -> (floor in words, floor in seconds from the units)
Floor = Tuple[str, Callable[[Units, int], float]]


def _censor_floor(u: Units, batch: int, trials: int = 20) -> float:
    return u.fb() + (batch - 1) * u.fb1() + trials * u.fwd64() + u.normals(trials * u.n_params)


def _refiner_floor(u: Units, batch: int, iota: int = 10) -> float:
    return 2 * u.fb() + iota * (u.match() + u.evaluator_fb()) + u.uniforms(u.input_numel)


FLOORS: Dict[str, Floor] = {
    "none": ("1 fb", lambda u, b: u.fb()),
    "clip": ("1 fb", lambda u, b: u.fb()),
    "quantize": ("1 fb", lambda u, b: u.fb()),
    "prune": ("1 fb + top-k of each tensor", lambda u, b: u.fb() + u.topk()),
    "ats": ("1 fb", lambda u, b: u.fb()),
    "decoy": ("1 fb (of the decoy batch)", lambda u, b: u.fb()),
    "precode": ("1 fb", lambda u, b: u.fb()),
    "gaussian": ("1 fb + n normals", lambda u, b: u.fb() + u.normals(u.n_params)),
    "laplacian": ("1 fb + n uniforms", lambda u, b: u.fb() + u.uniforms(u.n_params)),
    "soft-prune": ("1 fb + n uniforms + n normals",
                   lambda u, b: u.fb() + u.uniforms(u.n_params) + u.normals(u.n_params)),
    "dp-sgd": ("B per-example fb + n normals", lambda u, b: b * u.fb1() + u.normals(u.n_params)),
    "censor": ("1 fb (+ B-1 per-example) + T=20 float64 forwards + 20n normals", _censor_floor),
    "soteria": ("1 fb + f VJPs to the input (f: the last layer's input features)",
                lambda u, b: u.fb() + u.n_features * u.vjp_x()),
    "svdefense": ("1 fb + float64 Gram + eigh per weight tensor", lambda u, b: u.fb() + u.gram_eigh()),
    "refiner": ("2 fb + iota=10 x (gradient-matching step + D fwd/bwd) + input-size uniforms",
                _refiner_floor),
}


# --------------------------------------------------------------------------- calls
def _median(values: List[float]) -> float:
    return statistics.median(values) if values else math.nan


def bench_calls(config: str, names: List[str], repeats: int, device, seed: int) -> List[dict]:
    """One row per defense: median ms, median x clean gradient, floor, median x floor; plus a
    ``units`` row: CENSOR's random draws and float64 forwards against a clean gradient."""
    model_name, batch = config.split(":")
    batch = int(batch)
    model = build_model(model_name, (3, 32, 32), 10, seed=seed).to(device).train()
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, 3, 32, 32, generator=gen).to(device)
    y = torch.randint(0, 10, (batch,), generator=gen).to(device)
    defenses, models = {}, {}
    for name in names:
        defense = build_defense(name)
        models[name] = defense.wrap_model(copy.deepcopy(model))
        defenses[name] = defense
    evaluator = defenses["refiner"].evaluator(x.shape[1:], device) if "refiner" in defenses else None
    units = {name: units_for(models[name], x, y, device, evaluator) for name in names}
    plain = units_for(model, x, y, device, evaluator)
    unit_ratios: Dict[str, List[float]] = {"normals": [], "normals_streams": [], "fwd64": []}
    streams_buffer = torch.empty(20, plain.n_params, device=device)
    state = {name: copy.deepcopy(models[name].state_dict()) for name in names}
    rows = {name: {"ms": [], "clean": [], "floor": [], "error": None} for name in names}

    def call(name: str, k: int) -> float:
        return timed(lambda: defenses[name](models[name], x, y,
                                            generator=torch.Generator(device=device).manual_seed(k)), device)

    for name in names:  # warm-up (and a failure is reported, not raised)
        try:
            call(name, 0)
            units[name].fb()
        except Exception as err:  # noqa: BLE001 (the bench reports any failure)
            rows[name]["error"] = f"{type(err).__name__}: {str(err)[:80]}"
        models[name].load_state_dict(state[name])
    for r in range(repeats):
        clean = plain.fb()
        unit_ratios["normals"].append(plain.normals(20 * plain.n_params) / clean)
        unit_ratios["normals_streams"].append(timed(lambda: fill_normal([streams_buffer], gen), device) / clean)
        unit_ratios["fwd64"].append(20 * plain.fwd64() / clean)
        for name in names:
            if rows[name]["error"]:
                continue
            clean = units[name].fb()
            ms = call(name, r + 1)
            models[name].load_state_dict(state[name])
            floor = FLOORS[name][1](units[name], batch) if name in FLOORS else math.nan
            rows[name]["ms"].append(ms)
            rows[name]["clean"].append(ms / clean)
            rows[name]["floor"].append(ms / floor)
            print(f"  {config} {name:10s} repeat {r}: {1e3 * ms:9.1f} ms  {ms / clean:7.1f}x clean  "
                  f"{ms / floor:6.2f}x floor", flush=True)
    return [{"config": config, "defense": name, "error": rows[name]["error"],
             "ms": 1e3 * _median(rows[name]["ms"]), "x_clean": _median(rows[name]["clean"]),
             "x_floor": _median(rows[name]["floor"]), "floor": FLOORS.get(name, ("?",))[0]}
            for name in names] + [{"config": config, "defense": "units", "error": None,
                                   **{k: _median(v) for k, v in unit_ratios.items()}}]


def not_reached(rows: List[dict]) -> List[str]:
    """The targets a run misses, each with the measured reason where the floor explains it."""
    out = []
    units = {r["config"]: r for r in rows if r["defense"] == "units"}
    for r in rows:
        if r["defense"] == "units" or r["error"]:
            continue
        if r["x_floor"] > 2:
            out.append(f"{r['defense']} on {r['config']}: {r['x_floor']:.2f}x its floor.")
        if r["defense"] == "censor" and r["config"] == "cnn:1" and r["x_clean"] > 10:
            u = units[r["config"]]
            out.append(f"CENSOR on cnn:1 is {r['x_clean']:.0f}x a clean gradient (target 10x): drawing the 20 x n "
                       f"normal numbers takes {u['normals']:.0f}x a clean gradient from one generator and "
                       f"{u.get('normals_streams', math.nan):.0f}x from the parallel streams CENSOR uses, and "
                       f"scoring the 20 candidates (float64 forwards, one after another) {u['fwd64']:.0f}x.")
    return out


def calls_table(rows: List[dict], configs: List[str]) -> str:
    by = {(r["config"], r["defense"]): r for r in rows}
    names = list(dict.fromkeys(r["defense"] for r in rows))
    head = "| defense | floor |" + "".join(f" {c} ms | x clean | x floor |" for c in configs)
    lines = [head, "|---|---|" + "---:|---:|---:|" * len(configs)]
    for name in [n for n in names if n != "units"]:
        cells = [f"| {name} | {FLOORS.get(name, ('?',))[0]} |"]
        for c in configs:
            r = by.get((c, name))
            if r is None:
                cells.append(" | | |")
            elif r["error"]:
                cells.append(f" fails: {r['error']} | | |")
            else:
                floor = "n/a" if math.isnan(r["x_floor"]) else f"{r['x_floor']:.2f}"  # no floor known then
                cells.append(f" {r['ms']:.1f} | {r['x_clean']:.1f} | {floor} |")
        lines.append("".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------- audits
def run_audit(defense: str, extra: List[str], threads: int, cache: Path, out: Path, tree: Path) -> dict:
    """One ``gia-audit audit`` as a subprocess of ``tree``: wall and CPU seconds, each attack's
    summed result times, the verdict and each (step, attack)'s mean PSNR."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "GIA_AUDIT_CACHE": str(cache), "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-c", "import cli; cli.main()", "audit", "--defense", defense, "--quiet",
           "--out", str(out), *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    per_attack: Dict[str, float] = {}
    psnr: Dict[str, List[float]] = {}
    for rec in _records(out):
        per_attack[rec["attack_id"]] = per_attack.get(rec["attack_id"], 0.0) + float(rec.get("time_s", 0.0))
        value = (rec.get("metrics") or {}).get("psnr")
        if value is not None:
            psnr.setdefault(f"s{rec['step']} {rec['attack_id']}", []).append(float(value))
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    verdict = (report.get("verdict") or {}).get("label")
    return {"defense": defense, "args": " ".join(extra), "tree": str(tree), "wall_s": wall, "cpu_s": cpu,
            "utility_s": utility_seconds(report),
            "rc": proc.returncode, "per_attack": per_attack, "verdict": verdict, "stderr": proc.stderr[-400:],
            "psnr": {k: sum(v) / len(v) for k, v in sorted(psnr.items())}}


def utility_seconds(report: dict) -> Optional[float]:
    """Seconds of the report's utility training runs (defended and undefended); None without any."""
    utility = report.get("utility") or {}
    runs = [run for part in ("defended", "undefended") for run in (utility.get(part) or {}).get("runs", [])]
    return sum(float(run.get("seconds") or 0.0) for run in runs) if runs else None


def _records(out: Path) -> List[dict]:
    found = []
    for path in sorted(out.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError):
            continue
        if isinstance(data, dict) and "attack_id" in data and "time_s" in data:
            found.append(data)
    return found


def audits_table(results: List[dict], clock: str, this_tree: Optional[str] = None) -> str:
    """One row per audit, in the order run; ``x prune``: against the ``prune`` audit of the
    same settings and tree. ``this_tree`` (default: the first tree run) is labelled "this"."""
    key = "cpu_s" if clock == "cpu" else "wall_s"
    prune = {(r["args"], r["tree"]): r[key] for r in results if r["defense"] == "prune" and r["rc"] == 0}
    this_tree = this_tree or (results[0]["tree"] if results else "")
    lines = ["| defense | tree | settings | wall s | CPU s | utility s | x prune | verdict | "
             "per attack (s, summed over results) |",
             "|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in results:
        ref = prune.get((r["args"], r["tree"]))
        ratio = f"{r[key] / ref:.2f}" if ref and r["defense"] != "prune" else ""
        attacks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["per_attack"].items(), key=lambda kv: -kv[1]))
        status = "" if r["rc"] == 0 else f" (exit {r['rc']})"
        tree = "this" if r["tree"] == this_tree else "baseline"
        utility = "" if r.get("utility_s") is None else f"{r['utility_s']:.0f}"
        lines.append(f"| {r['defense']}{status} | {tree} | `{r['args']}` | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | "
                     f"{utility} | {ratio} | {r['verdict']} | {attacks} |")
    return "\n".join(lines)


def bench_audits(args, device) -> List[dict]:
    """Every audit of ``--audit-defenses`` from this tree (and, interleaved, from
    ``--baseline-tree`` in the ``--order`` given), one after another, each with a fresh cache."""
    results = []
    this, other = Path(args.tree), Path(args.baseline_tree) if args.baseline_tree else None
    trees = [this] if other is None else {"this-first": [this, other], "baseline-first": [other, this],
                                          "abba": [this, other, other, this]}[args.order]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.audit_defenses.split(","):
            extra = (args.censor_args if name == "censor" else args.audit_args).split()
            for k, tree in enumerate(trees):
                cache = Path(tmp) / f"cache-{name}-{k}"
                cache.mkdir()
                for d_net in (Path.home() / ".cache" / "gia-audit").glob("refiner-evaluator-*.pt"):
                    shutil.copy(d_net, cache)  # one-off set-up, shared by every audit
                r = run_audit(name, extra, args.threads, cache, Path(tmp) / f"out-{name}-{k}", tree)
                print(f"  audit {name} ({tree}) {' '.join(extra)}: {r['wall_s']:.0f} s wall, {r['cpu_s']:.0f} s CPU, "
                      f"exit {r['rc']}, verdict {r['verdict']}\n    per attack {r['per_attack']}\n"
                      f"    PSNR {r['psnr']}", flush=True)
                if r["rc"]:
                    print(r["stderr"])
                results.append(r)
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def trees_summary(results: List[dict], this_tree: str) -> str:
    """Each tree's mean wall and CPU seconds over its runs of every defense, their ratio, and
    the spread of one tree's runs (the noise the ratio is read against); '' without a baseline."""
    runs = {"this": [r for r in results if r["rc"] == 0 and r["tree"] == this_tree],
            "baseline": [r for r in results if r["rc"] == 0 and r["tree"] != this_tree]}
    if not runs["this"] or not runs["baseline"]:
        return ""
    mean = {(t, k): sum(r[k] for r in rs) / len(rs) for t, rs in runs.items() for k in ("wall_s", "cpu_s")}
    spread = ", ".join(f"{t} {min(r['wall_s'] for r in rs):.0f}-{max(r['wall_s'] for r in rs):.0f} s"
                       for t, rs in runs.items() if len(rs) > 1)
    return (f"Mean over each tree's {len(runs['this'])} and {len(runs['baseline'])} run(s): this "
            f"{mean['this', 'wall_s']:.0f} s wall / {mean['this', 'cpu_s']:.0f} s CPU, baseline "
            f"{mean['baseline', 'wall_s']:.0f} / {mean['baseline', 'cpu_s']:.0f}; this / baseline "
            f"{mean['this', 'wall_s'] / mean['baseline', 'wall_s']:.2f} wall, "
            f"{mean['this', 'cpu_s'] / mean['baseline', 'cpu_s']:.2f} CPU" + (f" (wall range: {spread})." if spread else "."))


def publish_audits(args, argv, device, results: List[dict]) -> None:
    table = audits_table(results, args.clock, str(Path(args.tree)))
    summary = trees_summary(results, str(Path(args.tree)))
    table += f"\n\n{summary}" if summary else ""
    header = (f"{machine(args.threads, device)}; one run, the audits one after another in the order listed; x prune by "
              f"{'CPU' if args.clock == 'cpu' else 'wall'} time.")
    print("\n" + header + "\n\n" + table)
    publish(args, "bench.bench_defenses", _without_from_json(argv), header + "\n\n" + table)


def publish_calls(args, argv, device, rows: List[dict], configs: List[str]) -> None:
    table = calls_table(rows, configs)
    header = (f"{machine(args.threads, device)}, {args.clock} clock; median of {args.repeats} repeats; "
              "x clean and x floor are medians of per-repeat ratios.")
    missed = not_reached(rows)
    footer = "Not reached in this run: " + (" ".join(missed) if missed else "none.")
    print("\n" + header + "\n\n" + table + "\n\n" + footer)
    publish(args, "bench.bench_defenses", _without_from_json(argv), header + "\n\n" + table + "\n\n" + footer)


def _without_from_json(argv) -> List[str]:
    """The command line that measures what is published: where the rows went (``--json`` /
    ``--from-json``) is not part of the measurement."""
    return without_options(argv, valued=("--from-json", "--json"))


# --------------------------------------------------------------------------- docs
def machine(threads: int, device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {threads} thread(s), torch {torch.__version__}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", action="store_true", help="time one call of each defense")
    p.add_argument("--audits", action="store_true", help="time each defense's default audit against prune's")
    p.add_argument("--configs", default="cnn:1,resnet18:1,resnet18:8", help="model:batch, comma-separated")
    p.add_argument("--defenses", default=",".join(DEFENSES.names()))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--audit-defenses", default="prune,soteria,svdefense,refiner,censor")
    p.add_argument("--audit-args", default="--steps 0,5 --images 4", help="settings of every audit but CENSOR's")
    p.add_argument("--censor-args", default="--steps 0,20 --images 2 --no-utility")
    p.add_argument("--tree", default=str(ROOT), help="source tree the audits run from")
    p.add_argument("--baseline-tree", help="another source tree whose audits run interleaved (before / after)")
    p.add_argument("--order", default="this-first", choices=("this-first", "baseline-first", "abba"),
                   help="with --baseline-tree: which tree runs first; abba runs this, baseline, baseline, this")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", default="wall", choices=sorted(CLOCK),
                   help="wall time, or the process's CPU time (work, not waiting, on a loaded machine)")
    add_docs_option(p, PAGE)
    p.add_argument("--json", help="also save the measured rows here (after each configuration / audit)")
    p.add_argument("--from-json", help="publish the rows a run saved with --json instead of measuring")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    _CLOCK[0] = args.clock
    device = torch.device(args.device)
    if args.calls == args.audits:
        raise SystemExit("choose one of --calls and --audits")
    part = CALL_MARK if args.calls else BASELINE_MARK if args.baseline_tree else AUDIT_MARK
    if args.docs and args.docs != part:
        raise SystemExit(f"--docs {args.docs}: this part's section is {part!r}")
    saved = json.loads(Path(args.from_json).read_text()) if args.from_json else None
    if args.calls:
        configs = args.configs.split(",")
        rows = saved or []
        for config in ([] if saved else configs):
            rows += bench_calls(config, args.defenses.split(","), args.repeats, device, args.seed)
            if args.json:  # a long run keeps what it has measured
                Path(args.json).write_text(json.dumps(rows, indent=1))
        publish_calls(args, argv, device, rows, configs)
    else:
        publish_audits(args, argv, device, saved or bench_audits(args, device))


if __name__ == "__main__":
    main()
