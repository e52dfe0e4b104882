"""Negative controls: defenses that share the exact gradient of a *decoy* batch, so nothing
of the private images is in what they share.

An audit of a decoy must come out "no recovered image": the attacks reconstruct the decoy,
and the leak rule must not mistake a flat or smooth guess for a recovered image
(``docs/evidence.md``). ``kind="flat"``: every image one fixed colour near the embedded
data's mean; ``kind="texture"``: one fixed smooth colour texture; ``kind="photo"``: a photo from
outside the data sets (the portrait matplotlib ships). Labels are the true ones; a
client that shares its state uploads the decoy's BatchNorm statistics (``buffer_inputs``).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from audit.core.types import Defense, clean_gradients, default_loss_fn

from defenses.common import check_choice, check_range
from defenses.registry import DEFENSES

KINDS = ("flat", "texture", "photo")
FLAT_COLOUR = (0.52, 0.40, 0.35)  # near the embedded data set's mean colour


def decoy_images(kind: str, shape, level: float, device=None, dtype=torch.float32) -> Tensor:
    """The decoy batch for inputs of ``shape`` ``(B, C, H, W)``: the same image for every row."""
    b, c, h, w = shape
    colour = torch.tensor([FLAT_COLOUR[k % 3] for k in range(c)], device=device, dtype=dtype).view(1, c, 1, 1)
    if kind == "flat":
        return colour.expand(b, c, h, w).clone()
    if kind == "photo":
        return outside_photo(h, w, c).to(device=device, dtype=dtype).unsqueeze(0).expand(b, c, h, w).clone()
    y = torch.linspace(0, 2 * math.pi, h, device=device, dtype=dtype).view(1, 1, h, 1)
    x = torch.linspace(0, 2 * math.pi, w, device=device, dtype=dtype).view(1, 1, 1, w)
    phase = torch.arange(c, device=device, dtype=dtype).view(1, c, 1, 1)
    wave = torch.sin(1.5 * x + phase) * torch.cos(y - 0.7 * phase)
    return (colour + level * wave).clamp(0, 1).expand(b, c, h, w).clone()


@lru_cache(maxsize=8)
def outside_photo(height: int, width: int, channels: int) -> Tensor:
    """matplotlib's sample portrait (in none of the data sets), centre-cropped to the aspect and
    resized to ``(channels, height, width)`` in [0, 1]; grey for one channel."""
    import numpy as np
    from matplotlib import cbook
    from PIL import Image

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as pic:
        pic = pic.convert("L" if channels == 1 else "RGB")
        side_w, side_h = pic.size
        scale = min(side_w / width, side_h / height)
        crop_w, crop_h = int(width * scale), int(height * scale)
        left, top = (side_w - crop_w) // 2, (side_h - crop_h) // 2
        pic = pic.crop((left, top, left + crop_w, top + crop_h)).resize((width, height), Image.BICUBIC)
        pixels = np.asarray(pic, dtype=np.float32) / 255.0
    image = torch.from_numpy(pixels.copy()).reshape(height, width, -1).permute(2, 0, 1)
    return image[:1] if channels == 1 else image.repeat(math.ceil(channels / 3), 1, 1)[:channels]


@DEFENSES.register("decoy", "Negative control: the exact gradient of a decoy batch (flat colour, smooth texture or an "
                            "outside photo); "
                            "shares nothing private")
class Decoy(Defense):
    """The clean gradient of :func:`decoy_images` with the true labels."""

    name = "decoy"
    buffer_effect = "transformed"  # the buffers record the decoy batch

    def __init__(self, kind: str = "flat", level: float = 0.25):
        self.kind = check_choice(self.name, "kind", kind, KINDS)
        self.level = check_range(self.name, "level", level, 0, 1)

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        return [g.detach() for g in clean_gradients(model, self.buffer_inputs(inputs), labels, loss_fn,
                                                    create_graph=False)]

    def buffer_inputs(self, inputs: Tensor, generator=None) -> Tensor:
        """A client that shares its state uploads the decoy batch's BatchNorm statistics too."""
        return decoy_images(self.kind, tuple(inputs.shape), self.level, inputs.device, inputs.dtype)
