"""Named registries of small components (models, data sets, attacks, defenses, priors).

Every user-facing name is looked up in a :class:`Registry`; an unknown name raises a
:class:`~audit.core.errors.ConfigError` that lists the valid ones.
"""
from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Tuple

from audit.core.errors import ConfigError


@dataclass(frozen=True)
class Entry:
    name: str
    obj: Any
    description: str


class Registry:
    """A mapping ``name -> factory`` with one-line descriptions.

    >>> models = Registry("model")
    >>> @models.register("lenet", "DLG's LeNet")
    ... def lenet(...): ...
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: Dict[str, Entry] = {}

    def register(self, name: str, description: str | None = None) -> Callable[[Any], Any]:
        def deco(obj: Any) -> Any:
            if name in self._entries:
                raise ConfigError(f"{self.kind} {name!r} is registered twice")
            doc = description or (inspect.getdoc(obj) or "").split("\n")[0]
            self._entries[name] = Entry(name, obj, doc)
            return obj

        return deco

    def add(self, name: str, obj: Any, description: str) -> None:
        self.register(name, description)(obj)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> list[Tuple[str, str]]:
        """``(name, one-line description)`` pairs, sorted by name."""
        return [(n, self._entries[n].description) for n in self.names()]

    def get(self, name: str) -> Any:
        try:
            return self._entries[name].obj
        except KeyError:
            close = difflib.get_close_matches(name, self.names(), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown {self.kind} {name!r}.{hint} Valid {self.kind}s: {', '.join(self.names())}"
            ) from None

    def build(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Look ``name`` up and call it; bad keyword arguments name the valid ones."""
        factory = self.get(name)
        try:
            sig = inspect.signature(factory)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and not any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()
        ):
            unknown = [k for k in kwargs if k not in sig.parameters]
            if unknown:
                valid = [p for p in sig.parameters if p not in ("self",)]
                raise ConfigError(
                    f"{self.kind} {name!r} has no parameter {', '.join(map(repr, unknown))}; "
                    f"valid parameters: {', '.join(valid) or '(none)'}"
                )
        return factory(*args, **kwargs)


def parse_kv_args(pairs: list[str] | tuple[str, ...]) -> dict:
    """Parse ``["ratio=0.9", "layerwise=false"]`` into ``{"ratio": 0.9, "layerwise": False}``."""
    out: dict = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"argument {pair!r} is not of the form name=value (e.g. ratio=0.9)")
        key, raw = pair.split("=", 1)
        out[key.strip().replace("-", "_")] = _parse_value(raw.strip())
    return out


def _parse_value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    if "," in raw:
        return tuple(_parse_value(p) for p in raw.split(","))
    return raw


MAX_LISTED = 20  # names an error lists at most


def import_attr(spec: str, kind: str) -> Any:
    """The object a ``"package.module:attr"`` string names (``attr`` may be dotted); a bad
    path is a ConfigError naming the ``kind`` ("defense", "model") and what the module defines."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{kind} {spec!r}: write an import path as 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an import can fail with any error inside the user's module
        raise ConfigError(
            f"{kind} {spec!r}: cannot import module {module_name!r} ({type(err).__name__}: {err}); "
            "check that it is on PYTHONPATH"
        ) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            close = difflib.get_close_matches(part, public, n=1)
            shown = ", ".join(public[:MAX_LISTED]) + (f" (+{len(public) - MAX_LISTED} more)"
                                                       if len(public) > MAX_LISTED else "")
            raise ConfigError(
                f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r};"
                f"{f' did you mean {close[0]!r}?' if close else ''} it defines: {shown or '(nothing public)'}"
            )
        obj = getattr(obj, part)
    return obj
