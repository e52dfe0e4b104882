"""Turning what a user gives into the objects an audit runs, each built once: the device, the
data set, the resolved defense, the seeded model and the client's model (the defense's
``wrap_model`` applied once). :class:`AuditParts` carries them to the planner, the client
simulation, the utility run and every sweep job; nothing downstream rebuilds them."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from audit.core.defense_call import wrap_client_model
from audit.engine.identity import defense_identity
from audit.core.errors import ConfigError
from audit.core.types import parameter_names


def resolve_device(device) -> torch.device:
    """A torch device from ``cpu``, ``cuda``, ``cuda:1``, ``mps`` or a ``torch.device``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device {device!r} is not a torch device ({err}); use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was given but no CUDA device is available; use --device cpu "
                          "(device='cpu')")
    return dev


def load_data(data, image_size: int, data_args: Dict[str, Any]):
    from audit.core.data import Dataset, load_dataset

    if isinstance(data, Dataset):
        return data
    if not isinstance(data, str):
        raise ConfigError(f"data must be a data set name (see `gia-audit list datasets`) or an "
                          f"audit.core.data.Dataset, got {type(data).__name__}")
    return load_dataset(data, size=image_size, **data_args)


def resolve_defense(spec: Any, args: Dict[str, Any] = None):
    """A registered name (``args`` are its parameters), a Defense, any defended-gradient
    callable, or ``"package.module:attr"``, as a :class:`~audit.core.types.Defense`."""
    from defenses import resolve_defense as resolve

    return resolve(spec, args or {})


def build_model(settings, dataset, seed: int) -> nn.Module:
    """The audited model of :class:`~audit.engine.settings.ModelSettings` for ``dataset``:
    built under ``seed``, its checkpoint loaded, taking images in [0, 1]."""
    from audit.core.model_source import build_audited_model

    return build_audited_model(settings.model, settings.args, dataset.input_shape, dataset.num_classes,
                               mean=dataset.mean, std=dataset.std, normalize=settings.normalize,
                               checkpoint=settings.checkpoint, seed=seed)


def check_model(model: nn.Module, settings, dataset, client_batch: int, client_mode: str,
                train_batch: Optional[int], device, batch_option: str = "--batch-size / batch_size") -> None:
    """One forward / backward of ``model`` for the audited client's update (``client_batch``
    images in ``client_mode``) and, when the model is trained (``train_batch`` not None), for
    FL training; a one-line ConfigError naming the fix before any work (see
    :func:`audit.core.preflight.check_model`)."""
    from audit.core.model_source import model_label
    from audit.core.preflight import ModelUse, check_model as check

    uses = [ModelUse(client_batch, client_mode, "the audited client's update", batch_option,
                     "--client-mode eval / client_mode='eval'" if client_mode == "train" else None)]
    if train_batch is not None:
        uses.append(ModelUse(train_batch, "train", "FL training", "--train-batch-size / train_batch_size"))
    check(model, dataset.input_shape, dataset.num_classes, uses, model_label(settings.model), device)


def client_model(defense, model: nn.Module, seed: int) -> nn.Module:
    """The client's model: ``defense.wrap_model(model)`` under ``seed``
    (:func:`audit.core.defense_call.wrap_client_model`)."""
    return wrap_client_model(defense, model, seed)


@dataclass(frozen=True)
class SharedParts:
    """What every audit of one set of settings shares (every cell of a sweep): the device,
    the data set and the seeded model as built, before any defense changes it."""

    device: torch.device
    dataset: Any
    base_model: nn.Module


@dataclass(frozen=True)
class AuditParts:
    """One audit's objects: the shared parts, the resolved defense, its identity and the
    client's model (``base_model`` wrapped once by the defense)."""

    shared: SharedParts
    defense: Any
    defense_ident: Dict[str, Any]
    model: nn.Module

    @property
    def device(self) -> torch.device:
        return self.shared.device

    @property
    def dataset(self) -> Any:
        return self.shared.dataset

    @property
    def base_model(self) -> nn.Module:
        return self.shared.base_model


def build_shared(model_settings, data_settings, seed: int, device) -> SharedParts:
    """The device, the data set (``data_settings``: :class:`~audit.engine.settings.DataSettings`)
    and the seeded model (``model_settings``: :class:`~audit.engine.settings.ModelSettings`),
    each built once."""
    dev = resolve_device(device)
    dataset = load_data(data_settings.data, data_settings.image_size, data_settings.data_args)
    return SharedParts(dev, dataset, build_model(model_settings, dataset, seed).to(dev))


def build_parts(shared: SharedParts, defense: Any, defense_spec: Any, seed: int,
                defense_ident: Optional[Dict[str, Any]] = None) -> AuditParts:
    """An audit's parts from the shared ones and a resolved ``defense`` (``defense_spec``: as
    the user gave it, for its identity; ``defense_ident`` when it is known already)."""
    ident = defense_ident if defense_ident is not None else defense_identity(defense, defense_spec)
    return AuditParts(shared, defense, ident, client_model(defense, copy.deepcopy(shared.base_model), seed))


def own_parts(defense_spec: Any, defense_args: Optional[Dict[str, Any]], model_settings, data_settings, seed: int,
              device, timeout: float) -> AuditParts:
    """An audit's parts built from its own settings (a sweep's cells share theirs instead):
    the defense resolved and identified (each call within ``timeout`` seconds), then the rest."""
    defense = resolve_defense(defense_spec, defense_args or {})
    ident = defense_identity(defense, defense_spec, timeout=timeout)
    return build_parts(build_shared(model_settings, data_settings, seed, device), defense, defense_spec, seed, ident)


def reconstruct(attack: Any, observation: Any, budget: Optional[int], seed: int, progress: Optional[Callable]):
    """``attack.reconstruct``, with the ``progress(done, total, loss)`` callback for attacks that take one."""
    if progress is not None and "progress" in parameter_names(attack.reconstruct):
        return attack.reconstruct(observation, budget, seed, progress=progress)
    return attack.reconstruct(observation, budget, seed)
