"""The audited model from what a user gives: a registered name, ``"package.module:attr"``
(a factory, or a module object), a factory callable, or a built ``nn.Module``; the inputs it
expects; the checkpoint its weights start from.

**Normalisation, one rule for every model.** The audit hands every model images in [0, 1]
and scores reconstructions there. A model that expects normalised inputs gets
:class:`~audit.core.models.Normalize` ``(x - mean) / std`` as its first layer, so a model
trained on normalised inputs is audited on normalised inputs; the attacker optimises the
pixels in [0, 1] through that fixed per-channel affine layer, which is optimising what the
model sees (within the image range), and the scores stay in pixel space. ``normalize``:

* ``"data"``: the data set's per-channel mean / std (of its train split);
* ``"none"``: the model takes pixels in [0, 1] as they are;
* ``(mean, std)`` (``"m1,m2,m3/s1,s2,s3"`` on the command line): the statistics the model
  was trained with, e.g. a checkpoint's.

Default (None): ``"data"`` for a model the audit builds (a registered name, whose first layer
is this Normalize, or a factory), ``"none"`` for a built ``nn.Module`` (taken as given: it may
normalise itself, as :func:`~audit.core.models.build_model`'s models do).
"""
from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.models import build_model, with_normalization
from audit.core.registry import Registry, import_attr

Stats = Tuple[Tuple[float, ...], Tuple[float, ...]]
Normalization = Union[str, Stats]
CHECKPOINT_KEYS = ("state_dict", "model")  # where a checkpoint dict may hold the state_dict
SHOWN_MISMATCHES = 3


def model_label(spec: Any) -> str:
    """How messages and reports name a model spec."""
    if isinstance(spec, str):
        return repr(spec)
    target = spec if inspect.isclass(spec) or inspect.isfunction(spec) else type(spec)
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(spec).__name__)}"


# --------------------------------------------------------------------------- normalisation
def parse_normalize(value: Any) -> Optional[Normalization]:
    """``None``, ``"data"``, ``"none"``, ``"m1,m2,m3/s1,s2,s3"`` or ``(mean, std)``, checked."""
    if value is None or value in ("data", "none"):
        return value
    fix = ("model normalisation must be 'data' (the data set's statistics), 'none' (pixels in [0, 1]) or "
           "the model's mean/std per channel, e.g. 0.4914,0.4822,0.4465/0.2470,0.2435,0.2616")
    if isinstance(value, str):
        mean, slash, std = value.replace(" ", "").partition("/")
        if not slash:
            raise ConfigError(f"{fix}; got {value!r}")
        value = (mean.split(","), std.split(","))
    try:
        mean, std = value
        mean, std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
    except (TypeError, ValueError):
        raise ConfigError(f"{fix}; got {value!r}") from None
    if not mean or len(mean) != len(std) or min(std) <= 0:
        raise ConfigError(f"{fix} (as many means as stds, stds > 0); got {value!r}")
    return mean, std


def _stats(normalize: Optional[Normalization], default: str, mean, std) -> Optional[Stats]:
    """The (mean, std) the model's first layer applies, or None for none."""
    normalize = default if normalize is None else normalize
    if normalize == "none":
        return None
    if normalize == "data":
        return tuple(mean), tuple(std)
    return normalize


# --------------------------------------------------------------------------- checkpoints
def load_state(path: Union[str, Path]) -> Dict[str, Tensor]:
    """A checkpoint file's state_dict: the file itself, or the dict it holds under
    ``state_dict`` or ``model``. Loaded with ``weights_only`` (no code from the file runs)."""
    path = Path(path).expanduser()
    saved = "torch.save(model.state_dict(), PATH)"
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist; give the file written by {saved}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many kinds for a file it cannot read
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise ConfigError(f"checkpoint {path} is not readable as a torch state_dict ({type(err).__name__}: "
                          f"{first}); give the file written by {saved}") from None
    for key in CHECKPOINT_KEYS:
        if isinstance(payload, Mapping) and isinstance(payload.get(key), Mapping):
            payload = payload[key]
            break
    if not isinstance(payload, Mapping) or not payload or not all(
            isinstance(k, str) and isinstance(v, Tensor) for k, v in payload.items()):
        raise ConfigError(f"checkpoint {path} holds no state_dict (a dict of tensors, or a dict with one under "
                          f"{' or '.join(map(repr, CHECKPOINT_KEYS))}); give the file written by {saved}")
    return dict(payload)


def _unprefixed(state: Dict[str, Tensor], expected: Sequence[str]) -> Dict[str, Tensor]:
    """Drop the ``module.`` prefix that (Distributed)DataParallel adds to every key."""
    prefix = "module."
    if all(k.startswith(prefix) for k in state) and not all(k.startswith(prefix) for k in expected):
        return {k[len(prefix):]: v for k, v in state.items()}
    return state


