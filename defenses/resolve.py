"""Turning what a user gives (a name, an object, a callable, ``"pkg.mod:attr"``) into a
:class:`~audit.types.Defense`, and checking what a defense returns."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from audit.errors import ConfigError, DefenseError, GiaError
from audit.types import Defense, FunctionDefense, default_loss_fn, trainable_parameters

from .registry import DEFENSES, build_defense


def _import_attr(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"defense {spec!r}: write an import path as 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an import can fail with any error inside the user's module
        raise ConfigError(
            f"defense {spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
            "check that it is on PYTHONPATH"
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise ConfigError(
                f"defense {spec!r}: module {module_name!r} has no attribute {attr!r}; "
                f"it defines: {', '.join(public) or '(nothing public)'}"
            )
        obj = getattr(obj, part)
    return obj


def _from_object(obj: Any, params: Dict[str, Any], label: str) -> Defense:
    if isinstance(obj, Defense):
        if params:
            raise ConfigError(f"defense {label}: parameters {sorted(params)} cannot be applied to an "
                              "already-built defense object; build it with them instead")
        return obj
    if inspect.isclass(obj) and issubclass(obj, Defense):
        try:
            return obj(**params)
        except TypeError as err:
            raise ConfigError(f"defense {label}: {err}") from None
    if callable(obj):
        if params:
            raise ConfigError(f"defense {label}: a plain function takes no --defense-arg parameters "
                              f"(got {sorted(params)})")
        return FunctionDefense(obj)
    raise ConfigError(f"defense {label} is a {type(obj).__name__}, not a callable "
                      "defense(model, inputs, labels, *, loss_fn, generator)")


def resolve_defense(spec: Any = None, params: Optional[Dict[str, Any]] = None) -> Defense:
    """A registered name, a :class:`Defense`, any defended-gradient callable, or a
    ``"package.module:attr"`` string, as a :class:`Defense` (``None`` means ``"none"``)."""
    params = dict(params or {})
    if spec is None:
        spec = "none"
    if isinstance(spec, str):
        if ":" in spec:
            return _from_object(_import_attr(spec), params, repr(spec))
        if spec not in DEFENSES:
            DEFENSES.get(spec)  # raises, listing the valid names
        return build_defense(spec, **params)
    return _from_object(spec, params, getattr(spec, "__name__", type(spec).__name__))


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


def call_defense(defense: Any, model: nn.Module, inputs: Tensor, labels: Tensor, *,
                 loss_fn=default_loss_fn, generator=None) -> List[Tensor]:
    """Run a defense and check its output; any failure becomes a DefenseError with its name."""
    try:
        grads = defense(model, inputs, labels, loss_fn=loss_fn, generator=generator)
    except GiaError:
        raise
    except Exception as err:
        raise DefenseError(f"defense {defense_name(defense)!r} raised {type(err).__name__}: {err}") from err
    return check_output(defense, grads, model)
