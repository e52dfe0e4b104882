"""An attack's trace: what one reconstruction did, as a typed record.

The fields the engine and the report read are typed (:class:`Trace`); everything else an
attack records (loss histories, its settings, per-attack numbers) lives in ``extra``. The
record is also a mutable mapping over the JSON layout (typed fields and ``extra`` side by
side), so an attack may build its trace as a plain dict, read it with ``trace["key"]`` and
add to it; the stored JSON is that flat layout, and traces stored before the record load
unchanged.

Codes, not sentences: ``side_information_used`` lists the items of side information
(:data:`SIDE_INFORMATION`) the run matched; the report words them. ``side_information``
keeps the attack's own notes for people reading a trace, and nothing decides from them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterator, Mapping, MutableMapping, Optional, Tuple

#: side information an attack may match beyond the shared weights, by code: what it is
SIDE_INFORMATION = {
    "bn-upload": "the private batch's BatchNorm statistics revealed by the uploaded buffers",
    "features": "each image's last-layer features, read off the output layer's gradient",
}


@dataclass(eq=False)
class Trace(MutableMapping):
    """What one reconstruction did.

    ``attack``: the attack's name; ``gradient_evaluations``: what it spent, in the budget's
    unit; ``time_s``: its seconds; ``failed_to_optimise`` with ``failure`` (why, a reason's
    JSON object the report words): the run never decreased its loss; ``status``: a status word the attack sets (``"failed_to_optimise"``);
    ``certificate_error``: for exact attacks, how far the reconstruction is from reproducing the
    upload; ``side_information_used``: codes of :data:`SIDE_INFORMATION` the run matched;
    ``side_information``: the attack's notes on each item; ``extra``: everything else.
    """

    attack: str = ""
    gradient_evaluations: Optional[int] = None
    time_s: Optional[float] = None
    failed_to_optimise: bool = False
    failure: Any = ""
    status: str = ""
    certificate_error: Optional[float] = None
    side_information_used: Tuple[str, ...] = ()
    side_information: Dict[str, str] = field(default_factory=dict)
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.side_information_used = tuple(self.side_information_used or ())
        self.side_information = dict(self.side_information or {})
        self.extra = dict(self.extra or {})

    # ------------------------------------------------------------------ the record
    def to_dict(self) -> Dict[str, Any]:
        """The flat JSON layout: the typed fields that are set, then ``extra``'s keys."""
        out: Dict[str, Any] = {}
        for name in _TYPED:
            if self._has(name):
                value = getattr(self, name)
                out[name] = list(value) if isinstance(value, tuple) else value
        out.update(self.extra)
        return out

    def _has(self, name: str) -> bool:
        """True when typed field ``name`` is part of the layout (set to other than its default;
        the codes go with the notes even when empty: a stored trace without them is an older one)."""
        return getattr(self, name) != _DEFAULTS[name] or (name == "side_information_used" and bool(self.side_information))

    @classmethod
    def from_dict(cls, data: Any) -> "Trace":
        """A trace from its flat layout (a plain dict an attack built, or one stored before this
        record): known keys fill the typed fields, the rest go to ``extra``. A stored trace
        without ``side_information_used`` reads it from its notes, as they were written then
        (an item's note began with "used" when the run matched it)."""
        if isinstance(data, cls):
            return data
        data = dict(data or {})
        typed = {k: data.pop(k) for k in _TYPED if k in data}
        notes = typed.get("side_information")
        if not isinstance(notes, dict):  # not the notes an attack keeps: an attack-specific value
            if "side_information" in typed:
                data["side_information"] = typed.pop("side_information")
            notes = {}
        if "side_information_used" not in typed and notes:
            typed["side_information_used"] = tuple(k for k, v in notes.items() if str(v).startswith("used"))
        return cls(**typed, extra=data)

    @property
    def seconds(self) -> Optional[float]:
        """The run's seconds (``time_s``; attacks that time a stage write ``seconds``)."""
        return self.time_s if self.time_s is not None else self.extra.get("seconds")

    @property
    def stalled(self) -> bool:
        """True when the run says it failed to optimise."""
        return bool(self.failed_to_optimise) or self.status == "failed_to_optimise"

    def uses(self, code: str) -> bool:
        """True when the run matched the side information ``code`` (:data:`SIDE_INFORMATION`)."""
        return code in self.side_information_used

    # ------------------------------------------------------------------ the mapping
    def __getitem__(self, key: str) -> Any:
        if key in _TYPED:
            if not self._has(key):
                raise KeyError(key)
            return getattr(self, key)
        return self.extra[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _TYPED:
            setattr(self, key, _DEFAULTS[key] if value is None and key in _FLAGS else value)
            self.__post_init__()
        else:
            self.extra[key] = value

    def __delitem__(self, key: str) -> None:
        if key in _TYPED:
            if not self._has(key):
                raise KeyError(key)
            setattr(self, key, _DEFAULTS[key])
            self.__post_init__()
        else:
            del self.extra[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Mapping):
            return self.to_dict() == (other.to_dict() if isinstance(other, Trace) else dict(other.items()))
        return NotImplemented

    def __repr__(self) -> str:
        return f"Trace({self.to_dict()!r})"


_TYPED = tuple(f.name for f in fields(Trace) if f.name != "extra")
_DEFAULTS = {k: getattr(Trace(), k) for k in _TYPED}
_FLAGS = ("failed_to_optimise", "failure", "status", "side_information_used", "side_information")


def as_trace(value: Any) -> Trace:
    """``value`` (a :class:`Trace`, a plain dict or None) as a :class:`Trace`."""
    return Trace.from_dict(value)
