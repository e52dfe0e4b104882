"""Federated training with defended updates.

* **FedSGD** (``local_steps=1`` and no ``local_lr``): every step each client computes its
  defended gradient on a batch of its own data at the global model; the server applies
  ``theta -= lr * mean_clients(g)``.
* **FedAvg** (``local_steps > 1`` or ``local_lr`` given): each client copies the global model
  and runs ``local_steps`` SGD steps (``local_lr``, default ``lr``) on its own batches, each
  with the defended gradient; the server adds the mean of the clients' parameter deltas
  (floating-point buffers such as BatchNorm statistics are averaged too).
* **A server optimiser** (``server_optimizer``, FedOpt / FedAvgM): the server treats the
  round's mean gradient (FedSGD) or mean delta over the learning rate (FedAvg) as a
  gradient and steps with SGD momentum / Nesterov / weight decay or Adam, its state kept
  across rounds. With one client and FedSGD this is centralised training with that
  optimiser, as papers train the models they attack between steps.

Clients hold disjoint random splits of the training set. Architectural defenses are applied
first (``defense.wrap_model`` modifies the model in place); data-side transforms and
training-time losses (ATS, PRECODE's KL term) run inside the defense, on the client.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
from torch import Tensor, nn

from audit.core.defense_call import as_defense, call_defense
from audit.core.models import preserved_buffers

from audit.core.errors import ConfigError, DataError
from audit.core.local_training import LocalOptimizer, optimizer_step
from audit.core.types import LossFn, NoDefense, default_loss_fn, trainable_parameters


@dataclass
class History:
    """What :func:`train` returns: the (wrapped) model and the mean client loss per step."""

    model: nn.Module
    losses: List[float] = field(default_factory=list)


def client_splits(n: int, clients: int, generator: torch.Generator) -> List[Tensor]:
    """Disjoint random index splits of ``range(n)``, one per client."""
    if clients < 1 or clients > n:
        raise ConfigError(f"clients must be in [1, {n}] (the training set size), got {clients}")
    return list(torch.randperm(n, generator=generator).tensor_split(clients))


def _batch(dataset, split: Tensor, batch_size: int, generator: torch.Generator, device):
    pick = split[torch.randperm(len(split), generator=generator)[:batch_size]]
    return dataset.train_images[pick].to(device), dataset.train_labels[pick].to(device)


def _batch_loss(model: nn.Module, inputs: Tensor, labels: Tensor, loss_fn: LossFn) -> float:
    with torch.no_grad(), preserved_buffers(model):
        return float(loss_fn(model(inputs), labels))


def _apply(params: List[nn.Parameter], grads: List[Tensor], lr: float) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(lr * g.detach())


class ServerStep:
    """The server's step on the round's mean update: ``theta -= lr * direction``, the
    direction from ``optimizer``'s rule with its state kept across rounds (plain SGD: the
    update itself)."""

    def __init__(self, optimizer: LocalOptimizer):
        self.optimizer = optimizer
        self.state: dict = {}
        self.rounds = 0

    def step(self, params: List[nn.Parameter], grads: List[Tensor], lr: float) -> None:
        if not self.optimizer.plain:
            self.rounds += 1
            moved, self.state = optimizer_step(self.optimizer, {str(i): p.detach() for i, p in enumerate(params)},
                                               {str(i): g.detach() for i, g in enumerate(grads)}, self.state,
                                               self.rounds)
            grads = list(moved.values())
        _apply(params, grads, lr)


def _check_args(dataset, steps, lr, batch_size, local_steps) -> None:
    for attr in ("train_images", "train_labels"):
        if not hasattr(dataset, attr):
            raise DataError(f"the dataset has no {attr}; pass audit.core.data.load_dataset(name)")
    if steps < 0 or batch_size < 1 or local_steps < 1 or not lr > 0:
        raise ConfigError(f"need steps >= 0, batch_size >= 1, local_steps >= 1 and lr > 0; got steps={steps}, "
                          f"batch_size={batch_size}, local_steps={local_steps}, lr={lr}")


def _average_into(model: nn.Module, clients: List[nn.Module]) -> None:
    """``theta += mean(theta_c - theta)`` for parameters; mean of float buffers."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.stack([dict(c.named_parameters())[name] for c in clients]).mean(0))
        for name, b in model.named_buffers():
            if b.is_floating_point():
                b.copy_(torch.stack([dict(c.named_buffers())[name] for c in clients]).mean(0))
            else:
                b.copy_(dict(clients[0].named_buffers())[name])


