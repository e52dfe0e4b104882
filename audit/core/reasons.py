"""Why an attack does not apply, or what it did with a piece of side information: a code and
the numbers and names it needs, never a sentence. Attacks and the engine store these records;
the report words them (:mod:`audit.report.reasons`: one template per code).

A sentence from elsewhere (an older stored result, a third-party attack that passes a string)
becomes the record of code :data:`TEXT`, which the report writes back as it was.
"""
from __future__ import annotations

from typing import Any, Dict

#: the code of a reason given as a sentence (its ``text``), worded as it was written
TEXT = "text"


class Reason:
    """``code`` (a key of the report's templates) and ``params`` (JSON values: numbers, names,
    lists of them). Immutable; equal when code and params are; JSON ``{"code", "params"}``."""

    __slots__ = ("code", "params")

    def __init__(self, code: str, /, **params: Any):
        object.__setattr__(self, "code", str(code))
        object.__setattr__(self, "params", dict(params))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Reason is immutable")

    @classmethod
    def of(cls, value: Any) -> "Reason":
        """``value`` as a reason: a :class:`Reason` as it is, its JSON object, or a sentence
        (code :data:`TEXT`)."""
        if isinstance(value, Reason):
            return value
        if isinstance(value, dict) and "code" in value:
            return cls(value["code"], **dict(value.get("params") or {}))
        return cls(TEXT, text=str(value or ""))

    from_dict = of

    def to_dict(self) -> Dict[str, Any]:
        return {"code": self.code, "params": dict(self.params)}

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Reason) and (self.code, self.params) == (other.code, other.params)

    def __hash__(self) -> int:
        return hash((self.code, repr(sorted(self.params.items()))))

    def __str__(self) -> str:  # for a message outside the report (an exception's): the code and its values
        if self.code == TEXT:
            return str(self.params.get("text", ""))
        values = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.code} ({values})" if values else self.code

    def __repr__(self) -> str:
        return f"Reason({self.code!r}{''.join(f', {k}={v!r}' for k, v in self.params.items())})"

    def __reduce__(self):  # pickles (a Ray task's result) through its JSON object
        return (Reason.of, (self.to_dict(),))


def path_failed(path: str, err: BaseException, limit: int = 200) -> Dict[str, Any]:
    """The JSON object of the reason that ``path`` (a way of running: "vmap", "stacked call")
    failed with ``err``: its type and the start of its message."""
    return Reason("path-failed", path=path, error=f"{type(err).__name__}: {str(err)[:limit]}").to_dict()
