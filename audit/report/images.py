"""PNG helpers of the report: batches of [0, 1] images to PNG bytes and base64 data URIs."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import torch


def batch_to_array(images: torch.Tensor, pad: int = 1) -> np.ndarray:
    """``(B, C, H, W)`` in [0, 1] -> one ``uint8`` strip ``(H, B*(W+pad)-pad[, 3])``."""
    images = images.detach().float().cpu().clamp(0, 1)
    if images.dim() == 3:
        images = images.unsqueeze(0)
    b, c, h, w = images.shape
    if c not in (1, 3):
        images = images[:, :1]
        c = 1
    strip = torch.ones(c, h, b * (w + pad) - pad)
    for i in range(b):
        strip[:, :, i * (w + pad): i * (w + pad) + w] = images[i]
    arr = (strip.permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8)
    return arr[:, :, 0] if c == 1 else arr


def batch_to_png_bytes(images: torch.Tensor, min_height: int = 0) -> bytes:
    """PNG of a strip of images; ``min_height`` > 0 enlarges it by an integer factor
    (nearest neighbour, pixels stay exact) until it is at least that many pixels high."""
    from PIL import Image

    img = Image.fromarray(batch_to_array(images))
    factor = max(1, -(-min_height // img.height)) if min_height > 0 else 1
    if factor > 1:
        img = img.resize((img.width * factor, img.height * factor), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def file_data_uri(path: Path) -> str:
    return data_uri(Path(path).read_bytes())