def state_mismatches(model: nn.Module, state: Mapping[str, Tensor]) -> List[str]:
    """What keeps ``state`` from loading into ``model``: keys missing, keys unexpected and
    shapes that differ (the first few of each)."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(state[k].shape)} vs the model's {tuple(v.shape)}"
              for k, v in own.items() if k in state and tuple(state[k].shape) != tuple(v.shape)]
    out = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("shape", shapes)):
        if items:
            more = f" (+{len(items) - SHOWN_MISMATCHES} more)" if len(items) > SHOWN_MISMATCHES else ""
            out.append(f"{len(items)} {what}: {', '.join(items[:SHOWN_MISMATCHES])}{more}")
    return out


def apply_checkpoint(model: nn.Module, path: Union[str, Path], label: str) -> nn.Module:
    """Load the checkpoint at ``path`` into ``model`` (strict); a mismatch names the first
    few missing / unexpected keys and differing shapes."""
    state = _unprefixed(load_state(path), list(model.state_dict()))
    problems = state_mismatches(model, state)
    if problems:
        raise ConfigError(f"checkpoint {path} does not fit model {label}: {'; '.join(problems)}; give the "
                          "checkpoint of this architecture (same --model, --model-arg and class count)")
    model.load_state_dict(state)
    return model


# --------------------------------------------------------------------------- building
def _call_factory(factory: Callable, args: Dict[str, Any], input_shape, num_classes: int, label: str) -> nn.Module:
    """``factory(num_classes=, input_shape=, **args)``: ``num_classes`` when its signature
    names it or takes ``**kwargs``, ``input_shape`` only when it names it."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: Dict[str, Any] = {}
    if "num_classes" in params or var_kw:
        kwargs["num_classes"] = int(num_classes)
    if "input_shape" in params:
        kwargs["input_shape"] = tuple(input_shape)
    kwargs.update(args)
    called = ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "no arguments"
    try:
        model = factory(**kwargs)
    except Exception as err:
        raise ConfigError(f"model {label} raised {type(err).__name__}: {str(err).strip()[:200]} (called with "
                          f"{called}); check --model-arg") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {label} returned {type(model).__name__}, not an nn.Module (called with "
                          f"{called}); give a factory that returns the network")
    return model


MODEL_SOURCES = Registry("model source")


@MODEL_SOURCES.register("module", "a built nn.Module, copied as given")
def _from_module(spec: nn.Module, args, input_shape, num_classes, label) -> nn.Module:
    if args:
        raise ConfigError(f"model arguments {sorted(args)} apply to a model name or factory, not to the built "
                          f"model {label}; build it with them instead")
    return copy.deepcopy(spec)


@MODEL_SOURCES.register("factory", "a callable returning an nn.Module (a class or function)")
def _from_factory(spec: Callable, args, input_shape, num_classes, label) -> nn.Module:
    return _call_factory(spec, args, input_shape, num_classes, label)


@MODEL_SOURCES.register("path", "'package.module:attr': a factory or an nn.Module")
def _from_path(spec: str, args, input_shape, num_classes, label) -> nn.Module:
    obj = import_attr(spec, "model")
    if not isinstance(obj, nn.Module) and not callable(obj):
        raise ConfigError(f"model {label} is a {type(obj).__name__}, neither an nn.Module nor a factory "
                          "returning one")
    return MODEL_SOURCES.get(source_kind(obj))(obj, args, input_shape, num_classes, label)


def source_kind(spec: Any) -> str:
    """Which :data:`MODEL_SOURCES` entry builds ``spec`` ("name" for a registered name)."""
    if isinstance(spec, nn.Module):
        return "module"
    if isinstance(spec, str):
        return "path" if ":" in spec else "name"
    if callable(spec):
        return "factory"
    raise ConfigError(f"model must be a registered name (see `gia-audit list models`), 'package.module:attr', "
                      f"a factory or an nn.Module, got {type(spec).__name__}")


def build_audited_model(spec: Any, args: Optional[Mapping[str, Any]], input_shape: Tuple[int, int, int],
                        num_classes: int, *, mean: Sequence[float], std: Sequence[float],
                        normalize: Optional[Normalization] = None, checkpoint: Optional[Union[str, Path]] = None,
                        seed: Optional[int] = 0) -> nn.Module:
    """The model an audit runs, taking images in [0, 1]: built from ``spec`` (see the module
    docstring) under ``seed``, its weights from ``checkpoint`` when given, then normalised as
    ``normalize`` says (``mean`` / ``std``: the data set's statistics)."""
    args, label = dict(args or {}), model_label(spec)
    kind = source_kind(spec)
    normalize = parse_normalize(normalize)
    if kind == "name":
        stats = _stats(normalize, "data", mean, std)
        model = build_model(spec, input_shape, num_classes, mean=stats and stats[0], std=stats and stats[1],
                            seed=seed, **args)
        return model if checkpoint is None else apply_checkpoint(model, checkpoint, label)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = MODEL_SOURCES.get(kind)(spec, args, input_shape, num_classes, label)
    if checkpoint is not None:
        apply_checkpoint(model, checkpoint, label)
    stats = _stats(normalize, "none" if kind == "module" else "data", mean, std)
    if stats is None:
        return model
    if len(stats[0]) != input_shape[0]:
        raise ConfigError(f"model normalisation gives {len(stats[0])} means for {input_shape[0]}-channel images; "
                          "give one mean and one std per channel")
    return with_normalization(model, *stats)
