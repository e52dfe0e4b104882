"""The generative prior for the optimisation attack: reconstruct in a generator's latent space.

:class:`GeneratorBox` is a search space (a "box" of :mod:`attacks.search_space`, registered
there as ``generator``): the optimisation attack optimises latents ``z`` ``(B, latent_dim)`` per restart
and every image it scores is ``G(z, y)``, so any optimisation preset becomes a latent-space
attack, e.g. ``ATTACKS.build("ig", box="generator")``. The latents start from N(0, I) (the
attack's pixel initialisation only fixes the shape) and are truncated to
``[-truncation, truncation]`` after each step. The optimisation run calls :meth:`GeneratorBox.bind`
once per run with the observation, the label plan and the run's seeded generator.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from audit.core.errors import ConfigError
from generators import CONDITIONS, ImageGenerator, condition_labels, generator_info, resolve_generator


class GeneratorBox:
    """Unbound settings: which generator, how it is conditioned, the latent truncation."""

    name = "generator"

    def __init__(self, generator: Any = None, generator_factory: Optional[str] = None,
                 condition: str = "auto", truncation: float = 3.0):
        if condition not in CONDITIONS:
            raise ConfigError(f"generator box: condition must be one of {CONDITIONS}, got {condition!r}")
        if not truncation > 0:
            raise ConfigError(f"generator box: truncation must be > 0, got {truncation}")
        self.generator, self.generator_factory = generator, generator_factory
        self.condition, self.truncation = condition, float(truncation)

    def bind(self, observation, labels, rng: torch.Generator, progress: bool = True) -> "BoundGeneratorBox":
        """The box of one run: the generator resolved for the observation, its class labels
        (``progress``: show the bar if a default generator has to be trained first)."""
        gen = resolve_generator(self.generator, self.generator_factory, observation.input_shape,
                                observation.device, progress=progress)
        fixed = labels.fixed
        if fixed is None and gen.num_classes and self.condition in ("auto", "labels"):
            raise ConfigError("a class-conditional generator box needs fixed labels: use labels=infer "
                              "(or shared), not optimize, or condition=random")
        if fixed is None:
            fixed = torch.zeros(observation.batch_size, dtype=torch.long, device=observation.device)
        cond, note = condition_labels(gen, fixed, observation.num_classes, self.condition, rng)
        return BoundGeneratorBox(gen, cond, self.truncation, rng, note)

    # an unbound box cannot map latents: the optimisation run binds it first
    def image(self, z: Tensor) -> Tensor:
        raise ConfigError("the generator box must be bound to a run (GeneratorBox.bind) before use")

    variable = image
    project_ = image


class BoundGeneratorBox:
    """``image(z) = G(z, y)`` for latents ``(B, L)`` or ``(R, B, L)``."""

    name = "generator"

    def __init__(self, generator: ImageGenerator, cond: Optional[Tensor], truncation: float,
                 rng: torch.Generator, note: Dict[str, Any]):
        self.gen, self.cond, self.truncation, self.rng = generator, cond, truncation, rng
        self.info = {**generator_info(generator), "conditioning": note, "truncation": truncation}

    def image(self, z: Tensor) -> Tensor:
        lead = z.shape[:-1]  # (B,) or (R, B)
        y = None if self.cond is None else self.cond.repeat(z[..., 0].numel() // self.cond.numel())
        return self.gen(z.reshape(-1, z.shape[-1]), y).reshape(*lead, *self.gen.image_shape)

    def variable(self, x: Tensor) -> Tensor:
        """Latents N(0, I) shaped like the attack's initial pixels ``(R, B, C, H, W)`` minus the image dims."""
        return torch.randn(*x.shape[:-3], self.gen.latent_dim, generator=self.rng, device=x.device)

    def project_(self, z: Tensor) -> None:
        with torch.no_grad():
            z.clamp_(-self.truncation, self.truncation)
