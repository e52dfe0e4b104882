"""Atomic file writes: a temporary file in the same folder, then a rename, so a reader (a
resumed audit, a concurrent test worker) never sees half a file."""
from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def atomic_torch_save(obj: Any, path: Path) -> Path:
    """``torch.save`` that never leaves a truncated file behind."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)
