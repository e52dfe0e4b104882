"""The on-disk cache of trained artefacts (generators, learned inverters, Refiner's evaluator).

One directory for all of them: ``$GIA_AUDIT_CACHE``, else ``~/.cache/gia-audit``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

CACHE_ENV = "GIA_AUDIT_CACHE"


def cache_dir(*parts: Union[str, os.PathLike], root: Optional[Union[str, os.PathLike]] = None) -> Path:
    """``root`` (else ``$GIA_AUDIT_CACHE``, else ``~/.cache/gia-audit``) joined with ``parts``."""
    if root is None:
        env = os.environ.get(CACHE_ENV)
        root = env if env else Path.home() / ".cache" / "gia-audit"
    return Path(root).joinpath(*parts)
