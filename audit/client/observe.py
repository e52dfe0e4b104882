"""Make an :class:`~audit.core.types.Observation` from a model and a private batch.

This is the client side of one federated round: the (defended) gradient, or for FedAvg the
update of ``local_steps`` local steps of the client's optimiser (SGD with momentum / weight
decay, Adam, AdamW), with its BatchNorm buffers when the client shares its state, computed
with a seeded ``torch.Generator``. Tests, the CLI and the audit engine use it; attacks only ever see
the returned observation.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from audit.core.buffers import buffer_effect, has_running_stats, state_buffers
from audit.core.client_training import ClientTraining
from audit.core.defense_call import as_defense, call_defense
from audit.core.errors import ConfigError, DataError
from audit.core.models import Normalize, last_linear, preserved_buffers
from audit.core.types import LossFn, Observation, default_loss_fn, trainable_parameters
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
    training: Optional[ClientTraining] = None,
) -> Observation:
    """Run one client round (:func:`client_round`) on ``(images, labels)`` and return what
    the server observes.

    The model is copied (neither it nor its BatchNorm buffers change). ``defense`` is None,
    a :class:`~audit.core.types.Defense` or a defended-gradient callable (a name is resolved
    first: :func:`defenses.resolve_defense`); every local step shares ``defense(model_k,
    batch_k, labels_k, loss_fn=, generator=)`` (plus ``round=step`` for a defense that accepts
    the FL round index). Architectural defenses: pass the client's model, i.e. the one
    ``defense.wrap_model`` returned. ``training``: the client's training record
    (:class:`~audit.core.client_training.ClientTraining`); without it, built from ``local_*``,
    ``optimizer``, ``shares`` and ``client_mode`` (one SGD step of ``local_steps`` = 1 shares the
    gradient). ``shares="state"`` adds the buffers as the defense's declared effect leaves them.
    """
    if training is None:
        training = ClientTraining(optimizer or "sgd", local_steps, None, local_lr, local_batch_size, shares, client_mode)
    if training.shares == "state" and not has_running_stats(model):
        raise ConfigError("shares='state' needs buffers to share, and the model has no BatchNorm running "
                          "statistics: use shares='update' (--shares update)")
    device = next(model.parameters()).device
    images, labels = images.to(device), labels.to(device)
    defense = as_defense(defense)
    generator = torch.Generator(device=device).manual_seed(int(seed))
    server_model = copy.deepcopy(model)
    num_classes = last_linear(server_model)[1].out_features
    _check_batch(images, labels, num_classes)
    done = client_round(copy.deepcopy(server_model), images, labels, defense, training, generator=generator,
                        loss_fn=loss_fn, round=step)
    mean, std = _normalisation(server_model)
    return Observation(
        model=server_model, gradients=done.update, input_shape=tuple(images.shape[1:]), num_classes=num_classes,
        batch_size=images.shape[0], labels=labels.clone() if share_labels else None, loss_fn=loss_fn,
        training=training, defense=defense, step=step, data_mean=mean, data_std=std, extra=dict(extra or {}),
        buffers=done.buffers if training.shares == "state" else None, buffer_effect=done.effect,
    )


@dataclass
class ClientRound:
    """What one client round ends with: the ``update`` in gradient units (one tensor per
    trainable parameter), the ``buffers`` it would upload with its state (the defense's
    declared effect applied) and that effect's name."""

    update: List[Tensor]
    buffers: Dict[str, Tensor]
    effect: str


def client_round(model: nn.Module, images: Tensor, labels: Tensor, defense, training: ClientTraining, *,
                 generator: Optional[torch.Generator], loss_fn: LossFn = default_loss_fn,
                 round: Optional[int] = None) -> ClientRound:
    """The client's local training on ``model`` (its own copy, moved in place): the one round
    the observation, the FL trainer between audited steps and the Flower fidelity replay run.
    Each local step shares the defended gradient (``round`` goes to a defense that accepts it);
    in train mode the step's forward pass moves the buffers on the inputs the defense's
    :func:`~audit.core.buffers.buffer_effect` records; the upload's buffers follow that effect."""
    model.train(training.mode == "train")
    params = trainable_parameters(model)
    effect = buffer_effect(defense)
    before = state_buffers(model)
    whole = effect.on_state and training.shares == "state"  # the defense acts on the reply, not on each step
    if whole and not callable(getattr(defense, "transform_state", None)):
        raise ConfigError(f"defense {getattr(defense, 'name', defense)!r} declares buffer_effect {effect.name!r} but "
                          "has no transform_state(update, buffers, before, lr=, generator=): add it, or declare "
                          "another effect")
    per_step = None if whole else defense

    def step_grads(p, xb, yb, k):
        with torch.no_grad():  # the client's model at theta_k
            for q, value in zip(params, p.values()):
                q.copy_(value)
        start = None if generator is None else generator.get_state()
        with preserved_buffers(model):
            if per_step is None:
                loss = loss_fn(model(xb), yb)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                grads = [torch.zeros_like(q) if g is None else g for q, g in zip(params, grads)]
            else:
                grads = call_defense(per_step, model, xb, yb, loss_fn=loss_fn, generator=generator, round=round)
        if training.mode == "train":  # the training loop's forward pass: the buffers move once per step
            with torch.no_grad():
                model(effect.records(defense, xb, _restarted(generator, start)))
        return {str(i): g.detach() for i, g in enumerate(grads)}

    theta0 = {str(i): q.detach().clone() for i, q in enumerate(params)}
    update = client_update(step_grads, theta0, images, labels, steps=training.steps_for(images.shape[0]),
                           lr=training.lr, batch_size=training.batch_size, optimizer=training.optimizer)
    with torch.no_grad():  # the model ends at theta_K, as the client's training leaves it
        for q, t0, u in zip(params, theta0.values(), update):
            q.copy_(t0 - training.lr * u)
    trained = state_buffers(model)
    if whole:  # the reply as the defense sends it: the update and the buffers transformed together
        update, trained = defense.transform_state(update, trained, before, lr=training.lr, generator=generator)
    return ClientRound(update, effect.uploads(defense, trained, before, generator), effect.name)


def _restarted(generator: Optional[torch.Generator], state) -> Optional[torch.Generator]:
    """A generator at ``state`` (the defense call's start), so a transform is drawn again alike."""
    if generator is None:
        return None
    again = torch.Generator(device=generator.device)
    again.set_state(state)
    return again

