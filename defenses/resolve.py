"""Turning what a user gives (a name, an object, a callable, ``"pkg.mod:attr"``) into a
:class:`~audit.core.types.Defense`, and checking what a defense returns."""
from __future__ import annotations

import inspect
from typing import Any, Dict, Optional


from audit.core.defense_call import call_defense, check_output, defense_name  # noqa: F401 (re-exported)
from audit.core.errors import ConfigError
from audit.core.registry import import_attr
from audit.core.types import Defense, FunctionDefense

from defenses.registry import DEFENSES, build_defense


def _from_object(obj: Any, params: Dict[str, Any], label: str) -> Defense:
    if isinstance(obj, Defense):
        if params:
            raise ConfigError(f"defense {label}: parameters {sorted(params)} cannot be applied to an "
                              "already-built defense object; build it with them instead")
        return obj
    if inspect.isclass(obj) and issubclass(obj, Defense):
        try:
            return obj(**params)
        except TypeError as err:
            raise ConfigError(f"defense {label}: {err}") from None
    if callable(obj):
        if params:
            raise ConfigError(f"defense {label}: a plain function takes no --defense-arg parameters "
                              f"(got {sorted(params)})")
        return FunctionDefense(obj)
    raise ConfigError(f"defense {label} is a {type(obj).__name__}, not a callable "
                      "defense(model, inputs, labels, *, loss_fn, generator)")


def resolve_defense(spec: Any = None, params: Optional[Dict[str, Any]] = None) -> Defense:
    """A registered name, a :class:`Defense`, any defended-gradient callable, or a
    ``"package.module:attr"`` string, as a :class:`Defense` (``None`` means ``"none"``)."""
    params = dict(params or {})
    if spec is None:
        spec = "none"
    if isinstance(spec, str):
        if ":" in spec:
            return _from_object(import_attr(spec, "defense"), params, repr(spec))
        if spec not in DEFENSES:
            DEFENSES.get(spec)  # raises, listing the valid names
        return build_defense(spec, **params)
    return _from_object(spec, params, getattr(spec, "__name__", type(spec).__name__))
