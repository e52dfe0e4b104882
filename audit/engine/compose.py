"""Turning what a user gives into the objects an audit runs: the device, the data set, the
defense (resolved here, and only here), the model, and the client's model (wrapped by an
architectural defense exactly once)."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from audit.core.errors import ConfigError, DefenseError, GiaError
from audit.core.types import parameter_names


def resolve_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigError(f"device {device!r} is not a torch device ({err}); use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was given but no CUDA device is available; use device='cpu'")
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
    """``defense.wrap_model(model)`` under a seed: the client's model for the whole run (the
    only place an architectural defense is applied)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = defense.wrap_model(model)
        except GiaError:
            raise
        except Exception as err:
            raise DefenseError(f"defense {defense.name!r}: wrap_model raised {type(err).__name__}: {err}") from err
    if not isinstance(wrapped, nn.Module):
        raise DefenseError(f"defense {defense.name!r}: wrap_model returned {type(wrapped).__name__}, not an nn.Module")
    return wrapped


def reconstruct(attack: Any, observation: Any, budget: Optional[int], seed: int, progress: Optional[Callable]):
    """``attack.reconstruct``, with the ``progress(done, total, loss)`` callback for attacks that take one."""
    if progress is not None and "progress" in parameter_names(attack.reconstruct):
        return attack.reconstruct(observation, budget, seed, progress=progress)
    return attack.reconstruct(observation, budget, seed)
