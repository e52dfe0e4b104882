"""The audit's configuration: one frozen, typed record from the command line or a TOML file
to the engine and back into the report.

Each field (:mod:`audit.engine.fields`) holds its default and its help once; the command-line
options (``cli.py``), ``audit.run``'s keywords, the TOML file and the report's ``config``
record are all made from these fields. A config is checked when it is
built (the engine's settings sections are built then, :mod:`audit.engine.settings`), and
every error is one line naming the field.
"""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from audit.core.errors import ConfigError
from audit.engine.fields import (FIELD_NAMES, SECTIONS, AuditFields, config_fields, default_of,  # noqa: F401
                                 field_help, thresholds_text)
from audit.engine.settings import Sections, sections_of
from audit.report.rule import LeakRule


@dataclass(frozen=True)
class AuditConfig(AuditFields):
    """Everything an audit's numbers depend on, and where it writes them (the fields:
    :class:`~audit.engine.fields.AuditFields`). Build it with keywords
    (``AuditConfig(defense="gaussian", images=4)``), from a TOML file (:func:`load_config`) or
    from the command line; :func:`audit.run` takes it whole."""

    def __post_init__(self):
        for f in fields(self):
            try:
                object.__setattr__(self, f.name, _canonical(f.name, getattr(self, f.name)))
            except ConfigError as err:  # one line that names the field
                text = str(err)
                raise ConfigError(text if f.name in text else f"{f.name}: {text}") from None
        sections_of(self)  # every check of every section, now

    # ------------------------------------------------------------------ views
    def replace(self, **changes: Any) -> "AuditConfig":
        """This config with ``changes`` (checked names, checked values)."""
        check_names(changes, "setting")
        return replace(self, **changes)

    def sections(self) -> Sections:
        """The engine's settings sections (:func:`audit.engine.settings.sections_of`)."""
        return sections_of(self)

    def undefended(self) -> "AuditConfig":
        """The positive control's config: this one without the defense and its utility."""
        return replace(self, defense="none", defense_args=None, utility=False)

    def values(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def record(self) -> Dict[str, Any]:
        """The config as one JSON-able record: what the TOML file holds, plus ``replayable``
        (false, with the reason, when a value is a Python object no file can hold)."""
        plain, why = {}, []
        for name, value in self.values().items():
            try:
                if value is not None:
                    plain[name] = _plain(value)
            except TypeError as err:
                why.append(f"{name} is {err}")
                plain[name] = _label(value)
        return {"values": plain, "replayable": not why, "why_not": "; ".join(why)}

    def toml(self) -> str:
        """The config as a TOML file (the fields that are set, section by section); a value no
        file can hold is a ConfigError naming the field."""
        lines: List[str] = ["# gia-audit audit configuration: gia-audit audit --config THIS_FILE"]
        values = self.values()
        for section in SECTIONS:
            names = [f.name for f in fields(self) if f.metadata["section"] == section and values[f.name] is not None]
            if names:
                lines += ["", f"# {section}"]
            for name in names:
                try:
                    lines.append(f"{name} = {_toml_value(_plain(values[name]))}")
                except TypeError as err:
                    raise ConfigError(f"{name} is {err}: no file can hold it; give it as text "
                                      "(a name or package.module:attr)") from None
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- building
def nearest(name: str, valid: Iterable[str]) -> str:
    """``"; did you mean 'images'?"`` for the valid name nearest ``name`` (difflib), or ``""``."""
    close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_names(values: Mapping[str, Any], what: str = "setting", where: str = "",
                valid: Sequence[str] = FIELD_NAMES) -> None:
    """A name of ``values`` that is not a config field: a one-line ConfigError naming it and the
    nearest valid one."""
    for name in values:
        if name not in valid:
            raise ConfigError(f"unknown {what} {name!r}{where}{nearest(name, valid)} (valid: {', '.join(valid)})")


def make_config(base: Optional[AuditConfig] = None, **values: Any) -> AuditConfig:
    """``base`` (default: the defaults) with ``values``, names checked first."""
    return config_of(values, base)


def config_of(values: Mapping[str, Any], base: Optional[AuditConfig] = None) -> AuditConfig:
    """The config of a mapping of field values (a file's, a command line's) over ``base``
    (default: the defaults), names checked first."""
    check_names(values)
    if base is None:
        return AuditConfig(**values)
    return replace(base, **values) if values else base


def config_of_call(config: Any = None, /, **fields: Any) -> AuditConfig:
    """The config of ``audit.run(config, **fields)``: ``config`` is an :class:`AuditConfig` whose
    values ``fields`` change, or the defense itself (short for ``defense=``)."""
    if config is not None and not isinstance(config, AuditConfig):
        if "defense" in fields:
            raise ConfigError("the defense is given twice (as the first argument and as defense=); give it once")
        config, fields = None, {**fields, "defense": config}
    return make_config(config, **fields)


def audit_settings(**fields: Any) -> Dict[str, Any]:
    """The engine's settings sections of config ``fields`` (a sweep's, a bench's) as keywords of
    :class:`~audit.engine.audit.Audit` besides the defense; names checked."""
    return make_config(**fields).sections().as_kwargs()


def config_of_sections(sections: Sections, defense: Any = "none",
                       defense_args: Optional[Mapping[str, Any]] = None) -> AuditConfig:
    """The config of ``defense`` whose settings sections are ``sections`` (the inverse of
    :func:`~audit.engine.settings.sections_of`): an audit built from sections, as a config."""
    m, d, fl, a, o = (sections.model, sections.data_settings, sections.fl_settings, sections.attack_settings,
                      sections.output_settings)
    model = dict(model=m.model, model_args=m.args or None, model_normalize=m.normalize, checkpoint=m.checkpoint)
    data = dict(data=d.data, data_args=d.data_args or None, image_size=d.image_size, images=d.images,
                batch_size=d.batch_size, share_labels=d.share_labels)
    training = dict(client_mode=fl.client_mode, lr=fl.lr, train_batch_size=fl.batch_size, clients=fl.clients,
                    local_steps=fl.local_steps, local_lr=fl.local_lr, local_optimizer=fl.local_optimizer,
                    local_batch_size=fl.local_batch_size, local_epochs=fl.local_epochs, shares=fl.shares,
                    server_optimizer=fl.server_optimizer)
    attacks = dict(steps=a.steps, attacks=a.names, attack_args=a.args or None, budget=a.budget,
                   max_budget=a.max_budget, max_minutes=a.max_minutes)
    output = dict(thresholds=o.thresholds, delta=o.delta, utility=o.utility, utility_steps=o.utility_steps,
                  utility_seeds=o.utility_seeds, defense_timeout=o.defense_timeout, out=o.out, progress=o.progress,
                  retry_errors=o.retry_errors)
    return AuditConfig(defense=defense, defense_args=defense_args or None, seed=sections.seed, device=sections.device,
                       **model, **data, **training, **attacks, **output)


def load_config(path: Any) -> Dict[str, Any]:
    """The settings of a TOML file (read with :mod:`tomllib`, or ``tomli`` before Python 3.11),
    ``name = value`` per field as :meth:`AuditConfig.toml` writes them; an unknown name is a
    one-line error naming it and the nearest valid one."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the same parser, as the tomli package
        import tomli as tomllib
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror or err}") from None
    check_names(data, "setting", f" in {path}")
    return data


# --------------------------------------------------------------------------- canonical values
def _comma(value: Any) -> Any:
    return [s for s in value.replace(" ", "").split(",") if s] if isinstance(value, str) else value


def _frozen(value: Any) -> Any:
    """Lists as tuples, all the way down (a file's arrays equal the command line's tuples)."""
    if isinstance(value, Mapping):
        return {str(k): _frozen(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _number(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{name} must be a {'whole number' if kind is int else 'number'}, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{name} must be a {'whole number' if kind is int else 'number'}, got {value!r}") from None
    if kind is int:
        if not number.is_integer():
            raise ConfigError(f"{name} must be a whole number, got {value!r}")
        return int(number)
    return number


def _canonical(name: str, value: Any) -> Any:
    """One spelling per value, so equal settings give equal configs (and run keys) whichever
    face they came from; type errors name the field."""
    meta = next(f.metadata for f in fields(AuditConfig) if f.name == name)
    if value is None:
        return None
    kind = meta["kind"]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value
    if kind in (int, float):
        return _number(name, value, kind)
    if name in ("defense_args", "model_args", "data_args", "attack_args"):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name} must be a mapping of names to values, got {type(value).__name__}")
        return _frozen(value) or None
    if name == "steps":
        try:
            return tuple(sorted({int(s) for s in _comma(value)}))
        except (TypeError, ValueError):
            raise ConfigError(f"steps must be training steps like 0,1,5,20, got {value!r}") from None
    if name == "attacks":
        return tuple(dict.fromkeys(str(a) for a in _comma(value)))
    if name == "budget":
        if isinstance(value, str) and not value.strip().isdigit():
            return value.strip().lower()
        return _number(name, value, int)
    if name in ("local_optimizer", "server_optimizer"):
        return _optimizer_text(name, value)
    if name == "thresholds":
        return thresholds_text(LeakRule.of(value))
    if name == "model_normalize":
        from audit.core.model_source import parse_normalize

        norm = parse_normalize(value)
        return norm if isinstance(norm, str) else "/".join(",".join(repr(v) for v in part) for part in norm)
    if name in ("out", "checkpoint", "data_path"):
        return str(Path(value).expanduser()) if isinstance(value, (str, Path)) else value
    if name == "device":
        return str(value)
    return value


def _optimizer_text(name: str, value: Any) -> str:
    """An optimiser as its text, ``sgd:momentum=0.9,weight_decay=0.0005`` (the settings that
    differ from ``torch.optim``'s defaults)."""
    from audit.core.local_training import LocalOptimizer

    try:
        opt = LocalOptimizer.parse(value)
    except ConfigError as err:
        raise ConfigError(f"{name}: {err}") from None
    default = LocalOptimizer(opt.name)
    changed = [f"{f.name}={int(v) if isinstance(v, bool) else v!r}" for f in fields(opt) if f.name != "name"
               for v in [getattr(opt, f.name)] if v != getattr(default, f.name)]
    return opt.name + (":" + ",".join(changed) if changed else "")


# --------------------------------------------------------------------------- plain values and TOML
def _label(value: Any) -> str:
    return getattr(value, "name", None) or getattr(value, "__name__", None) or type(value).__name__


def _plain(value: Any) -> Any:
    """A value as TOML and JSON hold it (tuples as lists); TypeError for a Python object."""
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            raise TypeError("NaN")
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if v is None:
                raise TypeError(f"None at {k!r} (write the value out)")
            out[str(k)] = _plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise TypeError(f"a Python object ({_label(value)})")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }" if value \
            else "{}"
    raise TypeError(type(value).__name__)
