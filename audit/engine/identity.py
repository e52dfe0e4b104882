"""What identifies an audit's results: per-task seeds, the defense (with a source hash for
user code), the model, and the software versions."""
from __future__ import annotations

import hashlib
import inspect
import platform
from pathlib import Path
from typing import Any, Dict

import torch

from audit.core import __version__


def derive_seed(seed: int, *parts: Any) -> int:
    """A stable per-task seed (same run settings -> same numbers, independent of order)."""
    blob = repr((int(seed),) + parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------- identities
def _callable_identity(fn: Any) -> Dict[str, Any]:
    """What makes a user callable's results distinct: its qualified name and source hash."""
    target = getattr(fn, "fn", fn)
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        target = type(target)  # a callable object: its class holds the code
    ident = {"callable": f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}"}
    try:
        ident["source_sha256"] = hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]
    except (OSError, TypeError):
        pass
    return ident


def defense_identity(defense, spec: Any) -> Dict[str, Any]:
    """Name, parameters and (for user code) the source hash of the audited defense."""
    ident: Dict[str, Any] = {"name": getattr(defense, "name", "defense"),
                             "spec": spec if isinstance(spec, str) else type(spec).__name__}
    try:
        ident["params"] = {k: repr(v) if not isinstance(v, (int, float, str, bool, type(None))) else v
                           for k, v in defense.params().items()}
    except Exception as err:  # a user's Defense subclass with a broken params()
        ident["params"] = {"unavailable": f"{type(err).__name__}: {err}"}
    if not isinstance(spec, str) or ":" in spec:
        ident.update(_callable_identity(defense))
    ident["stochastic"] = bool(getattr(defense, "stochastic", False))
    return ident


def tensor_digest(*tensors: torch.Tensor) -> str:
    """sha256 (16 hex digits) of the tensors' shapes, dtypes and values."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()[:16]


def data_identity(dataset, data_args: Dict[str, Any], image_size: int) -> Dict[str, Any]:
    """What identifies the data: name, shape, size, the loader's arguments (a path made
    absolute; grid, limit, ...) and a digest of the images and labels themselves, so other
    private images never reuse stored results."""
    args = {k: str(Path(v).expanduser().resolve()) if k == "path" and v is not None else v
            for k, v in (data_args or {}).items()}
    return {"name": dataset.name, "input_shape": list(dataset.input_shape), "image_size": int(image_size),
            "args": args, "content_sha256": tensor_digest(dataset.train_images, dataset.train_labels,
                                                          dataset.test_images, dataset.test_labels)}


def model_identity(model: Any, model_args: Dict[str, Any]) -> Dict[str, Any]:
    if isinstance(model, str):
        return {"name": model, "args": model_args}
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().to(torch.float64 if tensor.is_floating_point() else torch.int64)
                      .contiguous().numpy().tobytes())
    return {"name": type(model).__name__, "architecture_sha256": hashlib.sha256(repr(model).encode()).hexdigest()[:16],
            "state_sha256": digest.hexdigest()[:16]}


def versions() -> Dict[str, str]:
    import numpy

    return {"gia_audit": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "platform": platform.platform()}

