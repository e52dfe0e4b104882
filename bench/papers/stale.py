"""When a stored cell of the papers bench no longer runs what the tool runs now.

Three ways: an attack's defaults changed since the cell ran (its settings' fingerprint,
:func:`attacks.presets.settings_fingerprint`); the cell is a planner cell (its call's attacks
hold ``auto``) and the planner now plans other attacks for the same call (a new rule, a new
trait); or the engine's run key for the cell's call changed (the defense's or model's code, a
setting: :func:`stale_key`, where the cell recorded the key it ran under). The planner's plan
for a call is kept in the bench's store beside the cells (:class:`PlanCache`), with the planner's
source, so the page renders without probing every defense again, and a changed planner is
probed anew.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.docs_table import ROOT
from bench.jsonl import FILE, Lines

#: the planner's source: a change here may change a plan, so every kept plan is checked again
PLANNER_SOURCE = ROOT / "adaptive" / "planner"


def cell_fingerprints(call: Dict[str, Any], attacks: Sequence[str]) -> Dict[str, str]:
    """What each attack of a cell ran: its settings in the call over its defaults, stored with
    the cell."""
    import adaptive  # noqa: F401  (registers the adaptive attacks in ATTACKS)
    from attacks import ATTACKS
    from attacks.presets import settings_fingerprint

    args = call.get("attack_args") or {}
    return {a: settings_fingerprint(a, args.get(a)) for a in attacks if a in ATTACKS}


def stale_attacks(cell: Dict[str, Any]) -> List[str]:
    """The attacks of a stored cell whose defaults changed since it ran (a planner's ``ig`` at
    its preset, say): the bench reruns the cell and the page says so meanwhile."""
    recorded = cell.get("fingerprints") or {}
    current = cell_fingerprints(cell.get("call") or {}, list(recorded))
    return sorted(a for a, fp in recorded.items() if current.get(a) != fp)


def planner_source() -> str:
    """A hash of the planner's code (every ``.py`` under :data:`PLANNER_SOURCE`)."""
    digest = hashlib.sha256()
    for path in sorted(PLANNER_SOURCE.rglob("*.py")):
        digest.update(path.relative_to(PLANNER_SOURCE).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def audit_of(call: Dict[str, Any], **overrides: Any) -> Any:
    """The engine's :class:`~audit.engine.audit.Audit` of a stored cell's ``audit.run`` call."""
    from audit.engine.audit import Audit, audit_settings

    settings = {**call, **overrides}
    defense, defense_args = settings.pop("defense"), settings.pop("defense_args", None)
    return Audit(defense, defense_args=defense_args, **audit_settings(**settings))


def run_key(call: Dict[str, Any]) -> Optional[str]:
    """The engine's run key for ``call`` today: the folder its results go to, which changes with
    any input that changes a number (the defense's or model's code, a setting). Results kept
    under another key are redone, never reused. None where the call cannot be built here (a
    CUDA call on a machine without one)."""
    from audit.core.errors import GiaError
    from audit.report.store import settings_key

    try:
        with tempfile.TemporaryDirectory() as out:
            return settings_key(audit_of(call, out=out).key_settings())
    except GiaError:
        return None


#: :func:`stale_key`'s change: the engine's run key for the cell's call is not the one it ran under
KEY_CHANGED = "=engine key"
_KEYS: Dict[str, Optional[str]] = {}


def stale_key(cell: Dict[str, Any]) -> List[str]:
    """``[KEY_CHANGED]`` where a stored cell recorded the engine's run key it ran under and the
    key for its call today differs ([] where equal, unrecorded or not computable here: a CUDA
    call on a machine without one). Each call's key is worked out once per process (it builds
    the audit: a fraction of a second after the first)."""
    recorded = cell.get("run_key")
    if not recorded:
        return []
    call = cell.get("call") or {}
    where = PlanCache.key(call)
    if where not in _KEYS:
        _KEYS[where] = run_key(call)
    now = _KEYS[where]
    return [KEY_CHANGED] if now is not None and now != recorded else []


def planned_now(call: Dict[str, Any]) -> List[str]:
    """The attacks an audit of ``call`` runs today: the base attacks and the planner's picks
    (probes the call's defense on its model; runs no attack)."""
    with tempfile.TemporaryDirectory() as out:  # the plan depends on the defense and model, not the device
        specs, _ = audit_of(call, out=out, device="cpu").planned()
    return [s.id for s in specs]


class PlanCache:
    """The planner's plan per call for the cells in ``folder`` (``<root>/<profile>-<data>``): a line
    per call in the store at ``<root>``, keyed ``<profile>-<data>/plans/<call key>``."""

    def __init__(self, folder: Path):
        folder = Path(folder)
        self.lines, self.prefix = Lines(folder.parent / FILE), f"{folder.name}/plans/"
        self.plans: Dict[str, Any] = {k[len(self.prefix):]: v for k, v in self.lines.items()
                                      if isinstance(k, str) and k.startswith(self.prefix)}

    @staticmethod
    def key(call: Dict[str, Any]) -> str:
        where = {k: v for k, v in call.items() if k != "out"}  # the store's path is not a setting
        return hashlib.sha256(json.dumps(where, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def plan(self, call: Dict[str, Any]) -> List[str]:
        key, source = self.key(call), planner_source()
        kept = self.plans.get(key) or {}
        if kept.get("source") == source:
            return list(kept["attacks"])
        attacks = planned_now(call)
        self.plans[key] = {"source": source, "attacks": attacks}
        self.lines.put(self.prefix + key, self.plans[key], sort_keys=True)
        return attacks


def stale_plan(cell: Dict[str, Any], cache: PlanCache) -> List[str]:
    """How the planner's plan for a stored planner cell's call differs from what the cell ran:
    ``+name`` planned now and not run, ``-name`` run and no longer planned ([] where equal,
    where the cell names no planner call, or where it did not record what it ran)."""
    call = cell.get("call") or {}
    ran = cell.get("attacks") or []
    if "auto" not in (call.get("attacks") or []) or not ran or "auto" in ran:
        return []
    now = cache.plan(call)
    return [f"+{a}" for a in now if a not in ran] + [f"-{a}" for a in ran if a not in now]
