"""Plain JSON values from the toolkit's records: the one converter every stored file goes through.

JSON has no infinity or NaN, so :func:`to_jsonable` writes a non-finite float as the string
``"inf"``, ``"-inf"`` or ``"nan"`` (the file stays strict JSON), and :func:`from_jsonable` reads
those strings back as the same floats: an exact reconstruction's infinite PSNR, an unbounded
epsilon or a certificate that could not be computed round-trip, where ``None`` would read as a
missing value.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from audit.core.reasons import Reason


#: the strings that stand for the non-finite floats
NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _float(x: float) -> Any:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def to_jsonable(obj: Any) -> Any:
    """Records (``to_dict``), dataclasses, tensors, numpy values, tuples, sets and paths as plain
    JSON values; a non-finite float as its string; anything else as its ``repr``."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if (dataclasses.is_dataclass(obj) or isinstance(obj, Reason)) and not isinstance(obj, type):
        return to_jsonable(obj.to_dict() if hasattr(obj, "to_dict") else dataclasses.asdict(obj))
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return to_jsonable((obj.detach().cpu() if isinstance(obj, torch.Tensor) else obj).tolist())
    if isinstance(obj, float):
        return _float(obj)
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    return repr(obj)


def from_jsonable(obj: Any) -> Any:
    """A JSON value :func:`to_jsonable` wrote, its non-finite floats read back from their strings."""
    if isinstance(obj, dict):
        return {k: from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_jsonable(v) for v in obj]
    if isinstance(obj, str):
        return NON_FINITE.get(obj, obj)
    return obj
