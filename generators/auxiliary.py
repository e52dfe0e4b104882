"""Generators trained on auxiliary data, and the cached default generator of an audit.

The attacker's auxiliary data must be disjoint from the audited (private) images: the audit
draws its private batches from a data set's *test* split, so generators are trained on the
*train* split (for the embedded data: different regions of the same pictures).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

from audit.core.cache import cache_dir
from audit.core.errors import ConfigError

from generators.base import ImageGenerator
from generators.checkpoint import load_generator, save_generator
from generators.dcgan import build_generator
from generators.training import TrainSettings, train_gan

AUX_SPLIT = "train"  # never the test split, which holds the audited images
DATASET_FOR_CHANNELS = {3: "embedded", 1: "embedded-gray"}


@dataclass
class GeneratorRecipe:
    """Everything that determines a trained generator (the cache key)."""

    dataset: str = "embedded"
    data_path: Optional[str] = None
    size: int = 32
    conditional: bool = True
    latent_dim: int = 32
    width: int = 32
    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-4
    seed: int = 0

    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def train_generator(recipe: GeneratorRecipe = GeneratorRecipe(), *, out: Optional[Union[str, os.PathLike]] = None,
                    device: Union[str, torch.device] = "cpu", progress: bool = True) -> ImageGenerator:
    """Train a DCGAN on the *train* split of ``recipe.dataset``; save it to ``out`` if given.

    The checkpoint records the recipe, the data (name, split, image count, class names) and
    the final losses; the returned generator is in eval mode with ``checkpoint_info`` set.
    """
    from audit.core.data import load_dataset

    data = load_dataset(recipe.dataset, path=recipe.data_path, size=recipe.size)
    images = data.train_images.to(device)
    labels = data.train_labels.to(device)
    num_classes = data.num_classes if recipe.conditional else 0
    generator, discriminator = build_generator(
        "dcgan", seed=recipe.seed, latent_dim=recipe.latent_dim, image_shape=tuple(images.shape[1:]),
        num_classes=num_classes, width=recipe.width)
    generator.to(device)
    discriminator.to(device)
    settings = TrainSettings(steps=recipe.steps, batch_size=recipe.batch_size, lr=recipe.lr)
    history = train_gan(generator, discriminator, images, labels, settings, seed=recipe.seed, progress=progress)
    info = {
        "data": {"dataset": recipe.dataset, "path": recipe.data_path, "split": AUX_SPLIT,
                 "images": int(images.shape[0]), "classes": list(data.classes) if num_classes else [],
                 "disjoint_from": "test"},  # the split the audit's private images come from
        "training": {**asdict(recipe), "final_d_loss": _tail_mean(history.d_loss),
                     "final_g_loss": _tail_mean(history.g_loss)},
    }
    generator.checkpoint_info = {"architecture": "dcgan", "settings": generator.settings(), **info}
    if out is not None:
        save_generator(out, generator, architecture="dcgan", **info)
        generator.checkpoint_info["path"] = str(out)
    return generator


def default_generator(image_shape: Sequence[int], *, device: Union[str, torch.device] = "cpu",
                      cache: Optional[Union[str, os.PathLike]] = None, progress: bool = True,
                      **recipe_overrides) -> ImageGenerator:
    """The generator an audit uses when none is given: a DCGAN trained on the embedded *train*
    split at the model's input shape, loaded from the cache (trained and cached on first use)."""
    recipe = default_recipe(image_shape, **recipe_overrides)
    path = cache_dir("generators", f"dcgan-{recipe.dataset}-{recipe.size}-{recipe.key()}.pt", root=cache)
    if path.is_file():
        return load_generator(path, device=device)
    return train_generator(recipe, out=path, device=device, progress=progress)


def default_recipe(image_shape: Sequence[int], **overrides) -> GeneratorRecipe:
    """The recipe of :func:`default_generator` for images of ``image_shape``."""
    channels, height, width = _shape(image_shape)
    if height != width:
        raise ConfigError(f"the default generator makes square images; the model takes {height}x{width}: "
                          "pass your own generator (generator=PATH, generator_factory=module:attr)")
    if "dataset" not in overrides:
        if channels not in DATASET_FOR_CHANNELS:
            raise ConfigError(f"no embedded data with {channels} channels to train a generator on; "
                              "pass your own generator")
        overrides["dataset"] = DATASET_FOR_CHANNELS[channels]
    try:
        return GeneratorRecipe(size=height, **overrides)
    except TypeError as err:
        raise ConfigError(f"bad generator setting ({err}); valid: "
                          f"{', '.join(GeneratorRecipe.__dataclass_fields__)}") from None


def _shape(image_shape: Sequence[int]) -> Tuple[int, int, int]:
    if len(image_shape) != 3:
        raise ConfigError(f"image_shape must be (channels, height, width), got {tuple(image_shape)}")
    return tuple(int(v) for v in image_shape)  # type: ignore[return-value]


def _tail_mean(values, n: int = 50) -> Optional[float]:
    tail = values[-n:]
    return float(sum(tail) / len(tail)) if tail else None
