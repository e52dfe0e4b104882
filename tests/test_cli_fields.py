"""Every option of every command is made from a field: a setting of the audit's config
(``audit/engine/fields.py``) or a command's own (``audit/engine/command_fields.py``). The
option's flag, help and default shown are the field's, and an option name is one field in
every command that takes it."""
import re
from pathlib import Path

import click
import pytest

import cli
from audit.engine.command_fields import command_fields, option_fields
from audit.engine.fields import config_fields, default_text

ROOT = Path(__file__).resolve().parents[1]
FIELDS = option_fields()


def _commands(group: click.Group, path=()):
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield " ".join((*path, name)), command


COMMANDS = dict(_commands(cli.main))


def options(command: click.Command):
    return [p for p in command.params if isinstance(p, click.Option)]


def flags(f):
    """The option names a field spells."""
    m = f.metadata
    return [m["switch"]] if m["switch"] else [m["flag"] or "--" + f.name.replace("_", "-"), *m["aliases"]]


def expected_help(f, repeated: bool) -> str:
    m = f.metadata
    if repeated:  # a field the command takes once per value (the sweep's --defense)
        return m["help"] + " (repeatable)"
    return m["help"] + (f"  [default: {m['shown']}]" if m["shown"] is not None else "")


def expected_default(f, option):
    m = f.metadata
    if m["switch"] or m["kind"] is bool:
        return f.default
    if option.multiple:
        return ()
    return ",".join(map(str, f.default)) if isinstance(f.default, tuple) else f.default


def shows_default(f, option) -> bool:
    m = f.metadata
    return m["shown"] is not None or not (f.default is None or m["kind"] is bool or m["pairs"] or option.multiple)


def mismatches(command: click.Command):
    """Each option of ``command`` that is not its field's: no field of its name, another flag,
    help, default, or ``[default: ...]`` than the field's."""
    ctx, found = click.Context(command), []
    for option in options(command):
        f = FIELDS.get(option.name)
        if f is None or not f.metadata["cli"]:
            found.append(f"{option.opts[0]}: no field {option.name!r}")
            continue
        repeated = option.multiple and not f.metadata["pairs"]
        shown = re.search(r"\[default: (.*?)(; required)?\]$", option.get_help_record(ctx)[1])
        for what, ok in (("flags", option.opts == flags(f)), ("help", option.help == expected_help(f, repeated)),
                         ("default", option.default == expected_default(f, option)),
                         ("[default: ...]", bool(shown) == shows_default(f, option)
                          and (not shown or shown.group(1) == default_text(f)))):
            if not ok:
                found.append(f"{option.opts[0]}: not its field's {what}")
    return found


def shared_names(commands):
    """Option names that are several fields: {name: {field: a command taking it}}."""
    fields_of = {}
    for name, command in commands.items():
        for option in options(command):
            for flag in option.opts:
                fields_of.setdefault(flag, {})[option.name] = name
    return {flag: names for flag, names in fields_of.items() if len(names) > 1}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_a_field_with_its_flag_help_and_default(name):
    assert options(COMMANDS[name]) and not mismatches(COMMANDS[name]), (name, mismatches(COMMANDS[name]))


def test_an_option_name_is_one_field_in_every_command():
    assert not shared_names(COMMANDS)


def test_every_field_is_an_option_somewhere_and_the_names_are_unique():
    assert len(FIELDS) == len(config_fields()) + len(command_fields())
    taken = {option.name for command in COMMANDS.values() for option in options(command)}
    assert {f.name for f in command_fields()} <= taken
    assert {f.name for f in config_fields() if f.metadata["cli"]} <= {p.name for p in options(COMMANDS["audit"])}


def test_the_command_line_writes_no_option_by_hand():
    text = (ROOT / "cli.py").read_text()
    assert "[default:" not in text and "click.option(" not in text and "show_default" not in text


def test_the_checks_find_what_they_look_for():
    lr = FIELDS["utility_lr"]
    by_hand = click.Command("utility", params=[
        click.Option(["--steps", "utility_steps"], type=int, default=None, help="training rounds"),
        click.Option(["--utility-lr", "utility_lr"], default=lr.default, show_default=True, help=lr.metadata["help"]),
        click.Option(["--probe", "probe"], default=None, help="no field")])
    assert mismatches(by_hand) == ["--steps: not its field's flags", "--steps: not its field's help",
                                   "--steps: not its field's default", "--steps: not its field's [default: ...]",
                                   "--probe: no field 'probe'"]
    assert shared_names({"audit": COMMANDS["audit"], "utility": by_hand}) == {
        "--steps": {"steps": "audit", "utility_steps": "utility"}}
