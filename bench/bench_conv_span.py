"""The conv-span attack on the registered ResNet-18 (width 64, 32x32 embedded test images, step 0):
per image its aligned PSNR, certificate and time, with train- and eval-mode BatchNorm, beside a
flat mean-colour guess; results kept per image as they finish (a rerun resumes), table written to
docs/conv-span.md.

    python -m bench.bench_conv_span [--modes eval:8,train:4] [--budget 200] [--seed 0] [--device cpu]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

import attacks  # noqa: F401  (registers the attacks)
from attacks.presets import ATTACKS
from audit.client.observe import observe
from audit.core.data import load_dataset
from audit.core.evidence import aligned_psnr
from audit.core.models import build_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "conv-span"
DOC = ROOT / "docs" / "conv-span.md"


def picks(dataset, count: int):
    """``count`` test images spread over the photos (one per 20 crops)."""
    step = max(1, len(dataset.test_labels) // count)
    return [i * step for i in range(count)]


def code_key() -> str:
    """The attack's source, hashed: a result made by other code is not reused."""
    text = b"".join((ROOT / "attacks" / name).read_bytes() for name in ("conv_span.py", "conv_span_algebra.py"))
    return hashlib.sha256(text).hexdigest()[:10]


def run_one(mode: str, index: int, budget: int, seed: int, device: str, width: int) -> dict:
    path = RESULTS / f"{mode}-w{width}-b{budget}-s{seed}-i{index}-{code_key()}.json"
    if path.exists():
        return json.loads(path.read_text())
    data = load_dataset("embedded")
    model = build_model("resnet18", data.input_shape, data.num_classes, width=width, mean=data.mean, std=data.std,
                        seed=seed).to(device)
    x, y = data.test_images[index:index + 1].to(device), data.test_labels[index:index + 1].to(device)
    obs = observe(model, x, y, None, client_mode=mode, seed=seed)
    start = time.perf_counter()
    rec = ATTACKS.build("conv-span").reconstruct(obs, budget, seed=seed)
    seconds = time.perf_counter() - start
    flat = x.mean((2, 3), keepdim=True).expand_as(x)
    row = {"mode": mode, "index": index, "budget": budget, "seconds": round(seconds, 1),
           "psnr": round(float(aligned_psnr(rec.inputs, x)), 2), "flat_colour_psnr": round(float(aligned_psnr(flat, x)), 2),
           "certificate_error": rec.trace["certificate_error"], "certified": rec.trace["certified"],
           "residual": rec.trace["residual"], "label_ok": bool(rec.labels.tolist() == y.tolist())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=1))
    return row


def render(rows, width: int, budget: int) -> str:
    lines = ["# Conv-span on ResNet-18", "",
             f"Command: `python -m bench.bench_conv_span` (registered `resnet18`, width {width}, embedded 32x32 test "
             f"images, batch 1, step 0, budget {budget} gradient evaluations = {2 * budget} residual evaluations, "
             "one CPU thread). Aligned PSNR: after the best per-channel gain and offset; the flat guess is each "
             "image's own mean colour (what the optimisation attacks reached on this model). Certificate: the "
             "relative error with which the recovered image reproduces the upload.", "",
             "| BN mode | image | aligned PSNR (dB) | flat mean colour (dB) | certificate error | label | seconds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['index']} | {r['psnr']:.2f} | {r['flat_colour_psnr']:.2f} | "
                     f"{r['certificate_error']:.1e} | {'right' if r['label_ok'] else 'wrong'} | {r['seconds']:.0f} |")
    for mode in sorted({r["mode"] for r in rows}):
        mine = [r for r in rows if r["mode"] == mode]
        exact = sum(r["psnr"] >= 40 for r in mine)
        lines += ["", f"- {mode}: {exact} of {len(mine)} images at >= 40 dB, mean {sum(r['psnr'] for r in mine) / len(mine):.1f} dB "
                      f"against {sum(r['flat_colour_psnr'] for r in mine) / len(mine):.1f} dB for the flat guess; "
                      f"{sum(r['certified'] for r in mine)} certified; {sum(r['seconds'] for r in mine) / len(mine):.0f} s per image."]
    lines += ["", "## What it does and where it stops", "",
              "The attack (`attacks/conv_span.py`) asks every patch of the candidate's input maps to the convolutions "
              "with fewer output positions than channels (stages 3 and 4 of ResNet-18 at batch 1) to lie in the row "
              "space of that convolution's uploaded weight gradient, and minimises that residual over the image with "
              "L-BFGS; a float64 finish, a Gauss-Newton fit of each channel's gain and offset to the whole upload, and "
              "the certificate follow.", "",
              "- Eval-mode BatchNorm at initialisation makes the network positively homogeneous (no biases, identity "
              "normalisation): the residual's landscape is benign and a start that does not stall converges to the "
              "image to float precision. A start that stalls is restarted, but on some images every start stalls at "
              "the same residual (rows with a certificate error above 0.1).",
              "- Train-mode BatchNorm normalises every channel of every layer by the image's own statistics; the "
              "residual (and even plain feature inversion against the exact 16x16x128 stage-2 map) then has a basin "
              "a flat start does not reach: rows 'train' above. This is the gap left for the train-mode targets.",
              "- Batches: at batch 4 only stage 4 keeps the span (4 x 64 positions fill stage 3's 256 channels), and "
              "the joint row space is also filled by maps that mix the images: in the batches tried at most one "
              "image came back exact and the others did not separate (tests/test_conv_span.py holds the batch of "
              "two that it does)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="eval:8,train:4", help="BatchNorm modes, each with its image count")
    parser.add_argument("--budget", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = load_dataset("embedded")
    rows = []
    for entry in args.modes.split(","):
        mode, _, count = entry.partition(":")
        for index in picks(data, int(count or 8)):
            rows.append(run_one(mode, index, args.budget, args.seed, args.device, args.width))
            print(json.dumps(rows[-1]), flush=True)
    DOC.write_text(render(rows, args.width, args.budget))


if __name__ == "__main__":
    main()
