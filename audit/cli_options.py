"""The command line's options, each made from a field: a setting of the audit's config
(:mod:`audit.engine.fields`) or a command's own (:mod:`audit.engine.command_fields`). Its
flag, type, help and ``[default: ...]`` are read off the field, so an option name is one
setting, with one default and one help, in every command that takes it.

:class:`ConfigCommand` turns a command's config-field options (and ``--config FILE``) into one
:class:`~audit.engine.config.AuditConfig`."""
from __future__ import annotations

import sys
from typing import Any, Iterable

import click
from click.core import ParameterSource

from audit.core.errors import GiaError
from audit.core.registry import parse_kv_args
from audit.engine.command_fields import option_fields
from audit.engine.config import FIELD_NAMES, AuditConfig, config_fields, config_of, load_config
from audit.engine.settings import parse_attack_args

#: every field an option is made from, by name
FIELDS = option_fields()


def option_default(f) -> Any:
    """A field's default as the command line spells it (``0,1,5,20`` for a tuple)."""
    if f.metadata["pairs"] or f.default is None:
        return None
    if isinstance(f.default, tuple):
        return ",".join(str(v) for v in f.default)
    return f.default


def option_help(f, repeated: bool = False) -> str:
    """A field's help, with ``[default: ...]`` for a default computed at run time; a field a
    command takes once per value (``repeated``) says so instead."""
    if repeated:
        return f.metadata["help"] + " (repeatable)"
    shown = f.metadata["shown"]
    return f.metadata["help"] + (f"  [default: {shown}]" if shown is not None else "")


def field_option(f, *, repeated: bool = False, required: bool = False):
    """The click option of a field: its flag, type, help and ``[default: ...]``, all read off the
    field; ``repeated``: the command takes several values of it (no default)."""
    m = f.metadata
    names = [m["flag"] or "--" + f.name.replace("_", "-"), *m["aliases"], f.name]
    if m["switch"]:
        return click.option(m["switch"], f.name, flag_value=not f.default, default=f.default, help=m["help"])
    if m["kind"] is bool:
        return click.option(*names, is_flag=True, default=f.default, help=m["help"])
    common = dict(help=option_help(f, repeated), metavar=m["metavar"] or m["pairs"], required=required)
    if m["pairs"] or repeated:
        return click.option(*names, multiple=True, default=(), **common)
    kind = click.Choice(list(m["choices"])) if m["choices"] else {int: click.INT, float: click.FLOAT}.get(m["kind"])
    if m["existing"]:
        kind = click.Path(exists=True, dir_okay=False)
    show = m["shown"] is None and option_default(f) is not None
    return click.option(*names, type=kind, default=option_default(f), show_default=show, **common)


def field_options(names: Iterable[str], *, repeated: Iterable[str] = (), required: Iterable[str] = ()):
    """The options of the fields ``names``, in that order (a config field the command line does
    not set is left out); ``repeated`` and ``required`` name fields taken that way."""
    chosen = [FIELDS[n] for n in names if FIELDS[n].metadata["cli"]]
    repeated, required = set(repeated), set(required)

    def decorate(fn):
        for f in reversed(chosen):
            fn = field_option(f, repeated=f.name in repeated, required=f.name in required)(fn)
        return fn

    return decorate


def config_file_options(fn):
    """``--config FILE`` and ``--print-config``."""
    return field_options(("config_file", "print_config"))(fn)


def common_options(fn):
    """``--seed`` and ``--device`` on every command, as the config's fields spell them."""
    return field_options(("seed", "device"))(fn)


def is_repeated(param) -> bool:
    """An option that takes several values of a field that holds one."""
    return bool(getattr(param, "multiple", False)) and not FIELDS[param.name].metadata["pairs"]


def _field_value(f, value: Any) -> Any:
    if f.metadata["pairs"] == "ATTACK.NAME=VALUE":
        return parse_attack_args(value)
    if f.metadata["pairs"]:
        return parse_kv_args(list(value))
    return value


class ConfigCommand(click.Command):
    """A command whose config-field options become one :class:`AuditConfig`, handed to the
    callback as ``config``: the file of ``--config`` (when the command has it) first, then the
    options given on the command line over it."""

    def invoke(self, ctx):
        names = {p.name for p in self.params if p.name in FIELD_NAMES and not is_repeated(p)}
        try:
            ctx.params["config"] = resolved_config(ctx, names)
        except GiaError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        return super().invoke(ctx)


def resolved_config(ctx, names) -> AuditConfig:
    """The config of a command line: ``--config FILE``'s settings, then each option of ``names``
    given on the command line (an option left out keeps the file's value, else the default)."""
    values = load_config(ctx.params["config_file"]) if ctx.params.get("config_file") else {}
    for f in config_fields():
        if f.name not in names:
            continue
        value = ctx.params.pop(f.name)
        if ctx.get_parameter_source(f.name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT):
            values[f.name] = _field_value(f, value)
    ctx.params.pop("config_file", None)
    return config_of(values)
