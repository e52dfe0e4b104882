"""The client's reply as the server receives it, read against the deployment's model.

A train reply holds one ArrayRecord: the client's weights after its local training, and its
buffers (BatchNorm running statistics) when it sends its whole ``state_dict``. Its arrays
are matched to the model by ``state_dict`` name, or by position (a record built from a list
of arrays) over the whole state (weights and buffers) or over the weights alone. What it
holds decides what the client shares: weights only, an update (a gradient for one plain SGD
step); weights and buffers, its state.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from audit.core.errors import DataError
from audit.core.models import Normalize


@dataclass
class NamedArrays:
    """Arrays of a message by the deployment model's ``state_dict`` names: its trainable
    ``weights`` (every one), its ``buffers`` (those present; empty: none sent) and the
    ``frozen`` parameters (present or not)."""

    weights: Dict[str, Tensor]
    buffers: Dict[str, Tensor]
    frozen: Dict[str, Tensor]

    def state(self) -> Dict[str, Tensor]:
        return {**self.weights, **self.frozen, **self.buffers}


def deployment_module(model: nn.Module) -> nn.Module:
    """The client's network inside the audited model (without the Normalize layer the audit
    puts in front of a model that expects normalised inputs)."""
    if isinstance(model, nn.Sequential) and len(model) == 2 and isinstance(model[0], Normalize):
        return model[1]
    return model


def audited_prefix(model: nn.Module) -> str:
    """The prefix of the deployment's ``state_dict`` names inside the audited model."""
    return "1." if deployment_module(model) is not model else ""


def named_arrays(arrays: Dict[str, Tensor], net: nn.Module, what: str) -> NamedArrays:
    """``arrays`` (a message's ArrayRecord as tensors) by the names of ``net``'s ``state_dict``;
    a :class:`DataError` naming the mismatch when they do not fit (``what``: "the reply", ...)."""
    state = net.state_dict()
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    frozen = [n for n, p in net.named_parameters() if not p.requires_grad]
    buffers = [n for n in state if n not in set(trainable) | set(frozen)]
    keys = list(arrays)
    if set(keys) <= set(state):
        named = dict(arrays)
    elif len(keys) == len(state):
        named = dict(zip(state, arrays.values()))
    elif len(keys) == len(trainable):
        named = dict(zip(trainable, arrays.values()))
    else:
        raise DataError(f"{what} holds {len(keys)} arrays ({', '.join(keys[:3])}, ...) that match neither the "
                        f"model's state_dict names nor its {len(state)} state entries or {len(trainable)} trainable "
                        "weights in order; give the mod the model the client trains (model=)")
    missing = [n for n in trainable if n not in named]
    if missing:
        raise DataError(f"{what} lacks the model's weights {', '.join(missing[:3])}; give the mod the model the "
                        "client trains (model=) and the ArrayRecord that holds them (arrays_key=)")
    for name, value in named.items():
        if tuple(value.shape) != tuple(state[name].shape):
            raise DataError(f"{what}'s {name} has shape {tuple(value.shape)}, the model's {tuple(state[name].shape)}; "
                            "give the mod the model the client trains (model=, model_args=)")
    return NamedArrays({n: named[n] for n in trainable}, {n: named[n] for n in buffers if n in named},
                       {n: named[n] for n in frozen if n in named})


def message_arrays(msg, key: Optional[str], what: str) -> Dict[str, Tensor]:
    """The tensors of ``msg``'s ArrayRecord (``key``, or its only one), detached copies."""
    records = msg.content.array_records
    if key is None:
        if len(records) != 1:
            raise DataError(f"{what} holds {len(records)} ArrayRecords ({', '.join(records)}); give the mod "
                            "arrays_key=")
        key = next(iter(records))
    if key not in records:
        raise DataError(f"{what} has no ArrayRecord {key!r} (it has {', '.join(records) or 'none'}); fix arrays_key=")
    return {k: torch.as_tensor(v).detach().clone() for k, v in records[key].to_torch_state_dict().items()}


def update_in_gradient_units(before: NamedArrays, after: NamedArrays, lr: float) -> List[Tensor]:
    """``(theta_before - theta_after) / lr`` per trainable weight, in the model's order."""
    return [(before.weights[n].float() - after.weights[n].float()) / lr for n in before.weights]


def digest(arrays: Dict[str, Tensor]) -> str:
    """A sha256 of the arrays' names and bytes (what the audit of a reply is keyed by)."""
    h = hashlib.sha256()
    for name, value in arrays.items():
        h.update(name.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
