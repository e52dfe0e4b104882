"""Time one attack iteration against the physical floor and against sequential restarts.

In one process, on the same model and private batch, this measures

* one client training step (forward + backward + SGD update) -- the floor: an optimisation
  attack iteration needs a forward, a backward with graph, and a second backward;
* one attack iteration with 1 restart (eager autograd), and with 1 restart under vmap;
* one iteration with R restarts batched (``torch.func.vmap``);
* the same R restarts as a plain sequential loop inside each iteration
  (``execution="sequential"``) and as R single-restart attacks run one after another.

Usage::

    python bench/bench_attack.py --model convnet --size 32 --restarts 4 --iterations 30
    python bench/bench_attack.py --model resnet18 --threads 2 --device cuda

Run on purpose, not in CI. Times are medians of ``--repeats`` runs (ms per iteration).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from attacks import ATTACKS, observe  # noqa: E402
from audit.data import load_dataset  # noqa: E402
from audit.models import build_model  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_training_step(model, x, y, device, steps: int) -> float:
    """Median seconds of one forward + backward + SGD update on the client's batch."""
    model = model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0 keeps the model unchanged
    times = []
    for i in range(steps + 3):
        _sync(device)
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        _sync(device)
        if i >= 3:  # warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_attack(obs, attack: str, iterations: int, repeats: int, device, **settings) -> float:
    """Median seconds per iteration of ``reconstruct`` (setup and final selection amortised)."""
    runner = ATTACKS.build(attack, **settings)
    runner.reconstruct(obs, 2, 0)  # warm-up (torch.func's first call imports torch._dynamo)
    times = []
    for r in range(repeats):
        _sync(device)
        start = time.perf_counter()
        runner.reconstruct(obs, iterations, r)
        _sync(device)
        times.append((time.perf_counter() - start) / iterations)
    return statistics.median(times)


def time_one_after_another(obs, attack: str, restarts: int, iterations: int, repeats: int, device) -> float:
    """``restarts`` single-restart attacks run one after another (the reference tools' way)."""
    runner = ATTACKS.build(attack, restarts=1)
    runner.reconstruct(obs, 2, 0)
    times = []
    for r in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for k in range(restarts):
            runner.reconstruct(obs, iterations, 1000 * r + k)
        _sync(device)
        times.append((time.perf_counter() - start) / iterations)
    return statistics.median(times)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--attack", default="ig")
    p.add_argument("--model", default="convnet")
    p.add_argument("--width", type=int, default=None, help="model width (convnet, lenet, resnet18)")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--restarts", type=int, default=4)
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 on a shared machine)")
    p.add_argument("--client-mode", default="train", choices=["train", "eval"])
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    data = load_dataset("embedded", size=args.size)
    model_kw = {} if args.width is None else {"width": args.width}
    model = build_model(args.model, data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                        **model_kw).to(device)
    x, y = data.train_images[:args.batch].to(device), data.train_labels[:args.batch].to(device)
    obs = observe(model, x, y, client_mode=args.client_mode)

    r, it, rep = args.restarts, args.iterations, args.repeats
    rows = {
        "training step (fwd+bwd+SGD)": time_training_step(model, x, y, device, 10 * rep),
        "1 restart (eager)": time_attack(obs, args.attack, it, rep, device, restarts=1),
        "1 restart (vmap)": time_attack(obs, args.attack, it, rep, device, restarts=1, execution="batched"),
        f"{r} restarts batched (vmap)": time_attack(obs, args.attack, it, rep, device, restarts=r),
        f"{r} restarts, loop inside each iteration": time_attack(
            obs, args.attack, it, rep, device, restarts=r, execution="sequential"),
        f"{r} single-restart attacks one after another": time_one_after_another(
            obs, args.attack, r, it, rep, device),
    }
    floor = rows["training step (fwd+bwd+SGD)"]
    one = rows["1 restart (eager)"]
    print(f"{args.attack} on {args.model} {args.size}x{args.size}, batch {args.batch}, {args.client_mode} mode, "
          f"{args.threads} thread(s), {device}; {it} iterations x {rep} repeats (median)")
    print(f"| {'measurement':<46} | ms / iteration | x training step | x 1 restart |")
    print(f"|{'-' * 48}|---------------:|----------------:|------------:|")
    for name, seconds in rows.items():
        print(f"| {name:<46} | {1e3 * seconds:14.2f} | {seconds / floor:15.2f} | {seconds / one:11.2f} |")
    return rows


if __name__ == "__main__":
    main()
