"""What ``gia-audit weights`` runs: install pretrained weights that metrics need."""
from __future__ import annotations

from typing import List, Optional


def install_lpips_weights(path: Optional[str] = None, source: str = "auto", force: bool = False) -> List[str]:
    """Put LPIPS's ImageNet AlexNet backbone where gia-audit finds it; the lines to print
    (where it went, and the variable to export when that is not the default place)."""
    from audit.core.lpips_weights import ENV_VAR, default_path, install

    out = install(path, source=source, force=force)
    lines = [f"LPIPS AlexNet backbone: {out}"]
    if out != default_path():
        lines.append(f"not the default location: export {ENV_VAR}={out}")
    return lines
