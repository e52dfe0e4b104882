"""The generator interface: a latent vector (and optionally a class label) -> images in [0, 1].

A generator used as an image prior is an :class:`ImageGenerator`:

* ``latent_dim`` (int), ``image_shape`` ``(C, H, W)``, ``num_classes`` (0: unconditional);
* ``forward(z, labels=None) -> (B, C, H, W)`` images in [0, 1];
* intermediate features for GIFD: ``embed(z, labels)`` is the input of the first of the
  ``blocks`` (an ``nn.ModuleList``); ``features(z, labels, layer)`` runs the first
  ``layer`` blocks and ``decode(h, layer)`` the remaining ones, so
  ``decode(features(z, y, k), k) == forward(z, y)`` for every ``k``.

Any ``nn.Module`` with ``latent_dim`` and a ``forward(z[, labels])`` can be used: wrap it
with :func:`as_generator` (``blocks`` / ``embed`` are optional; without ``blocks`` only the
latent space is searchable).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.types import parameter_names


class ImageGenerator(nn.Module):
    """Base class: subclasses set ``latent_dim``, ``image_shape``, ``num_classes`` and ``blocks``."""

    latent_dim: int
    image_shape: Tuple[int, int, int]
    num_classes: int = 0
    blocks: nn.ModuleList

    def embed(self, z: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """The input of the first block (the latent itself by default)."""
        return z

    @property
    def num_layers(self) -> int:
        """Number of blocks; features exist at layers ``0 .. num_layers - 1``."""
        return len(self.blocks)

    def features(self, z: Tensor, labels: Optional[Tensor] = None, layer: int = 0) -> Tensor:
        """The input of block ``layer`` (layer 0: the embedded latent)."""
        self._check_layer(layer)
        h = self.embed(z, labels)
        for block in self.blocks[:layer]:
            h = block(h)
        return h

    def decode(self, h: Tensor, layer: int = 0) -> Tensor:
        """Run blocks ``layer ..`` on the features ``h`` (the images, in [0, 1])."""
        self._check_layer(layer)
        for block in self.blocks[layer:]:
            h = block(h)
        return h

    def forward(self, z: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        return self.decode(self.embed(z, labels), 0)

    def sample_latent(self, n: int, generator: Optional[torch.Generator] = None,
                      device: Optional[torch.device] = None) -> Tensor:
        """``n`` latents from the prior N(0, I)."""
        device = device if device is not None else _module_device(self)
        return torch.randn(n, self.latent_dim, generator=generator, device=device)

    def settings(self) -> dict:
        """What a checkpoint stores to rebuild this generator."""
        return {"latent_dim": self.latent_dim, "image_shape": list(self.image_shape),
                "num_classes": self.num_classes}

    def _check_layer(self, layer: int) -> None:
        if self.num_layers == 0:
            raise ConfigError(f"{type(self).__name__} exposes no blocks, so its intermediate features "
                              "cannot be searched; give the module a `blocks` nn.ModuleList")
        if not 0 <= layer < self.num_layers:
            raise ConfigError(
                f"generator layer {layer} does not exist; valid layers are 0..{self.num_layers - 1}")


class ModuleGenerator(ImageGenerator):
    """Adapts a user's ``nn.Module`` to :class:`ImageGenerator` (see :func:`as_generator`).

    With ``module.blocks`` (and optionally ``module.embed``) its intermediate features are
    reachable; without, ``num_layers`` is 0 and only the latent space can be searched.
    """

    def __init__(self, module: nn.Module, latent_dim: int, image_shape, num_classes: int,
                 output_range: Tuple[float, float]):
        super().__init__()
        self.module = module
        self.latent_dim = latent_dim
        self.image_shape = tuple(image_shape)
        self.num_classes = num_classes
        self.output_range = output_range
        self._takes_labels = num_classes > 0 or "labels" in parameter_names(module.forward)
        user_blocks = getattr(module, "blocks", None)
        layered = isinstance(user_blocks, (nn.ModuleList, nn.Sequential)) and len(user_blocks) > 0
        # the same block objects as the user's module (no copy): parameters are shared
        self.blocks = nn.ModuleList(list(user_blocks) if layered else [])

    def embed(self, z, labels=None):
        user_embed = getattr(self.module, "embed", None)
        return user_embed(z, labels) if callable(user_embed) else z

    def decode(self, h, layer=0):
        return self._rescale(super().decode(h, layer))

    def forward(self, z, labels=None):
        out = self.module(z, labels) if self._takes_labels else self.module(z)
        return self._rescale(out)

    def _rescale(self, x):
        lo, hi = self.output_range
        return x if (lo, hi) == (0.0, 1.0) else (x - lo) / (hi - lo)

    def settings(self):
        return {**super().settings(), "output_range": list(self.output_range)}


def as_generator(module: nn.Module, *, image_shape: Optional[Sequence[int]] = None,
                 num_classes: Optional[int] = None) -> ImageGenerator:
    """Check a module against the generator interface and adapt it if needed.

    An :class:`ImageGenerator` is returned as is. Another module must have ``latent_dim``;
    ``image_shape`` is read from the module or inferred from one sample, ``num_classes`` from
    the module (default 0), ``output_range`` (default ``(0, 1)``; ``(-1, 1)`` for tanh
    generators) from the module.
    """
    if isinstance(module, ImageGenerator):
        return module
    if not isinstance(module, nn.Module):
        raise ConfigError(f"a generator must be a torch nn.Module, got {type(module).__name__}")
    latent_dim = getattr(module, "latent_dim", None)
    if not isinstance(latent_dim, int) or latent_dim < 1:
        raise ConfigError(
            f"generator {type(module).__name__} has no integer attribute latent_dim; set "
            "module.latent_dim to the size of its latent vector (forward(z) takes (B, latent_dim))")
    n_cls = int(num_classes if num_classes is not None else getattr(module, "num_classes", 0) or 0)
    out_range = tuple(float(v) for v in getattr(module, "output_range", (0.0, 1.0)))
    adapted = ModuleGenerator(module, latent_dim, (0, 0, 0), n_cls, out_range)
    device = _module_device(module)
    with torch.no_grad():
        was_training = module.training
        module.eval()
        z = torch.zeros(1, latent_dim, device=device)
        labels = torch.zeros(1, dtype=torch.long, device=device) if n_cls else None
        try:
            sample = adapted(z, labels)
        except Exception as err:  # a user's module: report what it did, not a deep traceback
            raise ConfigError(
                f"generator {type(module).__name__} failed on a latent of shape (1, {latent_dim}): "
                f"{type(err).__name__}: {err}. It must map (B, latent_dim) to images (B, C, H, W)") from None
        module.train(was_training)
    if sample.dim() != 4:
        raise ConfigError(f"generator {type(module).__name__} returned shape {tuple(sample.shape)}; "
                          "it must return images (B, C, H, W)")
    inferred = tuple(sample.shape[1:])
    declared = tuple(image_shape or getattr(module, "image_shape", None) or inferred)
    if declared != inferred:
        raise ConfigError(f"generator {type(module).__name__} returns images of shape {inferred}, "
                          f"not the declared {declared}")
    adapted.image_shape = inferred
    return adapted


def check_compatible(gen: ImageGenerator, input_shape: Sequence[int]) -> None:
    """Raise a ConfigError when the generator's images do not fit the audited model's input."""
    if tuple(gen.image_shape) != tuple(input_shape):
        raise ConfigError(
            f"the generator makes images of shape {tuple(gen.image_shape)} but the model takes "
            f"{tuple(input_shape)}; train one for this shape (gia-audit train-generator --image-size "
            f"{input_shape[-1]} on a data set of {input_shape[0]} channels) or pass a matching checkpoint")


def _module_device(module: nn.Module) -> torch.device:
    for tensor in list(module.parameters()) + list(module.buffers()):
        return tensor.device
    return torch.device("cpu")


