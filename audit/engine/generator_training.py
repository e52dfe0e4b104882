"""What ``gia-audit train-generator`` runs: train the DCGAN image prior of GGL / GIAS / GIFD on
the *train* split of a data set (the audit's private images come from the test split)."""
from __future__ import annotations

from typing import Any, Optional

from audit.engine.compose import resolve_device


def train_prior_generator(dataset: str = "embedded", *, data_path: Optional[str] = None, size: int = 32,
                          steps: int = 2000, batch_size: int = 64, lr: float = 2e-4, latent_dim: int = 32,
                          width: int = 32, conditional: bool = True, out: str = "generator.pt", seed: int = 0,
                          device: Any = "cpu") -> str:
    """Train the generator, save it to ``out`` (weights, settings, training data) and say what
    was saved."""
    from generators import GeneratorRecipe, train_generator

    recipe = GeneratorRecipe(dataset=dataset, data_path=data_path, size=size, conditional=conditional,
                             latent_dim=latent_dim, width=width, steps=steps, batch_size=batch_size, lr=lr,
                             seed=seed)
    gen = train_generator(recipe, out=out, device=resolve_device(device))
    return (f"saved {out}: {tuple(gen.image_shape)} images, latent {gen.latent_dim}, "
            f"{gen.num_classes or 'no'} classes, trained on {dataset}/train")
