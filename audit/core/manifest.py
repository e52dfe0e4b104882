"""The manifest of an audit run, as a typed record.

The engine writes it (``runs/<key>/manifest.json``) in parts before and while it attacks: its
settings, the plan, the threat model, the null's evidence, the risk ball, the data, the seeds,
then the utility, the positive control and the run's status. The report is rendered from it and
the stored results. Every field is optional, as a run stopped early has only some of them; the
JSON is the flat object of the fields that are set (keys this record does not know are kept in
``extra`` and written back as they were), and the record reads as a mapping of that object.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple


def plain(value: Any) -> Any:
    """``value`` with every record in it (anything with ``to_dict``) as its JSON object."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class FlatRecord:
    """``to_dict`` / ``from_dict`` for a frozen dataclass whose JSON is the flat object of its
    fields, then the keys it does not know, kept in its ``extra`` field and written back as they
    were. A field is written when set, or always when ``keeps_none`` unless it is ``optional``;
    a record in a field is written as its JSON object (``_json(name)``: a field's JSON value)."""

    keeps_none = False
    #: with ``keeps_none``, the fields still written only when set
    optional: Tuple[str, ...] = ()

    @classmethod
    def _names(cls) -> tuple:
        return tuple(f.name for f in fields(cls) if f.name != "extra")  # type: ignore[arg-type]

    def _written(self, name: str) -> bool:
        return getattr(self, name) is not None or (self.keeps_none and name not in self.optional)

    def _json(self, name: str) -> Any:
        return plain(getattr(self, name))

    def to_dict(self) -> Dict[str, Any]:
        """The JSON object: the fields, then the keys kept in ``extra``."""
        out = {n: self._json(n) for n in self._names() if self._written(n)}
        out.update(plain(self.extra))  # type: ignore[attr-defined]
        return out

    @classmethod
    def from_dict(cls, data: Any):
        """The record of its JSON object (None or {}: the empty record; a record: itself)."""
        if isinstance(data, cls):
            return data
        data = dict(data or {})
        known = {k: data.pop(k) for k in cls._names() if k in data}  # a null reads as the field's default
        return cls(**{k: v for k, v in known.items() if v is not None}, extra=data)  # type: ignore[call-arg]


class MappingRecord(FlatRecord, Mapping):
    """A :class:`FlatRecord` that also reads as a mapping of its JSON object's keys (a field's
    value as the record holds it), so code that reads a stored JSON object reads the record."""

    def __getitem__(self, key: str) -> Any:
        if key in self._names():
            if not self._written(key):
                raise KeyError(key)
            return getattr(self, key)
        return self.extra[key]  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[str]:
        yield from (n for n in self._names() if self._written(n))
        yield from self.extra  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return sum(1 for _ in self)


@dataclass(frozen=True, eq=False)  # equal as mappings: the same JSON object
class Manifest(MappingRecord):
    """One audit run's manifest (every field None until the engine writes it).

    ``run_key``: the run's key; ``status``: "running", "complete", "interrupted", "stopped (...)",
    ...; ``step_name``: what a step is called (a Flower round audit's "round"); ``settings``:
    every setting of the run; ``steps``, ``images``: what is audited; ``attacks``: the planned
    attacks' specs; ``plan``: the planner's findings; ``defense``: its identity; ``differences``:
    where it departs from its paper; ``privacy``: its (epsilon, delta) per step; ``threat_model``:
    what the attacker was given; ``thresholds``: the leak rule; ``null``: the null's evidence per
    private image; ``risk_delta``: the risk ball; ``data``, ``seeds``, ``versions``; ``failures``:
    what went wrong outside the results; ``metric_notes``; ``config``: the configuration record;
    ``utility`` with ``utility_for`` (what it was measured for); ``control``: where the positive
    control's results are; ``timing``.
    """

    run_key: Optional[str] = None
    status: Optional[str] = None
    step_name: Optional[str] = None
    settings: Optional[Dict[str, Any]] = None
    steps: Optional[List[int]] = None
    images: Optional[int] = None
    attacks: Optional[List[Dict[str, Any]]] = None
    plan: Optional[Dict[str, Any]] = None
    defense: Optional[Dict[str, Any]] = None
    differences: Optional[List[str]] = None
    privacy: Optional[Dict[str, Any]] = None
    threat_model: Optional[Dict[str, Any]] = None
    thresholds: Optional[Dict[str, Any]] = None
    null: Optional[Dict[str, Any]] = None
    risk_delta: Optional[Dict[str, Any]] = None
    data: Optional[Dict[str, Any]] = None
    seeds: Optional[Dict[str, Any]] = None
    versions: Optional[Dict[str, Any]] = None
    failures: Optional[List[Dict[str, Any]]] = None
    metric_notes: Optional[List[str]] = None
    config: Optional[Dict[str, Any]] = None
    utility: Optional[Dict[str, Any]] = None
    utility_for: Optional[List[Any]] = None
    control: Optional[Dict[str, Any]] = None
    timing: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def updated(self, **changes: Any) -> "Manifest":
        """This manifest with ``changes`` merged in (as a write of those keys merges them)."""
        return Manifest.from_dict({**self.to_dict(), **changes})

    @property
    def planned(self) -> bool:
        """True once the attacks were planned (the run got past its preparation)."""
        return self.attacks is not None
