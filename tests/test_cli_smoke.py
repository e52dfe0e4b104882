"""Every command of the command line runs: its ``--help``, every ``list``, and each working
command at tiny settings, so that a moved registry or option cannot break one unseen."""
import json

import click
import pytest
from click.testing import CliRunner

import cli
from audit.engine.listing import REGISTRIES

TINY = ["--model", "mlp", "--model-arg", "hidden=16", "--image-size", "8", "--images", "1", "--steps", "0",
        "--attacks", "analytic", "--budget", "5", "--quiet"]


def _commands(group: click.Group, path=()):
    for name, command in sorted(group.commands.items()):
        yield (*path, name)
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))


COMMANDS = list(_commands(cli.main))


def _run(args):
    result = CliRunner().invoke(cli.main, list(args))
    assert result.exit_code == 0, f"gia-audit {' '.join(args)}: {result.output}{result.exception!r}"
    return result.output


def test_the_command_list_holds_every_working_command():
    assert {"attack", "audit", "list", "plan", "report", "sweep", "utility", "weights", "weights lpips"} <= {
        " ".join(c) for c in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_prints_its_help(command):
    assert "Usage: " in _run([*command, "--help"])


@pytest.mark.parametrize("what", sorted(REGISTRIES))
def test_every_listing_prints_each_registered_name(what):
    import importlib

    import adaptive  # noqa: F401  (registers the adaptive attacks)

    module, attr = REGISTRIES[what]
    names = getattr(importlib.import_module(module), attr).names()
    lines = _run(["list", what]).splitlines()
    assert [line.split()[0] for line in lines] == list(names)
    if what == "attacks":  # the base attacks and the adaptive ones the planner picks
        assert {"ig", "conv-span", "mask-replay", "through-defense"} <= set(names)


def test_audit_report_sweep_attack_utility_and_plan_run_at_tiny_settings(tmp_path):
    out = _run(["audit", "--defense", "none", "--no-utility", *TINY, "--out", str(tmp_path / "audit")])
    assert "verdict: leaks" in out  # analytic inversion recovers an undefended MLP's image exactly
    assert "verdict: leaks" in _run(["report", str(tmp_path / "audit")])
    _run(["sweep", "--defense", "prune", "--grid", "ratio=0.5", *TINY, "--utility-steps", "2",
          "--out", str(tmp_path / "sweep")])
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    _run(["attack", "--attack", "analytic", "--model", "mlp", "--model-arg", "hidden=16", "--image-size", "8",
          "--attack-budget", "5", "--quiet", "--out", str(tmp_path / "attack")])
    assert any((tmp_path / "attack").iterdir())
    assert "undefended" in _run(["utility", "--defense", "prune", "--model", "mlp", "--size", "8",
                                 "--utility-steps", "2", "--utility-batch-size", "4"])
    assert "traits:" in _run(["plan", "--defense", "prune"])
