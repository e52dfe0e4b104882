"""One configuration from the command line or a file to the report: the options are made from
the config's fields, a printed config replays the run, and bad settings are one-line errors."""
import json

import pytest
from click.testing import CliRunner

import cli
from audit.core.errors import ConfigError
from audit.engine.audit import Audit
from audit.engine.config import AuditConfig, config_fields, load_config, make_config
from audit.report.store import settings_key

FIELDS = {f.name: f for f in config_fields()}
CLI_FIELDS = [name for name, f in FIELDS.items() if f.metadata["cli"]]

# one non-default command-line value per option of a config field: field, then the arguments
CASES = {row.split()[0]: row.split()[1:] for row in """
defense           --defense gaussian
defense_args      --defense-arg sigma=0.05 --defense-arg layers=1,2
model             --model mlp
model_args        --model-arg hidden=16
model_normalize   --model-normalize 0.5,0.5,0.5/0.25,0.25,0.25
checkpoint        --checkpoint weights.pt
client_mode       --client-mode eval
data              --dataset cifar10
data_path         --data-path data/cifar
image_size        --size 16
images            --images 2
batch_size        --batch-size 2
share_labels      --share-labels
lr                --lr 0.05
train_batch_size  --train-batch-size 4
clients           --clients 2
local_steps       --local-steps 3
local_lr          --local-lr 0.02
local_optimizer   --local-optimizer sgd:momentum=0.9,nesterov=1
local_batch_size  --local-batch-size 1
local_epochs      --local-epochs 2
shares            --shares update
server_optimizer  --server-optimizer adam:beta2=0.99
steps             --steps 2,0
attacks           --attacks ig,dlg
attack_args       --attack-arg ig.restarts=2 --attack-arg dlg.lr=0.5
budget            --budget 400
max_budget        --max-budget 6400
max_minutes       --max-minutes 12.5
thresholds        --thresholds margin_db=2,exact_error=0.01
delta             --delta 3.5
utility           --no-utility
utility_steps     --utility-steps 10
utility_seeds     --utility-seeds 2
defense_timeout   --defense-timeout 30
out               --out elsewhere
seed              --seed 7
device            --device cuda:1
progress          --quiet
""".strip().splitlines()}


def printed(args, tmp_path, name="printed.toml"):
    """The config ``gia-audit audit ARGS --print-config`` prints, as a file and as a config."""
    result = CliRunner().invoke(cli.main, ["audit", *args, "--print-config"])
    assert result.exit_code == 0, result.output
    path = tmp_path / name
    path.write_text(result.output)
    return path, make_config(**load_config(path))


def command(name):
    return cli.main.commands[name]


def test_every_option_of_a_config_field_takes_its_default_and_help_from_the_field():
    for name in ("audit", "sweep", "attack"):
        options = {p.name: p for p in command(name).params if p.name in FIELDS}
        assert options, name
        for field_name, option in options.items():
            f = FIELDS[field_name]
            assert option.help.startswith(f.metadata["help"]), (name, field_name)
            if f.metadata["shown"] is not None:  # a default computed at run time, described once
                assert option.help.endswith(f"[default: {f.metadata['shown']}]")
            elif f.metadata["switch"]:  # --quiet, --no-utility: the flag sets the other value
                assert option.default is f.default and option.flag_value is (not f.default)
            elif f.metadata["pairs"]:
                assert option.default == () and f.default is None
            elif option.multiple:  # the sweep's --defense: one value per defense, no default
                assert option.default == () and option.help == f.metadata["help"] + " (repeatable)"
            else:
                assert make_config(**{field_name: option.default}) == AuditConfig(), (name, field_name)
    # the audit has an option for every field the command line can set
    assert {p.name for p in command("audit").params} >= set(CLI_FIELDS)
    text = CliRunner().invoke(cli.main, ["audit", "--help"]).output
    for shown in ("[default: cnn]", "[default: 8]", "[default: 25600]", "[default: 0,1,5,20]", "[default: 800]"):
        assert shown in " ".join(text.split()), shown


def test_the_single_attack_and_the_audit_share_their_defaults():
    audit_options = {p.name: p for p in command("audit").params}
    shared = [p for p in command("attack").params if p.name in FIELDS]
    assert {p.name for p in shared} >= {"model", "data", "image_size", "batch_size", "local_steps", "local_lr",
                                        "client_mode", "seed", "device"}
    for option in shared:
        twin = audit_options[option.name]
        assert (option.opts, option.default, option.help) == (twin.opts, twin.default, twin.help), option.name
    text = " ".join(CliRunner().invoke(cli.main, ["attack", "--help"]).output.split())
    assert "[default: cnn]" in text and "convnet" not in text


@pytest.mark.parametrize("field_name", sorted(CASES))
def test_a_printed_config_replays_every_field(field_name, tmp_path):
    """Each option reaches its own field; its printed TOML, read back through --config, is the
    same config (and prints the same file again)."""
    path, config = printed(CASES[field_name], tmp_path)
    differs = [name for name in FIELDS if getattr(config, name) != getattr(AuditConfig(), name)]
    assert differs == [field_name]
    assert make_config(**{field_name: getattr(config, field_name)}) == config  # the value kept whole
    again = CliRunner().invoke(cli.main, ["audit", "--config", str(path), "--print-config"])
    assert again.exit_code == 0 and again.output == path.read_text()
    assert make_config(**load_config(path)) == config


