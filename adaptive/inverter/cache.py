"""On-disk cache of trained inverters, keyed by what determines the training.

The key hashes the model architecture *and* its parameters/buffers at the audited step, the
defense (name + settings), the observation's declared metadata, the auxiliary data and the
inverter's settings; so one inverter is trained per (architecture, defense, training step,
settings) and reused by the CLI and the audit. Directory: ``$GIA_AUDIT_CACHE`` or
``~/.cache/gia-audit``.
"""
from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor, nn

from audit.core.cache import CACHE_ENV, cache_dir
from audit.core.files import atomic_torch_save
from audit.core.errors import ConfigError

FORMAT_VERSION = 1
_DIGESTS: Dict[int, Tuple[weakref.ref, int, str]] = {}  # id(tensor) -> (ref, version, digest)


def hash_tensors(tensors: Iterable[Tensor], digest=None) -> str:
    """SHA-256 over shapes, dtypes and values (on the CPU, so the device does not matter)."""
    digest = digest or hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def tensor_digest(t: Tensor) -> str:
    """``hash_tensors([t])``, remembered per tensor object until it is freed or changed in
    place (torch's version counter): a large tensor shared by many observations, such as the
    audit's declared auxiliary data, is hashed once."""
    key = id(t)
    entry = _DIGESTS.get(key)
    if entry is not None and entry[0]() is t and entry[1] == t._version:
        return entry[2]
    value = hash_tensors([t])

    def forget(ref, key=key):
        if _DIGESTS.get(key, (None,))[0] is ref:
            del _DIGESTS[key]

    _DIGESTS[key] = (weakref.ref(t, forget), t._version, value)
    return value


def model_fingerprint(model: nn.Module) -> Dict[str, str]:
    """``{"architecture": hash of the module tree, "state": hash of parameters and buffers}``."""
    arch = hashlib.sha256(repr(model).encode()).hexdigest()
    state = hash_tensors(t for _, t in sorted(model.state_dict().items()))
    return {"architecture": arch, "state": state}


def defense_fingerprint(defense: Any) -> str:
    """A stable description of the defense: its name and settings (``none`` without one)."""
    if defense is None:
        return "none"
    params = defense.params() if hasattr(defense, "params") else {}
    return f"{getattr(defense, 'name', type(defense).__name__)}:{_stable_json(params)}"


def cache_key(parts: Dict[str, Any]) -> str:
    """The hex key of a dict of JSON-able parts."""
    payload = _stable_json({"format": FORMAT_VERSION, **parts})
    return hashlib.sha256(payload.encode()).hexdigest()[:40]


def _stable_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=repr)


def cache_path(key: str, root: Optional[str | os.PathLike] = None) -> Path:
    """Where the entry ``key`` lives: ``learned-inverter/<key>.pt`` under the cache (or ``root``)."""
    return cache_dir("learned-inverter", f"{key}.pt", root=root)


def load_entry(path: Path) -> Optional[Dict[str, Any]]:
    """A cached entry, or ``None`` when there is none (or it is unreadable / another format)."""
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a truncated or foreign file is a cache miss, it gets rewritten
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT_VERSION:
        return None
    return entry


def save_entry(path: Path, entry: Dict[str, Any]) -> None:
    """Write atomically (temp file + rename) so concurrent runs never read half a file."""
    try:
        atomic_torch_save({"format": FORMAT_VERSION, **entry}, path)
    except OSError as err:
        raise ConfigError(
            f"cannot write the learned-inverter cache at {path} ({err}); "
            f"set {CACHE_ENV} to a writable directory"
        ) from None
