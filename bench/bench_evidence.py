"""The null and the leak rule, measured: what chance scores per data set, the old fixed-threshold
rule's false positives against the calibrated rule's, and the verdicts of reference audits
under both rules. Writes ``docs/evidence.md`` with ``--docs null`` / ``--docs verdicts``.

    python -m bench.bench_evidence --part null [--cifar10 PATH] --docs null
    python -m bench.bench_evidence --part verdicts --docs verdicts
    python -m bench.bench_evidence --part decoys --docs decoys

The decoys part audits the negative controls (defense ``decoy``: a flat colour near the data's
mean, an outside photo, a smooth texture) with the default attacks at 8 images, seeds 0 and 1,
with identification by LPIPS and by the 1 - SSIM fallback a user without its weights gets. Each
finished audit is kept in ``bench/results/evidence/results.jsonl`` under its run key, and the
table renders from there.

The old rule (PSNR >= 20 dB or SSIM >= 0.5: recovered; PSNR <= 15 dB and SSIM < 0.5: not
recovered; partially otherwise) is applied to the same metrics the audits stored.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from audit.core.data import load_dataset
from audit.core.evidence import aligned_psnr, ssim_matrix
from audit.core.records import ImageClass
from audit.engine.null import Null
from audit.report.rule import LeakRule
from bench.docs_table import add_docs_option, publish

PHOTOS = ("sklearn/datasets/images/china.jpg", "sklearn/datasets/images/flower.jpg",
          "matplotlib/mpl-data/sample_data/grace_hopper.jpg")


def old_class(psnr: float, ssim: float) -> str:
    """The fixed-threshold rule the calibrated one replaces."""
    if psnr >= 20 or ssim >= 0.5:
        return "recovered"
    if psnr <= 15 and ssim < 0.5:
        return "not recovered"
    return "partially"


def photo_folder(root: Path, grid: int = 12) -> Path:
    """A class-per-photo image folder of ``grid x grid`` crops of photos that matplotlib and
    scikit-learn ship (none of them is in the embedded data set)."""
    import site

    from PIL import Image

    bases = [Path(p) for p in site.getsitepackages()]
    for name in PHOTOS:
        path = next((b / name for b in bases if (b / name).is_file()), None)
        if path is None:
            raise SystemExit(f"{name} is not installed; it ships with scikit-learn / matplotlib")
        img = Image.open(path).convert("RGB")
        side = min(img.size)
        img = img.crop((0, 0, side, side))
        out = root / Path(name).stem
        out.mkdir(parents=True, exist_ok=True)
        step = side // grid
        for r in range(grid):
            for c in range(grid):
                img.crop((c * step, r * step, (c + 1) * step, (r + 1) * step)).save(out / f"{r:02d}_{c:02d}.png")
    return root


def null_row(name: str, dataset, seed: int, limit: int) -> List[str]:
    """One data set: chance levels, and both rules on guesses made without any update."""
    rule = LeakRule()
    null = Null.build(dataset, seed)
    test = dataset.test_images[:limit].float()
    n = len(test)
    nulls = [null.evidence(x) for x in test]
    chance = torch.tensor([e.chance_level for e in nulls])
    # every other private image as the reconstruction of each private image
    prepared = null.similarity.prepare(test)
    to_cands = null.similarity.between(prepared, null.prepared_candidates)  # (recon, candidate)
    to_truth = null.similarity.between(prepared, prepared)  # (recon, private)
    scores = torch.stack([aligned_psnr(test, test[i:i + 1]) for i in range(n)])  # (private, recon)
    ranks = 1 + (to_cands.unsqueeze(0) <= to_truth.T.unsqueeze(-1)).sum(-1)  # (private, recon)
    psnr = torch.stack([10 * torch.log10(1 / (test - test[i:i + 1]).pow(2).flatten(1).mean(1)) for i in range(n)])
    ssim = ssim_matrix(test, test).T  # (private, recon)
    off = ~torch.eye(n, dtype=torch.bool)
    old = {"recovered": 0, "partially": 0}
    new = {ImageClass.RECOVERED: 0, ImageClass.PARTIAL: 0}
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            found = old_class(float(psnr[i, j]), float(ssim[i, j]))
            old[found] = old.get(found, 0) + 1
            cls = rule.classify(float(scores[i, j]), int(ranks[i, j]), float(chance[i]))
            new[cls] = new.get(cls, 0) + 1
    pairs = int(off.sum())
    mean_colour = test.mean((0, 2, 3), keepdim=True).expand(1, *test.shape[1:])
    mc_psnr = 10 * torch.log10(1 / (test - mean_colour).pow(2).flatten(1).mean(1))
    mc_ssim = ssim_matrix(test, mean_colour)[:, 0]
    mc_old = [old_class(float(p), float(s)) for p, s in zip(mc_psnr, mc_ssim)]
    recovered, partial = rule.false_positives(nulls)
    return [name, f"{n} test / {len(null.names)} null items", f"{chance.min():.1f} / {chance.median():.1f} / "
            f"{chance.max():.1f}",
            f"{old['recovered']} / {old['partially']} of {pairs} ({old['recovered'] / pairs:.1%} recovered)",
            f"{mc_old.count('recovered')} / {mc_old.count('partially')} of {n}",
            f"{new[ImageClass.RECOVERED]} / {new[ImageClass.PARTIAL]} of {pairs} "
            f"({new[ImageClass.RECOVERED] / pairs:.2%} recovered)",
            recovered.text(), partial.text(), null.similarity.name]


NULL_HEADER = ["data set", "private images / null items", "chance level, aligned PSNR dB (min / median / max)",
               "old rule, another private image as the reconstruction (recovered / partially)",
               "old rule, the mean colour (recovered / partially)",
               "calibrated rule, another private image (recovered / partially)",
               "calibrated rule false-positive rate, null items leave-one-out: recovered",
               "partially or worse", "identification distance"]


def part_null(args) -> str:
    rows = [null_row("embedded (scikit-image photos, 32x32)", load_dataset("embedded", size=32), args.seed, args.limit)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = photo_folder(Path(tmp))
        rows.append(null_row("a folder of other photos (scikit-learn, matplotlib), 32x32",
                             load_dataset("folder", path=str(folder), size=32, test_fraction=0.35), args.seed, args.limit))
    if args.cifar10:
        rows.append(null_row("CIFAR-10 (local copy)", load_dataset("cifar10", path=args.cifar10, size=32),
                             args.seed, args.limit))
    return table(NULL_HEADER, rows)


# --------------------------------------------------------------------------- verdicts
CASES: Dict[str, Dict[str, object]] = {
    "default audit (prune 0.9, cnn)": {"steps": [0, 1, 5, 20]},
    "prune 0.9, LeNet": {"model": "lenet", "steps": [0], "images": 4},
    "soft-prune, LeNet": {"defense": "soft-prune", "model": "lenet", "steps": [0], "images": 4},
    "decoy: flat colour": {"defense": "decoy", "defense_args": {"kind": "flat"}, "steps": [0]},
    "decoy: smooth texture": {"defense": "decoy", "defense_args": {"kind": "texture"}, "steps": [0]},
}


def command_of(case: Dict[str, object]) -> str:
    parts = ["gia-audit audit"]
    for key, value in case.items():
        if key == "defense_args":
            parts += [f"--defense-arg {k}={v}" for k, v in value.items()]
        elif key == "steps":
            parts.append(f"--steps {','.join(map(str, value))}")
        else:
            parts.append(f"--{key.replace('_', '-')} {value}")
    return " ".join(parts + ["--no-utility"])


def old_verdict(step: Dict[str, object]) -> str:
    classes = [old_class(e["psnr"], e["ssim"]) for e in step["worst_case"]["per_image"]
               if e.get("psnr") is not None and e.get("ssim") is not None]
    label = ("leaks" if "recovered" in classes else "partially" if "partially" in classes
             else "no recovered image")
    return f"{label} ({classes.count('recovered')} / {classes.count('partially')} / {classes.count('not recovered')})"


def part_verdicts(args) -> str:
    import audit

    rows = []
    for name, case in CASES.items():
        if args.cases and not any(c in name for c in args.cases):
            continue
        out = Path(args.out) / name.split(" (")[0].replace(":", "").replace(",", "").replace(" ", "-")
        report = audit.run(out=out, utility=False, progress=False, seed=args.seed, **case)
        # the attacks' own times, stored with the results: the same whether this run resumed or not
        seconds = sum(float(r.get("time_s") or 0.0) for r in report.data["results"])
        for step in report.steps:
            v = step["verdict"]
            rows.append([name if step is report.steps[0] else "", step["step"], old_verdict(step),
                         f"{v['label']} ({v['recovered']} / {v['partially']} / {v['not_recovered']})",
                         _interval(v.get("recovery_rate")), f"{step['worst_case']['psnr_max']:.1f}",
                         f"{step['worst_case']['above_chance_max']:+.1f}"])
        fpr = report.data["false_positive_rate"]["recovered"]
        rows[-1][0] = rows[-1][0] or ""
        rows.append(["", "", f"`{command_of(case)}`", f"rule false-positive rate {_interval(fpr)}", "", "",
                     f"attacks: {seconds:.0f} s"])
        print(rows[-1], flush=True)
    return table(["audit", "step", "old rule (recovered / partially / not)", "calibrated rule",
                  "recovered, 95% CI", "best image PSNR (dB)", "best image above chance (dB)"], rows)


DECOYS = ("flat", "photo", "texture")
SIMILARITIES = ("LPIPS", "1 - SSIM")


def decoy_key(kind: str, seed: int, out: Path) -> Dict[str, object]:
    """What a decoy audit's row is kept under: its settings and the engine's run key today."""
    from audit.engine.audit import Audit
    from audit.engine.config import AuditConfig
    from audit.report.store import settings_key

    config = AuditConfig(defense="decoy", defense_args={"kind": kind}, steps=[0], images=8, seed=seed,
                         utility=False, out=str(out))
    return {"kind": kind, "seed": seed, "run_key": settings_key(Audit.from_config(config).key_settings())}


def decoy_row(kind: str, seed: int, out: Path) -> Dict[str, object]:
    """One decoy audit's step word, counts, the step bars and the rule's per-image rates."""
    import time

    import audit

    start = time.time()
    report = audit.run(defense="decoy", defense_args={"kind": kind}, steps=[0], images=8, seed=seed,
                       utility=False, progress=False, out=out)
    step = report.step(0)
    verdict = step["verdict"]
    return {"similarity": report.data["null"]["similarity"], "label": verdict["label"], "judged": verdict["judged"],
            "recovered": verdict["recovered"], "partially": verdict["partially"], "images": verdict["images"],
            "bars": verdict.get("bars") or [], "short_of": verdict.get("short_of"),
            "per_image": report.data["false_positive_rate"], "minutes": round((time.time() - start) / 60, 1),
            "best_above_chance": step["worst_case"]["above_chance_max"]}


def part_decoys(args) -> str:
    import os

    from bench.jsonl import Lines

    store = Lines.of("evidence")
    rows = []
    order = [(kind, similarity, seed) for kind in DECOYS for similarity in SIMILARITIES for seed in (0, 1)]
    for kind, similarity, seed in order:
        if args.cases and not any(c in kind for c in args.cases):
            continue
        out = Path(args.out) / f"decoy-{kind}-{'lpips' if similarity == 'LPIPS' else 'ssim'}-{seed}"
        saved = os.environ.get("TORCH_HOME")
        if similarity != "LPIPS":  # the weights looked for where none are: the 1 - SSIM fallback
            os.environ["TORCH_HOME"] = str(Path(args.out) / "no-lpips-weights")
        try:
            key = {**decoy_key(kind, seed, out), "similarity": similarity}
            row = store.get(key)
            if row is None:
                row = decoy_row(kind, seed, out)
                store.put(key, row)
        finally:
            if saved is None:
                os.environ.pop("TORCH_HOME", None)
            else:
                os.environ["TORCH_HOME"] = saved
        rows.append(decoy_table_row(kind, seed, row))
        print(rows[-1], flush=True)
    return table(["decoy", "seed", "identification", "step word (8 images)", "recovered / partially",
                  "best image above chance (dB)", "'partially' needs, its step false-positive rate (bound; measured)",
                  "'leaks' needs, its step rate", "minutes"], rows)


def decoy_table_row(kind: str, seed: int, row: Dict[str, object]) -> List[object]:
    bars = {b["word"]: b for b in row["bars"]}
    part, leak = bars.get("partially") or {}, bars.get("leaks") or {}

    def rates(bar):
        if not bar:
            return "n/a"
        seen = bar.get("measured") or {}
        return (f"{bar['needed']} of {bar['images']}: <= {_percent(bar['step_rate'])}"
                + (f"; {_percent(seen['rate'])}" if seen else ""))

    return [kind, seed, str(row["similarity"]).split(" on ")[0], row["label"], f"{row['recovered']} / {row['partially']}",
            f"{row['best_above_chance']:+.2f}", rates(part), rates(leak), row["minutes"]]


def _interval(data: Optional[Dict[str, object]]) -> str:
    if not data or not data.get("n"):
        return "n/a"
    return f"{data['k']} of {data['n']} ({_percent(data['low'])}-{_percent(data['high'])})"


def _percent(rate: float) -> str:
    """Whole percents, one decimal below 10% (an upper bound of 0.35% is not "0%")."""
    return f"{rate:.1%}" if 0 < rate < 0.1 else f"{rate:.0%}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("null", "verdicts", "decoys"), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=160, help="private images per data set (null part)")
    p.add_argument("--cifar10", default=None, help="a local CIFAR-10 python folder (null part)")
    p.add_argument("--cases", nargs="*", help="substrings of the audits to run (verdicts part; default all)")
    p.add_argument("--out", default="bench-out/evidence", help="where the audits store their results (resumable)")
    p.add_argument("--threads", type=int, default=2)
    add_docs_option(p, "docs/evidence.md")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = {"null": part_null, "verdicts": part_verdicts, "decoys": part_decoys}[args.part](args)
    print(text)
    publish(args, "bench.bench_evidence", argv, text, f"torch {torch.__version__}, {args.threads} threads")


if __name__ == "__main__":
    main()
