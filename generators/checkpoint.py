"""Generator checkpoints: the weights plus the settings needed to rebuild and trust them
(architecture, latent dim, image shape, classes, the data it was trained on, training run).

A user's generator is loaded from a ``module:attr`` factory (a callable returning an
``nn.Module`` with the generator interface, see :mod:`generators.base`) and a checkpoint
path holding either a raw ``state_dict`` or a dict with a ``state_dict`` entry.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from audit.core.errors import ConfigError, DataError
from audit.core.files import atomic_torch_save

from generators.base import ImageGenerator, as_generator
from generators.dcgan import GENERATORS, build_generator

FORMAT = "gia-audit-generator/1"
PathLike = Union[str, os.PathLike]


def save_generator(path: PathLike, generator: ImageGenerator, *, architecture: str = "dcgan",
                   data: Optional[Dict[str, Any]] = None, training: Optional[Dict[str, Any]] = None) -> Path:
    """Write ``generator`` with its settings, the description of its training ``data`` and
    ``training`` run; returns the path. The write is atomic (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "architecture": architecture,
        "settings": generator.settings(),
        "data": dict(data or {}),
        "training": dict(training or {}),
        "state_dict": {k: v.detach().cpu() for k, v in generator.state_dict().items()},
    }
    return atomic_torch_save(payload, path)


def read_checkpoint(path: PathLike) -> Dict[str, Any]:
    """The raw checkpoint dict (weights on the CPU); a clear DataError when unreadable."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"generator checkpoint {str(path)!r} does not exist; train one with "
                        "`gia-audit train-generator --save PATH` or give the right path")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise DataError(f"cannot read generator checkpoint {str(path)!r} ({type(err).__name__}: {err}); "
                        "it must be a file written by torch.save") from None
    if not isinstance(payload, dict):
        raise DataError(f"generator checkpoint {str(path)!r} holds a {type(payload).__name__}, not a dict "
                        "(a state_dict or a gia-audit checkpoint)")
    return payload


def load_generator(path: Optional[PathLike] = None, *, factory: Optional[str] = None,
                   device: Union[str, torch.device] = "cpu") -> ImageGenerator:
    """Load a generator in eval mode on ``device``.

    * ``load_generator("gen.pt")`` -- a checkpoint written by :func:`save_generator`;
    * ``load_generator("weights.pt", factory="my_pkg.gan:make")`` -- a user's module built by
      the factory (no arguments), then its weights loaded from the checkpoint;
    * ``load_generator(factory="my_pkg.gan:make")`` -- the factory's module as built.
    """
    if path is None and factory is None:
        raise ConfigError("give a generator checkpoint path, a module:attr factory, or both")
    payload = read_checkpoint(path) if path is not None else None
    if factory is not None:
        module = resolve_factory(factory)()
        if not isinstance(module, nn.Module):
            raise ConfigError(f"generator factory {factory!r} returned a {type(module).__name__}, "
                              "not a torch nn.Module")
        if payload is not None:
            _load_state(module, payload.get("state_dict", payload), path)
        gen = as_generator(module.to(device).eval())
    else:
        gen = _rebuild(payload, path)
        gen = gen.to(device)
    gen.eval()
    gen.checkpoint_info = {k: payload[k] for k in ("architecture", "settings", "data", "training")
                           if payload is not None and k in payload}
    if path is not None:
        gen.checkpoint_info["path"] = str(path)
    if factory is not None:
        gen.checkpoint_info["factory"] = factory
    return gen


def resolve_factory(spec: str):
    """Import ``package.module:attr`` (attr may be dotted) and return the object."""
    if ":" not in spec:
        raise ConfigError(f"generator factory {spec!r} must be of the form package.module:attr")
    module_name, attr = spec.split(":", 1)
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"cannot import {module_name!r} for generator factory {spec!r} ({err}); "
                          "check the module is on PYTHONPATH") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (generator factory {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"generator factory {spec!r} is not callable")
    return obj


def _rebuild(payload: Dict[str, Any], path: PathLike) -> ImageGenerator:
    if payload.get("format") != FORMAT:
        raise DataError(
            f"{str(path)!r} is not a gia-audit generator checkpoint (no format {FORMAT!r}); for your own "
            "generator pass its factory too (--generator-factory package.module:attr)")
    architecture = payload.get("architecture", "dcgan")
    if architecture not in GENERATORS:
        raise DataError(f"checkpoint {str(path)!r} has architecture {architecture!r}; known: "
                        f"{', '.join(GENERATORS.names())}")
    settings = dict(payload["settings"])
    settings["image_shape"] = tuple(settings["image_shape"])
    generator, _ = build_generator(architecture, seed=None, **settings)
    _load_state(generator, payload["state_dict"], path)
    return generator


def _load_state(module: nn.Module, state: Dict[str, Any], path: PathLike) -> None:
    try:
        module.load_state_dict(state)
    except (RuntimeError, KeyError, TypeError) as err:
        first = str(err).strip().splitlines()[0]
        raise DataError(f"the weights in {str(path)!r} do not fit {type(module).__name__}: {first}") from None
