"""A sweep's grid: the defenses and their settings, each cell (one defense at one setting)
resolved once and keyed by its behaviour and the sweep's shared settings."""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from audit.core.errors import ConfigError
from audit.engine.compose import resolve_defense
from audit.engine.identity import defense_identity
from audit.report.store import settings_key

UNDEFENDED = "none"


@dataclass(frozen=True)
class Cell:
    """One defense at one setting: ``defense`` as given (a name, ``"pkg.mod:attr"``, a Defense
    class, object or defended-gradient callable) with ``params``; ``family`` is its line on
    the frontier (the defense's name); ``key`` identifies its settings for resuming;
    ``built`` is the defense resolved once and ``ident`` its identity."""

    defense: Any
    params: Tuple[Tuple[str, Any], ...]
    family: str
    key: str = ""
    undefended: bool = False
    built: Any = field(default=None, compare=False, repr=False)
    ident: Optional[Dict[str, Any]] = field(default=None, compare=False, repr=False)

    @property
    def setting(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.params) or "defaults"

    @property
    def name(self) -> str:
        """The cell's folder name: ``prune-ratio=0.9``."""
        return re.sub(r"[^A-Za-z0-9_.=+-]", "_", "-".join([self.family] + [f"{k}={v}" for k, v in self.params]))

    def describe(self) -> Dict[str, Any]:
        return {"name": self.name, "defense": self.family, "params": dict(self.params), "setting": self.setting,
                "undefended": self.undefended, "dir": f"cells/{self.name}"}


def _label(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "__name__", type(spec).__name__)


def _values(label: str, param: str, values: Any) -> List[Any]:
    if not isinstance(param, str) or not param:
        raise ConfigError(f"sweep grid for {label}: a parameter name must be a non-empty string, got {param!r}; "
                          "write name=values, e.g. ratio=0.5,0.9")
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, range, set, frozenset)):
        values = [values]
    values = list(values)
    if not values or any(v == "" for v in values):
        raise ConfigError(f"sweep grid for {label}: {param} has an empty value; give values like {param}=0.5,0.9")
    return values


def grid_entries(grid: Any) -> List[Tuple[Any, Dict[str, List[Any]]]]:
    """A grid as ``[(defense, {param: [values]})]``. Accepted: ``{defense: {param: values}}``, a
    list of defenses and ``(defense, {param: values})`` pairs, or a single defense; a defense
    is a name, ``"pkg.mod:attr"``, a Defense class (its ``__init__`` parameters form the grid),
    or a Defense object / defended-gradient callable (one cell, no parameters)."""
    if isinstance(grid, Mapping):
        items = list(grid.items())
    elif isinstance(grid, (str, bytes)) or callable(grid) or not isinstance(grid, Sequence):
        items = [(grid, {})]
    else:
        items = [tuple(e) if isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[1], Mapping)
                 else (e, {}) for e in grid]
    if not items:
        raise ConfigError("the sweep grid is empty; give at least one defense, e.g. "
                          "--defense prune --grid ratio=0.5,0.9")
    out = []
    for spec, params in items:
        if not isinstance(params, Mapping):
            raise ConfigError(f"sweep grid for {_label(spec)}: parameters must be a mapping name -> values, "
                              f"got {type(params).__name__}")
        out.append((spec, {p: _values(_label(spec), p, v) for p, v in params.items()}))
    return out


def pair_options(options: Sequence[Tuple[str, str]]) -> List[Tuple[str, Dict[str, List[Any]]]]:
    """Command-line ``("--defense", name)`` / ``("--grid", "k=v1,v2")`` options, in the order
    given, as grid entries: each ``--grid`` varies the ``--defense`` before it (several
    ``--grid`` for one defense span their product)."""
    from audit.core.registry import parse_kv_args

    entries: List[Tuple[str, Dict[str, List[Any]]]] = []
    for option, value in options:
        if option == "--defense":
            if not value:
                raise ConfigError("--defense needs a name, e.g. --defense prune (see `gia-audit list defenses`)")
            entries.append((value, {}))
            continue
        if not entries:
            raise ConfigError(f"--grid {value} comes before any --defense; put each --grid after the --defense it varies")
        name, params = entries[-1]
        if "=" not in value or not value.partition("=")[0].strip():
            raise ConfigError(f"--grid {value!r} for {name}: write name=values, e.g. --grid ratio=0.5,0.9")
        for param, values in parse_kv_args([value]).items():
            if param in params:
                raise ConfigError(f"--grid gives {param} twice for {name}; list all its values once, e.g. {param}=0.5,0.9")
            params[param] = _values(name, param, values if isinstance(values, tuple) else [values])
    return entries


def grid_cells(grid: Any, common_key: Dict[str, Any], timeout: Optional[float] = None) -> List[Cell]:
    """Every cell of the grid (the undefended cell first), each defense resolved once (a bad
    name, parameter or range is a one-line ConfigError before any work) and kept on its cell."""
    cells: Dict[str, Cell] = {}
    entries = [(UNDEFENDED, {})] + grid_entries(grid)
    for spec, params in entries:
        for combo in itertools.product(*params.values()):
            kv = dict(zip(params, combo))
            try:
                defense = resolve_defense(spec, kv)
            except ConfigError as err:
                setting = " ".join(f"{k}={v}" for k, v in kv.items())
                raise ConfigError(f"sweep grid, {_label(spec)} {setting}: {err}".replace(" : ", ": ")) from None
            ident = defense_identity(defense, spec, timeout=timeout)
            cell = Cell(spec, tuple(kv.items()), defense.name, settings_key({"defense": ident, **common_key}),
                        undefended=defense.name == UNDEFENDED and not kv, built=defense, ident=ident)
            other = cells.setdefault(cell.name, cell)
            if other.key != cell.key:
                raise ConfigError(f"two different sweep cells are both named {cell.name!r}; give each defense "
                                  "its own name (a Defense subclass with a distinct `name`)")
    return list(cells.values())
