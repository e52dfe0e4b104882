"""Time one attack iteration against the physical floor and against sequential restarts.

In one process, on the same model and private batch, this measures

* one client training step (forward + backward + SGD update) -- the floor: an optimisation
  attack iteration needs a forward, a backward with graph, and a second backward;
* one attack iteration with 1 restart (eager autograd), and with 1 restart under vmap;
* one iteration with R restarts batched (``torch.func.vmap``);
* the same R restarts as a plain sequential loop inside each iteration
  (``execution="sequential"``) and as R single-restart attacks run one after another.

Usage::

    python -m bench.bench_attack --model convnet --size 32 --restarts 4 --iterations 30
    python -m bench.bench_attack --model resnet18 --threads 2 --device cuda

Run on purpose, not in CI. Times are the best of ``--repeats`` runs (ms per iteration; the
minimum is the least disturbed by other processes on a shared machine).
"""
from __future__ import annotations

import argparse
import time

import torch

from attacks import ATTACKS, observe
from audit.core.data import load_dataset
from audit.core.models import build_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_step_block(model, x, y, device, steps: int):
    """A timer of ``steps`` client training steps (forward + backward + SGD update)."""
    model = model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0 keeps the model unchanged

    def block() -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        _sync(device)
        return (time.perf_counter() - start) / steps

    return block


def attack_block(obs, attack: str, iterations: int, device, runs: int = 1, **settings):
    """A timer of ``runs`` reconstructions of ``iterations`` each, one after another."""
    runner = ATTACKS.build(attack, **settings)
    seeds = iter(range(10 ** 6))

    def block() -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(runs):
            runner.reconstruct(obs, iterations, next(seeds))
        _sync(device)
        return (time.perf_counter() - start) / iterations

    return block


def best_of(timers: dict, repeats: int) -> dict:
    """Warm every timer up, then run them round-robin ``repeats`` times; keep each minimum
    (interleaving spreads the load of other processes evenly over the measurements)."""
    for timer in timers.values():
        timer()  # warm-up (torch.func's first call imports torch._dynamo)
    times = {name: [] for name in timers}
    for _ in range(repeats):
        for name, timer in timers.items():
            times[name].append(timer())
    return {name: min(values) for name, values in times.items()}


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
    rows = best_of({
        "training step (fwd+bwd+SGD)": training_step_block(model, x, y, device, it),
        "1 restart (eager)": attack_block(obs, args.attack, it, device, restarts=1),
        "1 restart (vmap)": attack_block(obs, args.attack, it, device, restarts=1, execution="batched"),
        f"{r} restarts batched (vmap)": attack_block(obs, args.attack, it, device, restarts=r),
        f"{r} restarts, loop inside each iteration": attack_block(
            obs, args.attack, it, device, restarts=r, execution="sequential"),
        f"{r} single-restart attacks one after another": attack_block(obs, args.attack, it, device, runs=r),
    }, rep)
    floor = rows["training step (fwd+bwd+SGD)"]
    one = rows["1 restart (eager)"]
    print(f"{args.attack} on {args.model} {args.size}x{args.size}, batch {args.batch}, {args.client_mode} mode, "
          f"{args.threads} thread(s), {device}; {it} iterations x {rep} repeats (best of repeats)")
    print(f"| {'measurement':<46} | ms / iteration | x training step | x 1 restart |")
    print(f"|{'-' * 48}|---------------:|----------------:|------------:|")
    for name, seconds in rows.items():
        print(f"| {name:<46} | {1e3 * seconds:14.2f} | {seconds / floor:15.2f} | {seconds / one:11.2f} |")
    return rows


if __name__ == "__main__":
    main()
