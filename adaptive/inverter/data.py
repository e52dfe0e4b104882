"""Auxiliary data for the learned inverter.

Auxiliary images come from the observation's declared extras (``extra["aux_images"]``,
optionally ``extra["aux_labels"]``) or, by default, from the *train* split of a registered
data set (the audit attacks the *test* split, so the two are disjoint).
"""
from __future__ import annotations

import copy
import hashlib
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from audit.core.errors import DataError
from audit.core.reasons import Reason
from audit.core.types import Observation

from adaptive.inverter.cache import hash_tensors, tensor_digest


def _match_channels(images: Tensor, channels: int) -> Tensor:
    from audit.core.data import to_grayscale

    if images.shape[1] == channels:
        return images
    if channels == 1 and images.shape[1] == 3:
        return to_grayscale(images)
    if channels == 3 and images.shape[1] == 1:
        return images.expand(-1, 3, -1, -1).contiguous()
    raise DataError(f"auxiliary images have {images.shape[1]} channels, the model takes {channels}; "
                    "declare matching images in observation.extra['aux_images']")


def _dataset_split(name: str, input_shape) -> Tuple[Tensor, Tensor, str]:
    from audit.core.data import load_dataset

    c, h, w = input_shape
    if h != w:
        raise DataError(f"the default auxiliary data set {name!r} has square images, the model takes "
                        f"{h}x{w}; declare auxiliary images in observation.extra['aux_images']")
    data = load_dataset(name, size=h)
    source = {"origin": name, "split": "train", "size": f"{h}x{w}"}
    return _match_channels(data.train_images, c), data.train_labels, source


def auxiliary_data(observation: Observation, dataset: str = "embedded", limit: Optional[int] = None,
                   seed: int = 0) -> Tuple[Tensor, Tensor, Dict[str, Any]]:
    """``(images, labels, source)`` on the observation's device; ``source``: the JSON object of
    the reason ``aux-data`` (where the images came from, how many were kept, whose labels).

    ``limit``: keep a seeded random subset of at most that many images (data sets are often
    sorted by class, so not the first ones). Labels: the declared ones, else the data set's
    when they fit the model's classes, else the observation model's predictions.
    """
    extra = observation.extra or {}
    if extra.get("aux_images") is not None:
        images = torch.as_tensor(extra["aux_images"]).float()
        labels = extra.get("aux_labels")
        source = {"origin": "declared", "images": len(images)}
    else:
        images, labels, source = _dataset_split(dataset, observation.input_shape)
    if images.dim() != 4 or tuple(images.shape[1:]) != tuple(observation.input_shape):
        raise DataError(f"auxiliary images have shape {tuple(images.shape)}, the model takes "
                        f"(N, {', '.join(map(str, observation.input_shape))})")
    if len(images) < observation.batch_size:
        raise DataError(f"{len(images)} auxiliary images cannot fill one batch of {observation.batch_size}")
    if images.min() < 0 or images.max() > 1:
        raise DataError("auxiliary images must be in [0, 1] (normalisation is the model's first layer)")
    if limit is not None and limit < len(images):
        keep = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))[:limit].sort().values
        images = images[keep]
        labels = None if labels is None else torch.as_tensor(labels)[keep]
        source["limit"] = limit
    device = observation.device
    images = images.to(device)
    labels = None if labels is None else torch.as_tensor(labels).long().to(device)
    if labels is None or len(labels) != len(images) or labels.min() < 0 or labels.max() >= observation.num_classes:
        labels = _pseudo_labels(observation, images)
        source["labels"] = "predicted"
    return images, labels, Reason("aux-data", **source).to_dict()


def auxiliary_fingerprint(observation: Observation, images: Tensor, labels: Tensor) -> str:
    """The cache-key part for the auxiliary data :func:`auxiliary_data` returned.

    Declared images are hashed as declared, once per tensor object (every observation of an
    audit declares the same set), plus the selected labels (small); the subset follows from
    the inverter's settings, which are in the key too. Otherwise the selection is hashed.
    """
    declared = (observation.extra or {}).get("aux_images")
    if isinstance(declared, Tensor):
        return hash_tensors([labels], hashlib.sha256(f"declared {tensor_digest(declared)}".encode()))
    return hash_tensors([images, labels])


@torch.no_grad()
def _pseudo_labels(observation: Observation, images: Tensor, chunk: int = 256) -> Tensor:
    model = copy.deepcopy(observation.model).eval()
    return torch.cat([model(images[i:i + chunk]).argmax(1) for i in range(0, len(images), chunk)])
