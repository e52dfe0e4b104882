"""Auxiliary data for the learned inverter, and its training pairs.

Auxiliary images come from the observation's declared extras (``extra["aux_images"]``,
optionally ``extra["aux_labels"]``) or, by default, from the *train* split of a registered
data set (the audit attacks the *test* split, so the two are disjoint). Training pairs
are made exactly as the client makes its update: the observation's defense runs on the
observation's model (FedAvg unrolled as the client does) with a seeded generator.
"""
from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch
from torch import Tensor
from tqdm.auto import tqdm

from audit.errors import DataError
from audit.observe import _client_round
from audit.types import Observation

from .inverter_sketch import GradientSketch, flatten_gradients


def _match_channels(images: Tensor, channels: int) -> Tensor:
    from audit.data import to_grayscale

    if images.shape[1] == channels:
        return images
    if channels == 1 and images.shape[1] == 3:
        return to_grayscale(images)
    if channels == 3 and images.shape[1] == 1:
        return images.expand(-1, 3, -1, -1).contiguous()
    raise DataError(f"auxiliary images have {images.shape[1]} channels, the model takes {channels}; "
                    "declare matching images in observation.extra['aux_images']")


def _dataset_split(name: str, input_shape) -> Tuple[Tensor, Tensor, str]:
    from audit.data import load_dataset

    c, h, w = input_shape
    if h != w:
        raise DataError(f"the default auxiliary data set {name!r} has square images, the model takes "
                        f"{h}x{w}; declare auxiliary images in observation.extra['aux_images']")
    data = load_dataset(name, size=h)
    return _match_channels(data.train_images, c), data.train_labels, f"{name} train split ({h}x{w})"


def auxiliary_data(observation: Observation, dataset: str = "embedded",
                   limit: Optional[int] = None) -> Tuple[Tensor, Tensor, str]:
    """``(images, labels, description)`` on the observation's device.

    Labels: the declared ones, else the data set's when they fit the model's classes,
    else the observation model's predictions (pseudo-labels).
    """
    extra = observation.extra or {}
    if extra.get("aux_images") is not None:
        images = torch.as_tensor(extra["aux_images"]).float()
        labels = extra.get("aux_labels")
        source = f"declared auxiliary images ({len(images)})"
    else:
        images, labels, source = _dataset_split(dataset, observation.input_shape)
    if images.dim() != 4 or tuple(images.shape[1:]) != tuple(observation.input_shape):
        raise DataError(f"auxiliary images have shape {tuple(images.shape)}, the model takes "
                        f"(N, {', '.join(map(str, observation.input_shape))})")
    if len(images) < observation.batch_size:
        raise DataError(f"{len(images)} auxiliary images cannot fill one batch of {observation.batch_size}")
    if images.min() < 0 or images.max() > 1:
        raise DataError("auxiliary images must be in [0, 1] (normalisation is the model's first layer)")
    if limit is not None:
        images = images[:limit]
        labels = None if labels is None else labels[:limit]
    device = observation.device
    images = images.to(device)
    labels = None if labels is None else torch.as_tensor(labels).long().to(device)
    if labels is None or len(labels) != len(images) or labels.min() < 0 or labels.max() >= observation.num_classes:
        labels = _pseudo_labels(observation, images)
        source += ", labels predicted by the audited model"
    return images, labels, source


@torch.no_grad()
def _pseudo_labels(observation: Observation, images: Tensor, chunk: int = 256) -> Tensor:
    model = copy.deepcopy(observation.model).eval()
    return torch.cat([model(images[i:i + chunk]).argmax(1) for i in range(0, len(images), chunk)])


def pair_indices(n: int, pairs: int, batch_size: int, generator: torch.Generator) -> Tensor:
    """``(pairs, batch_size)`` auxiliary indices: shuffled passes over the data, so every
    image is used before any repeats and no batch holds an image twice (``n >= batch_size``)."""
    need = pairs * batch_size
    passes = -(-need // n)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(passes)])[:need]
    idx = order.view(pairs, batch_size)
    if batch_size > 1:  # a batch spanning two passes may repeat an image: redraw those rows
        for row in range(pairs):
            if idx[row].unique().numel() < batch_size:
                idx[row] = torch.randperm(n, generator=generator)[:batch_size]
    return idx


def defended_features(observation: Observation, images: Tensor, labels: Tensor, index: Tensor,
                      sketch: GradientSketch, generator: torch.Generator, progress: bool = True) -> Tensor:
    """The sketched shared gradient of every auxiliary batch ``images[index[p]]``: ``(P, dim)``.

    Each batch goes through one client round exactly as :func:`audit.observe.observe` runs
    it (the defense with ``generator``, FedAvg unrolled, the client's BatchNorm mode) on a
    private copy of the observation's model, restored after every round.
    """
    obs = observation
    work = copy.deepcopy(obs.model)
    state = {k: v.clone() for k, v in work.state_dict().items()}
    out = torch.empty(len(index), sketch.out_dim, device=obs.device)
    for p in tqdm(range(len(index)), desc="learned-inverter: defended gradients", disable=not progress,
                  leave=False):
        rows = index[p].to(images.device)
        shared = _client_round(work, images[rows], labels[rows], obs.defense, obs.loss_fn, generator,
                               obs.local_steps, obs.local_lr, obs.local_batch_size, obs.client_mode)
        out[p] = sketch(flatten_gradients(shared).detach())
        work.load_state_dict(state)
    return out
