"""Make an :class:`~audit.core.types.Observation` from a model and a private batch.

This is the client side of one federated round: the (defended) gradient, or for FedAvg the
update of ``local_steps`` local steps of the client's optimiser (SGD with momentum / weight
decay, Adam, AdamW), with its BatchNorm buffers when the client shares its state, computed
with a seeded ``torch.Generator``. Tests, the CLI and the audit engine use it; attacks only ever see
the returned observation.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import Tensor, nn

from audit.core.buffers import has_running_stats, state_buffers
from audit.core.defense_call import as_defense, call_defense
from audit.core.errors import ConfigError, DataError
from audit.core.local_training import LocalOptimizer
from audit.core.models import Normalize, last_linear, preserved_buffers
from audit.core.types import LossFn, Observation, default_loss_fn, resolve_shares, trainable_parameters
from audit.core.unroll import client_update


def _check_batch(images: Tensor, labels: Tensor, num_classes: int) -> None:
    if not isinstance(images, Tensor) or images.dim() != 4:
        raise DataError(f"images must be a (B, C, H, W) tensor, got {getattr(images, 'shape', type(images))}")
    if images.min() < 0 or images.max() > 1:
        raise DataError("images must be in [0, 1] (normalisation is the model's first layer); "
                        "divide uint8 images by 255")
    if not isinstance(labels, Tensor) or labels.shape != (images.shape[0],):
        raise DataError(f"labels must be a ({images.shape[0]},) tensor of class indices, "
                        f"got {getattr(labels, 'shape', type(labels))}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise DataError(f"labels must be in 0..{num_classes - 1}")


def _normalisation(model: nn.Module):
    for m in model.modules():
        if isinstance(m, Normalize):
            return tuple(m.mean.flatten().tolist()), tuple(m.std.flatten().tolist())
    return None, None


def observe(
    model: nn.Module,
    images: Tensor,
    labels: Tensor,
    defense=None,
    *,
    share_labels: bool = False,
    local_steps: int = 1,
    local_lr: float = 0.1,
    local_batch_size: Optional[int] = None,
    loss_fn: LossFn = default_loss_fn,
    client_mode: str = "train",
    step: int = 0,
    seed: int = 0,
    extra: Optional[dict] = None,
    optimizer=None,
    shares: Optional[str] = None,
) -> Observation:
    """Run one client round on ``(images, labels)`` and return what the server observes.

    The model is copied (neither it nor its BatchNorm buffers change). ``defense`` is None,
    a :class:`~audit.core.types.Defense` or a defended-gradient callable (a name is resolved
    first: :func:`defenses.resolve_defense`); every
    local step shares ``defense(model_k, batch_k, labels_k, loss_fn=, generator=)`` (plus
    ``round=step`` for a defense that accepts the FL round index).
    Architectural defenses: pass the client's model, i.e. the one ``defense.wrap_model``
    returned. FedAvg (``local_steps > 1`` or an ``optimizer`` other than plain SGD, e.g.
    ``"sgd:momentum=0.9"``) shares ``(theta_0 - theta_K) / local_lr``; ``shares="state"`` adds
    the client's buffers after its training (one train-mode forward pass per local step, as a
    training loop runs; the defense's own passes leave them alone).
    """
    if client_mode not in ("train", "eval"):
        raise ConfigError(f"client_mode must be 'train' or 'eval', got {client_mode!r}")
    optimizer = LocalOptimizer.parse(optimizer)
    shares = resolve_shares(shares, local_steps, optimizer)
    if shares == "state" and not has_running_stats(model):
        raise ConfigError("shares='state' needs buffers to share, and the model has no BatchNorm running "
                          "statistics: use shares='update' (--shares update)")
    device = next(model.parameters()).device
    images, labels = images.to(device), labels.to(device)
    defense = as_defense(defense)
    generator = torch.Generator(device=device).manual_seed(int(seed))
    server_model = copy.deepcopy(model)
    num_classes = last_linear(server_model)[1].out_features
    _check_batch(images, labels, num_classes)
    client = copy.deepcopy(server_model)
    shared = client_round(client, images, labels, defense, loss_fn, generator, local_steps, local_lr,
                          local_batch_size, client_mode, round=step, optimizer=optimizer)
    mean, std = _normalisation(server_model)
    return Observation(
        model=server_model, gradients=shared, input_shape=tuple(images.shape[1:]), num_classes=num_classes,
        batch_size=images.shape[0], labels=labels.clone() if share_labels else None, loss_fn=loss_fn,
        local_steps=local_steps, local_lr=local_lr if local_steps > 1 else 0.0,
        local_batch_size=local_batch_size, defense=defense, step=step, data_mean=mean, data_std=std,
        extra=dict(extra or {}), client_mode=client_mode, optimizer=optimizer, shares=shares,
        buffers=state_buffers(client) if shares == "state" else None,
    )


def client_round(model, images, labels, defense, loss_fn, generator, steps, lr, local_batch_size, mode,
                 round=None, optimizer: Optional[LocalOptimizer] = None):
    """The client's local training on its own copy; returns the shared update (gradient units).
    ``round`` (the FL round index) goes to a defense that accepts it. In train mode each local
    step advances the copy's BatchNorm buffers by one forward pass on its mini-batch."""

    model.train(mode == "train")
    params = trainable_parameters(model)

    def step_grads(p, xb, yb, k):
        with torch.no_grad():  # the client's model at theta_k
            for q, value in zip(params, p.values()):
                q.copy_(value)
        with preserved_buffers(model):
            if defense is None:
                loss = loss_fn(model(xb), yb)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                grads = [torch.zeros_like(q) if g is None else g for q, g in zip(params, grads)]
            else:
                grads = call_defense(defense, model, xb, yb, loss_fn=loss_fn, generator=generator, round=round)
        if mode == "train":  # the training loop's forward pass: the buffers move once per step
            recorded = getattr(defense, "buffer_inputs", None)
            with torch.no_grad():
                model(recorded(xb) if callable(recorded) else xb)
        return {str(i): g.detach() for i, g in enumerate(grads)}

    theta0 = {str(i): q.detach().clone() for i, q in enumerate(params)}
    return client_update(step_grads, theta0, images, labels, steps=steps, lr=lr, batch_size=local_batch_size,
                         optimizer=optimizer)
