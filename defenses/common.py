"""Helpers shared by the defenses: generator-aware sampling, parameter checks, flattening,
side-effect-free forward passes and per-example gradients."""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, List, Optional, Sequence

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.randomness import is_vmap_draws
from audit.core.models import preserved_buffers  # noqa: F401 (used by the defenses)
from audit.core.types import LossFn, clean_gradients, default_loss_fn


# --------------------------------------------------------------------------- randomness
def resolve_generator(generator: Optional[torch.Generator], device) -> torch.Generator:
    """``generator`` itself (or :data:`~audit.core.randomness.VMAP_DRAWS`), or a fresh
    default-seeded generator on ``device`` when None."""
    if generator is not None:
        return generator
    return torch.Generator(device=torch.device(device))


def randn(shape, *, generator: Optional[torch.Generator], device, dtype=torch.float32) -> Tensor:
    """Standard normal samples drawn from ``generator`` (any device) and moved to ``device``;
    with :data:`~audit.core.randomness.VMAP_DRAWS`, from the global generator on ``device``
    (independent per member under ``vmap(randomness="different")``)."""
    gen = resolve_generator(generator, device)
    if is_vmap_draws(gen):
        return torch.randn(tuple(shape), device=device, dtype=dtype)
    return torch.randn(tuple(shape), generator=gen, device=gen.device, dtype=dtype).to(device)


def rand(shape, *, generator: Optional[torch.Generator], device, dtype=torch.float32) -> Tensor:
    """Uniform [0, 1) samples drawn from ``generator`` (any device) and moved to ``device``
    (``VMAP_DRAWS``: as in :func:`randn`)."""
    gen = resolve_generator(generator, device)
    if is_vmap_draws(gen):
        return torch.rand(tuple(shape), device=device, dtype=dtype)
    return torch.rand(tuple(shape), generator=gen, device=gen.device, dtype=dtype).to(device)


# --------------------------------------------------------------------------- parameter checks
def check_range(defense: str, name: str, value, low=None, high=None, *, low_open=False,
                high_open=False, integer=False):
    """Return ``value`` (as float / int) or raise ConfigError naming the valid range."""
    lo_br, hi_br = ("(" if low_open else "["), (")" if high_open else "]")
    valid = f"{lo_br}{'-inf' if low is None else low}, {'inf' if high is None else high}{hi_br}"
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        integer and not float(value).is_integer()
    ):
        raise ConfigError(f"{defense}: {name} must be {kind} in {valid}, got {value!r}")
    v = float(value)
    bad = (
        math.isnan(v)
        or (low is not None and (v < low or (low_open and v == low)))
        or (high is not None and (v > high or (high_open and v == high)))
    )
    if bad:
        raise ConfigError(f"{defense}: {name} must be in {valid}, got {value!r}")
    return int(v) if integer else v


def check_choice(defense: str, name: str, value, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigError(
            f"{defense}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return value


# --------------------------------------------------------------------------- flattening
def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate tensors into one vector (a view, not a copy, of a single contiguous tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(vector: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
    """Split a vector back into tensors shaped like ``like``."""
    out, start = [], 0
    for t in like:
        out.append(vector[start:start + t.numel()].view_as(t))
        start += t.numel()
    return out


def squared_norms(stack: Tensor, chunk: int = 4096) -> Tensor:
    """Per row of ``stack`` ``(B, ...)``, the sum of squares in float64: float32 norms of
    ``chunk``-entry pieces combined in float64 (float64 accuracy without a float64 copy)."""
    flat = stack.flatten(1)
    whole = flat.shape[1] // chunk * chunk
    total = flat.new_zeros(flat.shape[0], dtype=torch.float64)
    if whole:
        total = total + flat[:, :whole].reshape(flat.shape[0], -1, chunk).norm(dim=2).double().pow(2).sum(1)
    if whole < flat.shape[1]:
        total = total + flat[:, whole:].norm(dim=1).double().pow(2)
    return total


def global_norm(tensors: Sequence[Tensor]) -> Tensor:
    """The L2 norm of all tensors together, accumulated in float64 (see :func:`squared_norms`)."""
    return torch.sqrt(sum(squared_norms(t.reshape(1, -1))[0] for t in tensors)).to(tensors[0].dtype)


# --------------------------------------------------------------------------- model state
@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily switch ``model`` to eval mode (restores each module's flag)."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, flag in flags:
            m.train(flag)


@contextlib.contextmanager
def untracked_batchnorm(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, BatchNorm layers in train mode normalise with the batch statistics
    as before but leave their running statistics alone (``track_running_stats`` off), so a
    forward pass mutates no buffer and runs under ``torch.func`` transforms."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and m.training and m.track_running_stats]
    for m in norms:
        m.track_running_stats = False
    try:
        yield model
    finally:
        for m in norms:
            m.track_running_stats = True


# --------------------------------------------------------------------------- gradients
def per_example_gradients(
    model: nn.Module, inputs: Tensor, labels: Tensor, loss_fn: LossFn = default_loss_fn
) -> List[List[Tensor]]:
    """One clean gradient per example (``[example][parameter]``), without touching buffers.

    Stays differentiable w.r.t. ``inputs`` when ``inputs.requires_grad``. (One backward pass
    per example: on CPU this is as fast as ``vmap`` for small models and faster for ResNets.)
    """
    with preserved_buffers(model):
        return [
            clean_gradients(model, inputs[i:i + 1], labels[i:i + 1], loss_fn)
            for i in range(inputs.shape[0])
        ]


def per_example_stack(model: nn.Module, inputs: Tensor, labels: Tensor, loss_fn: LossFn = default_loss_fn
                      ) -> List[Tensor]:
    """:func:`per_example_gradients` stacked: per parameter ``(B, *shape)``."""
    return [torch.stack(column) for column in zip(*per_example_gradients(model, inputs, labels, loss_fn))]


def stack_draws(per_batch: Sequence[Sequence[Tensor]]) -> List[Tensor]:
    """``[batch][parameter]`` tensors ``(draws, *shape)`` -> per parameter ``(N, draws, *shape)``."""
    return [torch.stack(column) for column in zip(*per_batch)]
