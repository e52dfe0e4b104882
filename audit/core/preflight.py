"""Checks a model before any work: one forward / backward pass for each way an audit runs it
(batch size and BatchNorm mode), on the data's input shape. A model that cannot serve the
audit fails here, in one line that names the fix, instead of as a defense or attack error in
every result later."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from audit.core.errors import ConfigError
from audit.core.models import last_linear, preserved_buffers
from audit.core.types import default_loss_fn, trainable_parameters


@dataclass(frozen=True)
class ModelUse:
    """One way the audit runs the model: ``batch`` images in ``mode`` ("train" / "eval"),
    for ``purpose``; ``batch_option`` / ``mode_option`` name the settings that change them
    (``mode_option`` None: the mode is fixed, as FL training's)."""

    batch: int
    mode: str
    purpose: str
    batch_option: str
    mode_option: Optional[str] = None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _forward_backward(model: nn.Module, input_shape, num_classes: int, batch: int, mode: str, device):
    """The model's output on a seeded batch in ``mode``, after a backward pass to its
    parameters; buffers (BatchNorm statistics) and the mode are left as they were."""
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(batch, *input_shape, generator=gen).to(device)
    y = (torch.arange(batch) % num_classes).to(device)
    was_training = model.training
    try:
        with preserved_buffers(model):
            model.train(mode == "train")
            out = model(x)
            if isinstance(out, torch.Tensor) and tuple(out.shape) == (batch, num_classes):
                torch.autograd.grad(default_loss_fn(out, y), trainable_parameters(model), allow_unused=True)
            return out
    finally:
        model.train(was_training)


def runs(model: nn.Module, input_shape, num_classes: int, batch: int, mode: str, device=None) -> bool:
    """Whether ``model`` runs a forward / backward of ``batch`` images in ``mode``."""
    if device is None:
        device = next(model.parameters()).device
    try:
        _forward_backward(model, input_shape, num_classes, batch, mode, device)
        return True
    except Exception:
        return False


def _cannot_run(model, label, use: ModelUse, input_shape, num_classes, device, err) -> ConfigError:
    c, h, w = input_shape
    head = (f"model {label} cannot run a batch of {use.batch} {c}x{h}x{w} image(s) in {use.mode} mode "
            f"({use.purpose}): {_first_line(err)}")
    if use.mode == "train" and runs(model, input_shape, num_classes, use.batch, "eval", device):
        remedies = [f"a larger batch ({use.batch_option})"]
        if use.mode_option:
            remedies.append(use.mode_option)
        remedies.append(f"a model built for {h}x{w} inputs whose feature maps stay larger than 1x1 "
                        "(a CIFAR-style network, e.g. --model resnet18)")
        return ConfigError(f"{head}; train-mode BatchNorm needs more than one value per channel: use "
                           f"{', or '.join(remedies)}")
    return ConfigError(f"{head}; give a model that takes (batch, {c}, {h}, {w}) images (a factory receives "
                       "input_shape= when its signature names it), or change --image-size")


def check_model(model: nn.Module, input_shape: Tuple[int, int, int], num_classes: int, uses: Sequence[ModelUse],
                label: str, device=None) -> None:
    """Raise a one-line :class:`ConfigError` naming the fix when ``model`` has no trainable
    parameter, no classifier head of ``num_classes`` outputs (attacks read the last
    ``nn.Linear``), or cannot map each use's batch to ``(batch, num_classes)`` logits with a
    backward pass; nothing of the model changes."""
    if not trainable_parameters(model):
        raise ConfigError(f"model {label} has no trainable parameters (requires_grad is False everywhere); the "
                          "clients share gradients of trainable parameters: unfreeze the layers they train")
    if device is None:
        device = trainable_parameters(model)[0].device
    seen = set()
    for use in uses:
        if (use.batch, use.mode) in seen:
            continue
        seen.add((use.batch, use.mode))
        try:
            out = _forward_backward(model, input_shape, num_classes, use.batch, use.mode, device)
        except Exception as err:  # any failure of the user's model
            raise _cannot_run(model, label, use, input_shape, num_classes, device, err) from None
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"model {label} returns a {type(out).__name__} in {use.mode} mode, not a tensor of "
                              f"logits; make it return the (batch, classes) logits only")
        if tuple(out.shape) != (use.batch, num_classes):
            raise ConfigError(f"model {label} maps a batch of {use.batch} images to shape {tuple(out.shape)}; expected "
                              f"({use.batch}, {num_classes}) logits for the data set's {num_classes} classes: build it "
                              "with num_classes= (a factory gets it when its signature takes it or **kwargs)")
    try:
        name, head = last_linear(model)
    except ConfigError:
        raise ConfigError(f"model {label} has no nn.Linear layer; attacks read the class count and infer labels "
                          "from the last nn.Linear (the classifier head): end the model with one") from None
    if head.out_features != num_classes:
        raise ConfigError(f"model {label}: its last nn.Linear ({name}) has {head.out_features} outputs, the data "
                          f"set {num_classes} classes; attacks read the classes from that layer: make it the "
                          "classifier head")
