"""The attacker's generator: resolved from a spec, frozen on the observation's device, and
conditioned on the attack's labels (used by GGL / GIAS / GIFD and the ``generator`` box)."""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.reasons import Reason

from generators.auxiliary import default_generator
from generators.base import ImageGenerator, as_generator, check_compatible
from generators.checkpoint import load_generator

GeneratorSpec = Union[None, str, nn.Module]
CONDITIONS = ("auto", "labels", "random", "none")


def resolve_generator(generator: GeneratorSpec, factory: Optional[str], input_shape: Sequence[int],
                      device: torch.device, progress: bool = True) -> ImageGenerator:
    """A frozen, eval-mode private copy of the attacker's generator on ``device``.

    ``generator`` is a module, a checkpoint path, or ``None`` (with ``factory`` None: the
    default DCGAN for ``input_shape``, trained on the embedded train split and cached;
    ``progress`` shows its training bar when it is not cached yet).
    """
    if isinstance(generator, nn.Module):
        gen = as_generator(copy.deepcopy(generator))
    elif generator is None and factory is None:
        gen = default_generator(input_shape, device=device, progress=progress)
    elif generator is None or isinstance(generator, str):
        gen = load_generator(generator, factory=factory, device=device)
    else:
        raise ConfigError(f"generator must be an nn.Module or a checkpoint path, got {type(generator).__name__}")
    check_compatible(gen, input_shape)
    gen = gen.to(device).eval()
    gen.requires_grad_(False)
    return gen


def generator_info(gen: ImageGenerator) -> Dict[str, Any]:
    """What the attacker's generator is and what it was trained on, for the trace / report."""
    info = dict(getattr(gen, "checkpoint_info", {}) or {})
    return {"settings": gen.settings(), "source": info.get("path") or info.get("factory") or "in-memory module",
            "data": info.get("data", {}), "layers": gen.num_layers}


def condition_labels(gen: ImageGenerator, labels: Tensor, num_classes: int, mode: str,
                     rng: torch.Generator) -> Tuple[Optional[Tensor], str]:
    """The labels the generator is conditioned on, and a note for the trace.

    ``auto``: the attack's (inferred / shared) labels when the generator has the model's
    class count, else a seeded random class per image; ``labels`` requires the former;
    ``random`` always draws; ``none`` for unconditional generators.
    """
    if mode not in CONDITIONS:
        raise ConfigError(f"condition must be one of {CONDITIONS}, got {mode!r}")
    if gen.num_classes == 0:
        if mode in ("labels", "random"):
            raise ConfigError(f"condition={mode!r} needs a class-conditional generator; this one has no classes")
        return None, Reason("generator-unconditional").to_dict()
    if mode == "none":
        raise ConfigError("the generator is class-conditional: use condition=auto, labels or random")
    if mode in ("auto", "labels") and gen.num_classes == num_classes:
        return labels, Reason("generator-conditioned").to_dict()
    if mode == "labels":
        raise ConfigError(f"condition='labels' needs a generator with the model's {num_classes} classes; "
                          f"it has {gen.num_classes}. Use condition=random or a matching generator")
    drawn = torch.randint(gen.num_classes, labels.shape, generator=rng, device=rng.device)
    return drawn, Reason("generator-random-classes", classes=drawn.tolist()).to_dict()


def generate(gen: ImageGenerator, z: Tensor, cond: Optional[Tensor]) -> Tensor:
    """Images for latents ``(R, B, L)`` -> ``(R, B, C, H, W)`` (one batched generator pass)."""
    r, b = z.shape[:2]
    y = None if cond is None else cond.repeat(r)
    return gen(z.reshape(r * b, -1), y).reshape(r, b, *gen.image_shape)
