"""Train a model the way an FL deployment would before it is audited, and save its
``state_dict`` as a user's training code would: FedAvg rounds with the audit's own client
simulation (:func:`audit.client.fl.train`, no defense), the model given as
``package.module:attr`` and normalised with the data set's statistics, as the audit runs it.
The file holds ``{"state_dict": ..., "rounds": ..., "test_accuracy": ...}`` for
``gia-audit audit --checkpoint``.

Usage (~3 minutes on 2 CPU cores for the defaults)::

    python -m bench.make_cifar_format --out bench-data/cifar-photos
    python -m bench.train_checkpoint --data-path bench-data/cifar-photos --rounds 300 \\
        --out bench-data/resnet18-r300.pt
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Dict

import torch

from audit.client.fl import evaluate, train
from audit.core.data import load_dataset
from audit.core.model_source import build_audited_model
from audit.core.models import with_normalization


def train_checkpoint(model: str, data, rounds: int, out: Path, *, lr: float, batch_size: int, clients: int,
                     local_steps: int, seed: int) -> Dict[str, Any]:
    """Train ``model`` (unnormalised, as the user's code builds it) behind the data set's
    normalisation for ``rounds`` FedAvg rounds; save and describe its checkpoint."""
    net = build_audited_model(model, {}, data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                              normalize="none", seed=seed)
    start = time.perf_counter()

    def report(step: int, _model) -> None:
        if step and step % 50 == 0:
            print(f"round {step}/{rounds}: {time.perf_counter() - start:.0f} s", flush=True)

    train(with_normalization(net, data.mean, data.std), data, None, rounds, lr=lr, batch_size=batch_size,
          clients=clients, local_steps=local_steps, seed=seed, callback=report)
    seconds = time.perf_counter() - start
    accuracy = evaluate(with_normalization(net, data.mean, data.std), data.test_images, data.test_labels)
    info = {"model": model, "rounds": rounds, "lr": lr, "batch_size": batch_size, "clients": clients,
            "local_steps": local_steps, "seed": seed, "test_accuracy": accuracy, "seconds": round(seconds, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": net.state_dict(), **info}, out)
    return info


def add_training_options(p: argparse.ArgumentParser) -> None:
    """The model, data and FedAvg settings the checkpoint is trained with (shared with the
    reference audit, which trains the checkpoint when it is missing)."""
    p.add_argument("--model", default="torchvision.models:resnet18")
    p.add_argument("--data-path", default="bench-data/cifar-photos")
    p.add_argument("--rounds", type=int, default=300, help="FedAvg rounds of the checkpoint")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-batch-size", type=int, default=8)
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--local-steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)


def train_from_options(args: argparse.Namespace, out: Path) -> Dict[str, Any]:
    """:func:`train_checkpoint` with the settings of :func:`add_training_options`."""
    data = load_dataset("cifar10", args.data_path)
    return train_checkpoint(args.model, data, args.rounds, out, lr=args.lr, batch_size=args.train_batch_size,
                            clients=args.clients, local_steps=args.local_steps, seed=args.seed)


def main(argv=None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_options(p)
    p.add_argument("--out", default="bench-data/resnet18-r300.pt")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = train_from_options(args, Path(args.out))
    print(f"saved {args.out}: {info}")
    return info


if __name__ == "__main__":
    main()
