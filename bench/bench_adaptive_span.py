"""The span attack and its adaptive forms through a defense, audited: the registered ResNet-18 at
32x32, batch 1, eval mode, step 0, embedded data, one audit per attack (its positive control beside
it). Each finished audit is kept in ``bench/results/adaptive-span/results.jsonl`` under its run key
(a rerun resumes, changed inputs rerun); ``--docs adaptive-span`` writes the table into docs/adaptive.md,
``--render`` from the stored rows alone.

    python -m bench.bench_adaptive_span [--images 4] [--budget 200] [--out bench-out/adaptive-span] [--render] [--docs adaptive-span]
"""
from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from bench.bench_evidence import table
from bench.docs_table import add_docs_option, with_table
from bench.jsonl import Lines

#: (defense, its arguments, the attacks audited one at a time); the noise levels bracket the largest
#: at which the denoised span recovers (the gradient's entries: 4e-4 rms at step 0)
CASES = [("prune", {"ratio": 0.9}, ("conv-span", "conv-span-completed")),
         ("gaussian", {"sigma": 1e-6}, ("conv-span", "conv-span-denoised")),
         ("gaussian", {"sigma": 2e-6}, ("conv-span-denoised",)),
         ("gaussian", {"sigma": 4e-6}, ("conv-span-denoised",)), ("gaussian", {"sigma": 8e-6}, ("conv-span-denoised",)),
         ("gaussian", {"sigma": 1.6e-5}, ("conv-span-denoised",)),
         # at their registered (papers') settings; no adaptive span form reads through these
         ("soteria", {}, ("conv-span",)), ("precode", {}, ("conv-span",)), ("svdefense", {}, ("conv-span",)),
         ("censor", {}, ("conv-span",))]
IMAGES, BUDGET = 4, 200
#: every row's positive control is the same undefended audit: the rows share its store
SHARED_CONTROL = "control"


def settings(defense: str, args: Dict, attack: str, images: int, budget: int, out: Path) -> Dict:
    return dict(defense=defense, defense_args=args, model="resnet18", client_mode="eval", images=images,
                steps=[0], attacks=[attack], budget=budget, utility=False, progress=False, out=out)


def audited(store: Lines, case: Dict) -> Dict:
    """One audit's step-0 verdict and its control, kept under the engine's run key."""
    import audit
    from audit.engine.audit import Audit
    from audit.engine.config import config_of_call
    from audit.report.store import settings_key

    from audit.engine.control import base_form

    # the run key leaves the attacks out (each attack's results are kept under it): they are named beside
    # it, with the attacks their positive control runs
    key = {"run_key": settings_key(Audit.from_config(config_of_call(**case)).key_settings()),
           "attacks": list(case["attacks"]), "control": [base_form(a, {}) for a in case["attacks"]]}
    kept = store.get(key)
    if kept is not None:
        return kept
    start = time.time()
    report = audit.run(**case)
    step = report.step(0)
    verdict, control = step["verdict"], step.get("control") or {}
    row = {"defense": case["defense"], "args": case["defense_args"], "attack": case["attacks"][0],
           "label": verdict["label"], "recovered": verdict["recovered"], "exact": verdict["exact"],
           "images": verdict["images"], "rate": verdict.get("recovery_rate"),
           "psnr": step["attacks"].get(case["attacks"][0], {}).get("psnr"), "control": control,
           "minutes": round((time.time() - start) / 60, 1)}
    store.put(key, row)
    return row


def share_control(out: Path, shared: Path) -> None:
    """Point the audit's control store (``out/control``) at the rows' shared one."""
    from audit.engine.control import CONTROL_DIR

    shared.mkdir(parents=True, exist_ok=True)
    link = out / CONTROL_DIR
    if not link.exists():
        out.mkdir(parents=True, exist_ok=True)
        link.symlink_to(shared.resolve(), target_is_directory=True)


def render(rows: List[Dict], uploads: int) -> str:
    def rate(r):
        if not r["images"]:
            return "none: it applies to no upload"
        iv = r.get("rate") or {}
        some = f" (of the {r['images']} of {uploads} uploads it applies to)" if r["images"] < uploads else ""
        return (f"{r['recovered']} of {r['images']}{some}" + (f", 95% CI {iv['low']:.0%}-{iv['high']:.0%}" if iv else "")
                + f", {r['exact']} exact")

    def control(c):
        if not c.get("available"):
            return "n/a"
        return f"{c['recovered']} of {c['images']}, {c['mean_psnr']:.1f} dB"

    return table(["defense", "attack", "step word", "recovered (exact: certified, or aligned PSNR >= 40 dB)",
                  "mean PSNR (dB)", "control without the defense",
                  "minutes (the run that stored the row: a resumed audit reuses its finished attacks)"],
                 [[f"{r['defense']} {', '.join(f'{k}={v}' for k, v in r['args'].items()) or '(registered settings)'}", r["attack"], r["label"],
                   rate(r), "n/a" if r["psnr"] is None else f"{r['psnr']:.2f}", control(r["control"]), r["minutes"]]
                  for r in rows])


def stored(store: Lines) -> List[Dict]:
    """The rows of :data:`CASES` as stored (the last of each), in the table's order, for a render
    that reruns nothing; a missing row is an error that names the command filling it."""
    rows = {(v["defense"], json.dumps(v["args"], sort_keys=True), v["attack"]): v for _, v in store.items()}
    wanted = [(d, json.dumps(a, sort_keys=True), attack) for d, a, attacks in CASES for attack in attacks]
    missing = [w for w in wanted if w not in rows]
    if missing:
        raise SystemExit(f"bench/results/adaptive-span holds no row for {missing[0][0]} {missing[0][1]} "
                         f"{missing[0][2]}: run `python -m bench.bench_adaptive_span` first")
    return [rows[w] for w in wanted]


def page(rows: List[Dict], images: int, budget: int, docs: str, page_path) -> Tuple[Path, str]:
    """The docs page with the section ``docs`` holding these rows' table, and the command that
    makes it (its numbers depend on neither ``--out`` nor ``--render``); writes nothing."""
    words = ["python", "-m", "bench.bench_adaptive_span", *(["--images", str(images)] if images != IMAGES else []),
             *(["--budget", str(budget)] if budget != BUDGET else []), "--docs", docs]
    return with_table(page_path, docs, shlex.join(words), render(rows, images), f"torch {torch.__version__}, cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=IMAGES)
    parser.add_argument("--budget", type=int, default=BUDGET)
    parser.add_argument("--out", default="bench-out/adaptive-span")
    parser.add_argument("--render", action="store_true", help="render the stored rows only (runs no audit)")
    add_docs_option(parser, "docs/adaptive.md")
    args = parser.parse_args()
    store = Lines.of("adaptive-span")
    if args.render and (args.images, args.budget) != (IMAGES, BUDGET):
        parser.error(f"--render shows the stored rows, made at --images {IMAGES} --budget {BUDGET}: drop "
                     "--images and --budget, or rerun without --render")
    rows = stored(store) if args.render else []
    for defense, defense_args, attacks in () if args.render else CASES:
        for attack in attacks:
            out = Path(args.out) / "-".join([defense, *(f"{k}{v}" for k, v in defense_args.items()), attack])
            share_control(out, Path(args.out) / SHARED_CONTROL)
            rows.append(audited(store, settings(defense, defense_args, attack, args.images, args.budget, out)))
            print(rows[-1], flush=True)
    print(render(rows, args.images))
    if args.docs:
        path, text = page(rows, args.images, args.budget, args.docs, args.docs_page)
        path.write_text(text)


if __name__ == "__main__":
    main()
