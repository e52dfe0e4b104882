"""Throughput of the grouped optimisation attack: image-iterations per second as the batch of
images x restarts grows, against one image and against a forward+backward of the model.

For each model (the project's ``convnet`` and CIFAR ``resnet18``, 32x32, client in train
mode) and each group size M it builds M observations of the same model (M private images,
each with its own gradient and label) and times IG on all of them as one batched run
(``OptimizationAttack.reconstruct_many``: an outer vmap over observations), i.e. what the
audit does for one (step, attack). Also, in the same process:

* a forward+backward of the model on one image (the floor);
* R restarts batched against the same R restarts run one after another (``--restarts``);
* with ``--precision-check`` on cuda: IG's PSNR on natural images with TF32 and with
  channels-last next to plain float32 (they are only worth using within 0.1 dB).

Usage (run on purpose, not in CI)::

    python bench/bench_throughput.py --device cpu --threads 2 --members 1,8 --iterations 5
    python bench/bench_throughput.py --device cuda --members 1,8,64,256 --precision-check

Times are the best of ``--repeats`` interleaved runs (see bench_attack.best_of).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from attacks import ATTACKS, observe  # noqa: E402
from audit.core.data import load_dataset  # noqa: E402
from audit.core.metrics import psnr  # noqa: E402
from audit.core.models import build_model  # noqa: E402
from bench_attack import _sync, best_of, training_step_block  # noqa: E402
from docs_table import add_docs_option, publish  # noqa: E402


def observations(model, images, labels, mode: str):
    """One observation per image, all sharing the first one's model copy (as the audit's do
    in content; sharing the object keeps 256 ResNet-18 observations in memory)."""
    first = observe(model, images[:1], labels[:1], client_mode=mode)
    out = [first]
    for i in range(1, images.shape[0]):
        o = observe(model, images[i:i + 1], labels[i:i + 1], client_mode=mode, seed=i)
        out.append(dataclasses.replace(o, model=first.model))
    return out


def grouped_block(obs, iterations: int, device, restarts: int = 1, runs: int = 1):
    """Seconds per iteration of IG on every observation at once (``runs`` times in a row)."""
    attack = ATTACKS.build("ig", restarts=restarts)

    def block() -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(runs):
            attack.reconstruct_many(obs, iterations * restarts, list(range(len(obs))),
                                    max_members=len(obs) * restarts)
        _sync(device)
        return (time.perf_counter() - start) / iterations

    return block


def precision_check(data, device, iterations: int, images: int) -> dict:
    """IG's mean PSNR on natural test images in float32, with TF32, and channels-last."""
    model = build_model("convnet", data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                        seed=0).to(device)
    x, y = data.test_images[:images].to(device), data.test_labels[:images].to(device)
    out = {}
    for name in ("float32", "tf32", "channels_last"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
        net = model.to(memory_format=torch.channels_last) if name == "channels_last" else model
        obs = observations(net, x, y, "train")
        start = time.perf_counter()
        recs = ATTACKS.build("ig").reconstruct_many(obs, iterations, list(range(images)), max_members=images)
        _sync(device)
        out[name] = (sum(float(psnr(r.inputs, x[i:i + 1])) for i, r in enumerate(recs)) / images,
                     time.perf_counter() - start)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="convnet,resnet18")
    p.add_argument("--members", default="1,8,64,256", help="group sizes (images x restarts)")
    p.add_argument("--restarts", type=int, default=4, help="R for batched against sequential restarts")
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--client-mode", default="train", choices=["train", "eval"])
    p.add_argument("--precision-check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    add_docs_option(p, "docs/performance.md")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    data = load_dataset("embedded", size=32)
    sizes = [int(m) for m in args.members.split(",")]
    gen = torch.Generator().manual_seed(args.seed)
    pool = torch.rand(max(sizes), *data.input_shape, generator=gen).to(device)
    pool_labels = torch.randint(0, data.num_classes, (max(sizes),), generator=gen).to(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {args.threads} thread(s)"
    print(f"IG, 32x32, client {args.client_mode} mode, {name}; {args.iterations} iterations, best of "
          f"{args.repeats}")
    results = {}
    table = ["| model | group M (images x restarts) | ms / iteration | image-iterations / s | x M=1 | "
             "x fwd+bwd of 1 image |", "|---|---:|---:|---:|---:|---:|"]
    ratios = [f"| model | {args.restarts} restarts batched / the same run one after another |", "|---|---:|"]
    for model_name in args.models.split(","):
        model = build_model(model_name, data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                            seed=args.seed).to(device)
        obs = observations(model, pool, pool_labels, args.client_mode)
        it, r = args.iterations, args.restarts
        timers = {"fwd+bwd (1 image)": training_step_block(model, pool[:1], pool_labels[:1], device, it)}
        for m in sizes:
            timers[f"M={m}"] = grouped_block(obs[:m], it, device)
        timers[f"{r} restarts batched"] = grouped_block(obs[:1], it, device, restarts=r)
        timers[f"{r} restarts sequential"] = grouped_block(obs[:1], it, device, runs=r)
        rows = best_of(timers, args.repeats)
        results[model_name] = rows
        floor, one = rows["fwd+bwd (1 image)"], rows[f"M={sizes[0]}"]
        for m in sizes:
            t = rows[f"M={m}"]
            table.append(f"| {model_name} | {m} | {1e3 * t:.2f} | {m / t:,.0f} | {t / one:.2f} | {t / floor:.2f} |")
        batched, sequential = rows[f"{r} restarts batched"], rows[f"{r} restarts sequential"]
        ratios.append(f"| {model_name} | {batched / sequential:.2f} |")
    text = "\n".join(table) + "\n\n" + "\n".join(ratios)
    if args.precision_check and device.type == "cuda":
        checked = precision_check(load_dataset("embedded", size=32), device, 200, 8)
        lines = ["| arithmetic (convnet, 8 test images, IG 200 iterations) | mean PSNR dB | difference | seconds |",
                 "|---|---:|---:|---:|"]
        for key, (value, seconds) in checked.items():
            lines.append(f"| {key} | {value:.3f} | {value - checked['float32'][0]:+.3f} dB | {seconds:.1f} |")
        text += "\n\n" + "\n".join(lines)
        results["precision"] = checked
    print("\n" + text)
    publish(args, "bench_throughput.py", argv, text, f"torch {torch.__version__}, {name}")
    return results


if __name__ == "__main__":
    main()
