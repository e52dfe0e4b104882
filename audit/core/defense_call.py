"""Calling a defense: run it, check what it returned, name it in errors.

The client simulation and every attack that replays the defense go through
:func:`call_defense`; :func:`as_defense` turns a plain defended-gradient callable into a
:class:`~audit.core.types.Defense` (resolving *names* is the audit engine's job).
"""
from __future__ import annotations

from typing import Any, List

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError, DefenseError, GiaError
from audit.core.types import Defense, FunctionDefense, default_loss_fn, takes_round, trainable_parameters


def as_defense(defense: Any) -> Any:
    """``None``, a :class:`Defense`, or a plain callable (wrapped in :class:`FunctionDefense`)."""
    if defense is None or isinstance(defense, Defense):
        return defense
    if isinstance(defense, str):
        raise ConfigError(f"defense {defense!r} is a name; resolve it first (audit.engine.resolve_defense "
                          "or defenses.build_defense)")
    if not callable(defense):
        raise ConfigError(f"defense is a {type(defense).__name__}, not a callable "
                          "defense(model, inputs, labels, *, loss_fn, generator)")
    return FunctionDefense(defense)


def defense_name(defense: Any) -> str:
    return getattr(defense, "name", None) or getattr(defense, "__name__", type(defense).__name__)


def check_output(defense: Any, grads: Any, model: nn.Module) -> List[Tensor]:
    """Validate a defense's output against the model's trainable parameters; raise
    DefenseError naming the defense and the problem. Returns the gradients as a list."""
    name = defense_name(defense)
    params = trainable_parameters(model)
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise DefenseError(f"defense {name!r} returned a {type(grads).__name__}; it must return a list "
                           f"with one tensor per trainable parameter ({len(params)})")
    grads = list(grads)
    if len(grads) != len(params):
        raise DefenseError(f"defense {name!r} returned {len(grads)} tensors for {len(params)} trainable "
                           "parameters; return one gradient per parameter, in model.parameters() order")
    for i, (g, p) in enumerate(zip(grads, params)):
        if not isinstance(g, Tensor):
            raise DefenseError(f"defense {name!r}: entry {i} is a {type(g).__name__}, not a tensor")
        if g.shape != p.shape:
            raise DefenseError(f"defense {name!r}: gradient {i} has shape {tuple(g.shape)}, the parameter "
                               f"has {tuple(p.shape)}")
        if not bool(torch.isfinite(g).all()):
            bad = int((~torch.isfinite(g)).sum())
            raise DefenseError(f"defense {name!r}: gradient {i} (shape {tuple(g.shape)}) has {bad} NaN/inf "
                               "entries")
    return grads


def accepts_round(defense: Any) -> bool:
    """Whether ``defense`` takes the FL round index: its declared ``accepts_round``, else a
    ``round`` keyword in its signature."""
    declared = getattr(defense, "accepts_round", None)
    return declared if isinstance(declared, bool) else takes_round(defense)


def call_defense(defense: Any, model: nn.Module, inputs: Tensor, labels: Tensor, *,
                 loss_fn=default_loss_fn, generator=None, round=None) -> List[Tensor]:
    """Run a defense and check its output; any failure becomes a DefenseError with its name.

    ``round`` (the FL round index) is passed only to a defense that accepts it."""
    kwargs = {"loss_fn": loss_fn, "generator": generator}
    if round is not None and accepts_round(defense):
        kwargs["round"] = int(round)
    try:
        grads = defense(model, inputs, labels, **kwargs)
    except GiaError:
        raise
    except Exception as err:
        raise DefenseError(f"defense {defense_name(defense)!r} raised {type(err).__name__}: {err}") from err
    return check_output(defense, grads, model)