def test_every_command_line_field_has_a_round_trip_case():
    assert sorted(CASES) == sorted(CLI_FIELDS)


SMALL = ["--defense", "gaussian", "--defense-arg", "sigma=0.01", "--model", "mlp", "--model-arg", "hidden=16",
         "--image-size", "8", "--images", "1", "--steps", "0,1", "--attacks", "ig", "--budget", "5", "--lr", "0.05",
         "--train-batch-size", "4", "--clients", "2", "--local-steps", "2", "--local-lr", "0.02",
         "--local-optimizer", "sgd:momentum=0.9", "--server-optimizer", "sgd:momentum=0.5", "--share-labels",
         "--thresholds", "margin_db=2", "--delta", "3.0", "--seed", "3", "--no-utility", "--quiet"]


def test_a_printed_config_gives_the_run_key_of_its_command_line(tmp_path):
    """The run key of the audit built from the command line equals the one built from its printed
    file; the audit run from the command line resumes from that file without computing again."""
    out = tmp_path / "out"
    args = SMALL + ["--out", str(out)]
    path, from_file = printed(args, tmp_path)
    runner = CliRunner()
    first = runner.invoke(cli.main, ["audit", *args])
    assert first.exit_code == 0, first.output
    report = json.loads((out / "report.json").read_text())
    key = report["run_key"]
    assert settings_key(Audit.from_config(from_file).key_settings()) == key
    assert report["config"]["replayable"] and report["config"]["values"]["defense_args"] == {"sigma": 0.01}
    written = out / "config.toml"
    assert make_config(**load_config(written)) == from_file
    results = sorted((out / "runs" / key / "results").rglob("*.json"))
    stamps = [p.stat().st_mtime_ns for p in results]
    again = runner.invoke(cli.main, ["audit", "--config", str(written)])
    assert again.exit_code == 0, again.output
    assert json.loads((out / "report.json").read_text())["run_key"] == key
    assert results and [p.stat().st_mtime_ns for p in results] == stamps  # resumed: nothing computed again
    # an option on the command line overrides the file
    _, changed = printed(["--config", str(written), "--images", "2"], tmp_path, "changed.toml")
    assert (changed.images, changed.defense_args) == (2, {"sigma": 0.01})


def test_an_unknown_key_names_the_nearest_valid_one(tmp_path):
    path = tmp_path / "audit.toml"
    path.write_text('defense = "prune"\nimags = 3\n')
    result = CliRunner().invoke(cli.main, ["audit", "--config", str(path)])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "unknown setting 'imags'" in result.output
    assert "did you mean 'images'?" in result.output
    with pytest.raises(ConfigError, match="unknown setting 'budgte'; did you mean 'budget'"):
        make_config(budgte=3)


@pytest.mark.parametrize("values,message", [
    ({"images": "many"}, "images must be a whole number"),
    ({"images": 0}, "images must be a positive integer"),
    ({"share_labels": "yes"}, "share_labels must be true or false"),
    ({"steps": "a,b"}, "steps must be training steps"),
    ({"model_args": [1, 2]}, "model_args must be a mapping"),
    ({"train_batch_size": -1}, "train_batch_size must be a positive integer"),
    ({"local_optimizer": "sgdd"}, "local_optimizer: unknown local optimizer 'sgdd'"),
    ({"model_normalize": "bright"}, "model_normalize: model normalisation must be"),
])
def test_a_bad_value_is_one_line_naming_its_field(values, message):
    with pytest.raises(ConfigError, match=message) as err:
        AuditConfig(**values)
    assert "\n" not in str(err.value)


def test_every_threshold_of_the_leak_rule_is_kept():
    from audit.report.rule import LeakRule

    config = AuditConfig(thresholds={"margin_db": 2, "exact_error": 0.01})
    assert LeakRule.of(config.thresholds) == LeakRule(margin_db=2, exact_error=0.01)


def test_a_python_object_is_recorded_but_not_written_to_a_file():
    config = AuditConfig(defense=lambda model, inputs, labels, *, loss_fn, generator: [])
    record = config.record()
    assert not record["replayable"] and record["why_not"].startswith("defense is a Python object")
    with pytest.raises(ConfigError, match="defense is a Python object"):
        config.toml()


def test_the_reference_table_of_settings_is_the_config_fields():
    from pathlib import Path

    from audit.engine.fields import options_table

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    block = page.split("<!-- config:options:begin -->")[1].split("<!-- config:options:end -->")[0].strip()
    assert block == options_table(), "docs/reference.md: rewrite the table with `python -m audit.engine.fields`"
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(FIELDS)  # one row per field, in the config's order
    assert "| `images` | `--images` | 8 |" in block and "| `progress` | `--quiet` | true |" in block


def test_a_config_file_reads_with_tomli_where_the_standard_library_has_no_tomllib(tmp_path, monkeypatch):
    import sys
    import tomllib

    path = tmp_path / "audit.toml"
    path.write_text(AuditConfig(images=3, steps=(0, 2)).toml())
    monkeypatch.setitem(sys.modules, "tomllib", None)  # Python 3.10: importing it raises ImportError
    monkeypatch.setitem(sys.modules, "tomli", tomllib)  # the backport, the same parser
    assert make_config(**load_config(path)) == AuditConfig(images=3, steps=(0, 2))
    path.write_text("images = [")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(path)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ImportError):
        load_config(path)