def train(model: nn.Module, dataset, defense, steps: int, *, lr: float, batch_size: int,
          clients: int = 1, local_steps: int = 1, local_lr: Optional[float] = None, seed: int = 0,
          device="cpu", loss_fn: LossFn = default_loss_fn,
          callback: Optional[Callable[[int, nn.Module], None]] = None,
          schedule: Optional[Callable[[int], float]] = None, optimizer=None,
          server_optimizer=None) -> History:
    """Train ``model`` in place for ``steps`` rounds with the defended updates.

    ``model`` is the client's model: for architectural defenses, the one ``defense.wrap_model``
    already returned (the caller wraps once). ``defense`` is a resolved
    :class:`~audit.core.types.Defense`, a plain callable, or None (no defense). ``callback(step, model)``
    is called before each round's update (``step = 0 .. steps - 1``, the model the clients
    receive) and once after the last one (``step = steps``). A defense that accepts a ``round``
    keyword gets ``round=step`` (every local step of a FedAvg round shares the round's index).
    ``schedule(step)``: a factor on the learning rates of round ``step`` (None: constant).
    ``optimizer``: the clients' local optimiser (a :class:`~audit.core.local_training.LocalOptimizer`
    or its text; a fresh state each round, as a client builds its optimiser in each fit; one
    other than plain SGD makes the round FedAvg). ``server_optimizer``: the server's optimiser on
    the round's mean update (its text or record; None or plain SGD: the update is applied as is).
    """
    optimizer = LocalOptimizer.parse(optimizer)
    server = ServerStep(LocalOptimizer.parse(server_optimizer))
    _check_args(dataset, steps, lr, batch_size, local_steps)
    defense = as_defense(defense) or NoDefense()
    device = torch.device(device)
    model = model.to(device)
    model.train()
    data_gen = torch.Generator().manual_seed(seed)
    defense_gen = torch.Generator(device=device).manual_seed(seed + 1)
    splits = client_splits(len(dataset.train_labels), clients, data_gen)
    fedavg = local_steps > 1 or local_lr is not None or not optimizer.plain
    step_lr = lr if local_lr is None else local_lr
    history = History(model)
    for step in range(steps):
        if callback is not None:
            callback(step, model)
        scale = 1.0 if schedule is None else float(schedule(step))
        losses, updates, local_models = [], [], []
        for split in splits:
            client = copy.deepcopy(model) if fedavg else model
            params = trainable_parameters(client)
            state: dict = {}
            for k in range(local_steps):
                x, y = _batch(dataset, split, batch_size, data_gen, device)
                if k == 0:
                    losses.append(_batch_loss(client, x, y, loss_fn))
                grads = call_defense(defense, client, x, y, loss_fn=loss_fn, generator=defense_gen,
                                     round=step)
                if fedavg:
                    if not optimizer.plain:
                        named = {str(i): p.detach() for i, p in enumerate(params)}
                        moved, state = optimizer_step(optimizer, named, {str(i): g.detach() for i, g in
                                                                         enumerate(grads)}, state, k + 1)
                        grads = list(moved.values())
                    _apply(params, grads, step_lr * scale)
                else:
                    updates.append([g.detach() for g in grads])
            local_models.append(client)
        params = trainable_parameters(model)
        if fedavg:
            before = None if server.optimizer.plain else [p.detach().clone() for p in params]
            _average_into(model, local_models)
            if before is not None:  # the mean delta over the learning rate, stepped by the server
                deltas = [(b - p.detach()) / (step_lr * scale) for b, p in zip(before, params)]
                with torch.no_grad():
                    for p, b in zip(params, before):
                        p.copy_(b)
                server.step(params, deltas, step_lr * scale)
        else:
            server.step(params, [torch.stack(c).mean(0) for c in zip(*updates)], lr * scale)
        history.losses.append(sum(losses) / len(losses))
    if callback is not None:
        callback(steps, model)
    return history


def evaluate(model: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``model`` (eval mode, restored afterwards) on ``images``."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.no_grad():
            for start in range(0, len(labels), batch_size):
                x = images[start:start + batch_size].to(device)
                y = labels[start:start + batch_size].to(device)
                correct += int((model(x).argmax(1) == y).sum())
    finally:
        model.train(was_training)
    return correct / max(1, len(labels))
