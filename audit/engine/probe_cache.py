"""The planner's probe of a defense, kept beside the audit's results so a resumed audit does
not probe again: probing calls the defense many times at several FL rounds, which costs
minutes for a defense that is slow itself (Soteria's per-feature Jacobian on a wide model).

The probe is kept under ``OUT/probes/<key>.json``. Its key is every setting of the run key
except the budget (the probe never attacks), the audited steps (the rounds it probes) and a
hash of the planner's code, so a changed defense, model, data, seed or planner probes again.
What is kept are the measured traits, not the plan: the attacks are planned from them anew,
so an attack registered since is planned. A file that cannot be read back is a miss.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

from adaptive import DefenseTraits
from audit.core.files import atomic_write_bytes
from audit.report.store import settings_key

PLANNER_CODE = Path(__file__).resolve().parents[2] / "adaptive" / "planner"
FOLDER = "probes"


def planner_code_sha() -> str:
    """sha256 of the planner's modules (its probe, traits and rules)."""
    digest = hashlib.sha256()
    for path in sorted(PLANNER_CODE.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def probe_key(key_settings: Dict[str, Any], steps: Sequence[int]) -> str:
    """The key of a probe: the run's settings without its budget, the probed rounds, the planner's code."""
    settings = {k: v for k, v in key_settings.items() if k != "budget"}
    return settings_key({"settings": settings, "rounds": [int(s) for s in steps], "planner": planner_code_sha()}, 16)


def probe_path(out: Path, key: str) -> Path:
    return Path(out) / FOLDER / f"{key}.json"


def _encode(traits: DefenseTraits) -> Optional[bytes]:
    """The traits as JSON (non-finite floats kept as JSON's NaN / Infinity), or None when they
    do not read back as the same traits (a value JSON cannot hold)."""
    try:
        blob = json.dumps(traits.to_dict(), allow_nan=True).encode()
        back = DefenseTraits.from_dict(json.loads(blob))
    except (TypeError, ValueError, KeyError):
        return None
    return blob if _plain(back.to_dict()) == _plain(traits.to_dict()) else None


def _plain(value: Any) -> Any:
    """``value`` with NaN made comparable (NaN != NaN) and tuples as lists, for the read-back check."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def load(path: Path) -> Optional[DefenseTraits]:
    """The traits kept in ``path``; None when there are none or they cannot be read."""
    try:
        return DefenseTraits.from_dict(json.loads(path.read_bytes()))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def cached_probe(out: Path, key_settings: Dict[str, Any], steps: Sequence[int],
                 probe: Callable[[], DefenseTraits]) -> DefenseTraits:
    """The traits kept for these settings, else ``probe()``'s, kept for the next run (when the
    disk takes them: a probe that cannot be kept is probed again next time, never lost)."""
    path = probe_path(out, probe_key(key_settings, steps))
    kept = load(path)
    if kept is not None:
        return kept
    traits = probe()
    blob = _encode(traits)
    if blob is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, blob)
        except OSError:
            pass
    return traits
