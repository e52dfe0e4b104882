"""Federated training with defended updates.

* **FedSGD** (the client shares its gradient): every step each client computes its
  defended gradient on a batch of its own data at the global model; the server applies
  ``theta -= lr * mean_clients(g)``.
* **FedAvg** (it shares an update or its state): each client copies the global model and runs
  the audited client's round on a batch of its own data (its steps or epochs, local
  mini-batches, learning rate and optimiser: :class:`~audit.core.client_training.ClientTraining`),
  each step with the defended gradient; the server adds the mean of the clients' parameter
  deltas. Floating-point buffers such as BatchNorm statistics are averaged in both (as the
  defense's declared buffer effect leaves them, for a client that shares its state).
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
from dataclasses import dataclass, field, replace
from typing import Callable, List, Optional

import torch
from torch import Tensor, nn

from audit.client.observe import client_round
from audit.core.client_training import ClientTraining, client_lr
from audit.core.defense_call import as_defense
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
          server_optimizer=None, training: Optional[ClientTraining] = None) -> History:
    """Train ``model`` in place for ``steps`` rounds with the defended updates.

    ``model`` is the client's model: for architectural defenses, the one ``defense.wrap_model``
    already returned (the caller wraps once). ``defense`` is a resolved
    :class:`~audit.core.types.Defense`, a plain callable, or None (no defense). ``callback(step, model)``
    is called before each round's update (``step = 0 .. steps - 1``, the model the clients
    receive) and once after the last one (``step = steps``). Each client runs the audited
    client's round (:func:`audit.client.observe.client_round`) on a fresh batch of
    ``batch_size`` images of its split with ``training`` (None: built from ``local_steps``,
    ``local_lr`` (default ``lr``) and ``optimizer``), local mini-batches and epochs included; a
    defense that accepts ``round`` gets ``round=step``. A client that shares its gradient makes
    the round FedSGD (the server steps by ``lr``), else FedAvg. ``schedule(step)``: a factor on
    the learning rates of round ``step``. ``server_optimizer``: the server's optimiser on the
    round's mean update (its text or record; None or plain SGD: the update is applied as is).
    """
    _check_args(dataset, steps, lr, batch_size, local_steps if training is None else training.steps)
    if training is None:
        fedavg = local_steps > 1 or local_lr is not None or not LocalOptimizer.parse(optimizer).plain
        training = ClientTraining(optimizer or "sgd", local_steps, None, client_lr(lr, local_lr),
                                  shares="update" if fedavg else None)
    server = ServerStep(LocalOptimizer.parse(server_optimizer))
    defense = as_defense(defense) or NoDefense()
    device = torch.device(device)
    model = model.to(device)
    model.train()
    data_gen = torch.Generator().manual_seed(seed)
    defense_gen = torch.Generator(device=device).manual_seed(seed + 1)
    splits = client_splits(len(dataset.train_labels), clients, data_gen)
    fedavg = training.shares != "gradient"
    history = History(model)
    for step in range(steps):
        if callback is not None:
            callback(step, model)
        scale = 1.0 if schedule is None else float(schedule(step))
        # a scaled round (a factor of 0 leaves the model as it is: the server steps by 0)
        rounds = replace(training, lr=training.lr * scale) if fedavg and scale > 0 and scale != 1.0 else training
        losses, updates, local_models = [], [], []
        for split in splits:
            x, y = _batch(dataset, split, batch_size, data_gen, device)
            client = copy.deepcopy(model)
            losses.append(_batch_loss(client, x, y, loss_fn))
            done = client_round(client, x, y, defense, rounds, generator=defense_gen, loss_fn=loss_fn, round=step)
            if training.shares == "state":  # what the server receives: the buffers as the defense leaves them
                with torch.no_grad():
                    for name, b in client.named_buffers():
                        b.copy_(done.buffers[name])
            updates.append(done.update)
            local_models.append(client)
        params = trainable_parameters(model)
        before = [p.detach().clone() for p in params]
        _average_into(model, local_models)
        with torch.no_grad():
            for p, b in zip(params, before):
                p.copy_(b)
        # the mean update (FedAvg: the mean delta over the local learning rate), stepped by the server
        server.step(params, [torch.stack(u).mean(0) for u in zip(*updates)], (training.lr if fedavg else lr) * scale)
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
