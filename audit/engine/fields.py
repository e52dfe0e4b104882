"""The audit's settings, each written once: its default, its help and how the command line
spells it. :class:`~audit.engine.config.AuditConfig` is these fields, checked; the engine's
settings sections (:mod:`audit.engine.settings`) take their defaults from here."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence, Tuple

from audit.core.defense_call import DEFAULT_DEFENSE_TIMEOUT
from audit.engine.recipe import DEFAULT_SEEDS, PROTOCOL
from audit.report.rule import LeakRule

#: the sections of a config, in the order the file and the help list them
SECTIONS = ("defense", "model", "data", "training", "attacks", "evidence", "run")

MODEL_HELP = ("model name (`gia-audit list models`), or package.module:attr of your model: a factory (called "
              "with num_classes=, input_shape= when it takes it, and --model-arg keywords) or an nn.Module")


def setting(default: Any, help: str, section: str, *, flag: Optional[str] = None, aliases: Sequence[str] = (),
            metavar: Optional[str] = None, choices: Sequence[str] = (), kind: Optional[type] = None,
            shown: Optional[str] = None, pairs: Optional[str] = None, switch: Optional[str] = None,
            existing: bool = False, cli: bool = True) -> Any:
    """A config field: its ``default`` and ``help``, its ``section``, and how the command line
    spells it (``flag``, ``aliases``, ``metavar``, ``choices``, ``kind`` the value's type,
    ``shown`` the ``[default: ...]`` text of a default computed at run time, ``pairs`` for a
    repeatable ``NAME=VALUE`` option, ``switch`` for an on/off flag that sets the opposite of the
    default, ``existing`` for the path of a file that must exist; ``cli=False``: Python and the
    file only)."""
    meta = dict(help=help, section=section, flag=flag, aliases=tuple(aliases), metavar=metavar,
                choices=tuple(choices), kind=kind, shown=shown, pairs=pairs, switch=switch, existing=existing,
                cli=cli)
    return field(default=default, metadata=meta)


def thresholds_text(rule: LeakRule) -> str:
    """A leak rule as ``--thresholds`` text, every threshold named."""
    return ",".join(f"{f.name}={getattr(rule, f.name)!r}" for f in fields(rule))


@dataclass(frozen=True)
class AuditFields:
    """The fields of :class:`~audit.engine.config.AuditConfig`, each with its default and help."""

    # ---- the defense
    defense: Any = setting("prune", "built-in defense name (`gia-audit list defenses`), or package.module:attr of "
                           "your defended-gradient callable (a Defense object or any callable from Python)", "defense")
    defense_args: Optional[Mapping[str, Any]] = setting(None, "defense parameter (repeatable)", "defense",
                                                        flag="--defense-arg", pairs="NAME=VALUE")
    # ---- the model
    model: Any = setting("cnn", MODEL_HELP, "model")
    model_args: Optional[Mapping[str, Any]] = setting(None, "model (or factory) keyword (repeatable)", "model",
                                                      flag="--model-arg", pairs="NAME=VALUE")
    model_normalize: Any = setting(
        None, "inputs the model expects: normalised with the data set's statistics (data), pixels in [0, 1] (none) "
              "or normalised with these per-channel mean/std; attacks optimise pixels through it, scores are in "
              "pixel space", "model", metavar="data|none|M1,M2,M3/S1,S2,S3", shown="data; none for an nn.Module object")
    checkpoint: Optional[str] = setting(
        None, "state_dict file (or a dict holding one under state_dict / model) the model's weights start from: "
              "audited step 0 is this state", "model", shown="a fresh seeded initialisation")
    client_mode: str = setting(
        "train", "mode the audited client computes its update in (BatchNorm: the batch's statistics in train, the "
                 "running ones in eval; FL training always runs in train mode)", "model", choices=("train", "eval"))
    # ---- the private data
    data: Any = setting("embedded", "data set name (`gia-audit list datasets`)", "data", flag="--dataset")
    data_path: Optional[str] = setting(None, "local path of the data set (cifar10, mnist, folder)", "data")
    data_args: Optional[Mapping[str, Any]] = setting(None, "the data set loader's keywords", "data", cli=False)
    image_size: int = setting(32, "image side in pixels", "data", aliases=("--size",), kind=int)
    images: int = setting(8, "private batches attacked per step (8: a step with none recovered excludes a recovery "
                             "rate above 31%, 95%)", "data", kind=int)
    batch_size: int = setting(1, "images per private batch", "data", aliases=("--batch",), kind=int)
    share_labels: bool = setting(False, "the protocol shares the labels", "data", kind=bool)
    # ---- the client's training
    lr: float = setting(0.1, "FL server learning rate", "training", kind=float)
    train_batch_size: int = setting(8, "client batch size in training", "training", kind=int)
    clients: int = setting(1, "FL clients with their own data splits", "training", kind=int)
    local_steps: int = setting(1, "local steps of the client per round (1: FedSGD)", "training", kind=int)
    local_lr: Optional[float] = setting(None, "the client's local learning rate", "training", kind=float,
                                        shown="--lr")
    local_optimizer: Any = setting(
        "sgd", "the client's local optimizer: sgd, adam or adamw, with torch.optim's settings, e.g. "
               "sgd:momentum=0.9,nesterov=1,weight_decay=5e-4 or adam:beta1=0.9,beta2=0.999", "training",
        metavar="NAME[:KEY=VALUE,...]")
    local_batch_size: Optional[int] = setting(None, "the client's local mini-batch size", "training", kind=int,
                                              shown="its whole private batch")
    local_epochs: Optional[int] = setting(None, "local epochs over the client's private batch (instead of "
                                                "--local-steps)", "training", kind=int, shown="--local-steps")
    shares: Optional[str] = setting(
        None, "what the client uploads: its defended gradient (FedSGD), its update after local training (weights "
              "only) or that update with its buffers (BatchNorm statistics, as a PyTorch client's state_dict)",
        "training", choices=("gradient", "update", "state"), shown="gradient for one plain step, else update")
    server_optimizer: Any = setting(
        "sgd", "the server's optimizer on each round's mean update between audited steps, its state kept across "
               "rounds (FedAvgM / FedOpt), e.g. sgd:momentum=0.9,nesterov=1,weight_decay=5e-4", "training",
        metavar="NAME[:KEY=VALUE,...]")
    # ---- the attacks and their budget
    steps: Tuple[int, ...] = setting((0, 1, 5, 20), "audited training steps, e.g. 0,1,5,20", "attacks")
    attacks: Tuple[str, ...] = setting(("auto",), "'auto' (base + the planner's adaptive attacks) or names, e.g. "
                                                  "ig,mask-replay", "attacks")
    attack_args: Optional[Mapping[str, Mapping[str, Any]]] = setting(
        None, "an attack's setting, e.g. learned-inverter.pairs=256 (repeatable; the audit's are over the planner's)",
        "attacks", flag="--attack-arg", pairs="ATTACK.NAME=VALUE")
    budget: Any = setting(
        None, "gradient evaluations of the model per attack and private batch (each attack maps it to its "
              "iterations), or auto: doubled from 200 on the positive control (the same attacks without the "
              "defense) until it recovers half of the first step's images", "attacks", metavar="N|auto",
        shown="auto; 200 when every named attack is closed-form")
    max_budget: int = setting(25600, "the ceiling of --budget auto's search (25,600 admits the field's 24k "
                                     "iterations where the time allows: on a GPU)", "attacks", kind=int)
    max_minutes: float = setting(30.0, "the wall-time ceiling of --budget auto's search: a doubling that would end "
                                       "past it (about twice the last try) is not started; the report says which "
                                       "ceiling ended the search",
                                 "attacks", kind=float)
    # ---- the evidence
    thresholds: Any = setting(None, "the leak rule's thresholds, e.g. margin_db=2,partial_rank=5 (docs/evidence.md)",
                              "evidence", metavar="NAME=VALUE,...",
                              shown=thresholds_text(LeakRule()) + "; a re-rendered report: the stored run's")
    delta: Optional[float] = setting(None, "l2 radius of the risk ball", "evidence", kind=float,
                                     shown="RMSE 0.1 x sqrt(pixels), i.e. 20 dB")
    utility: bool = setting(True, "measure utility, the test accuracy after training with and without the defense "
                                  "(--no-utility: skip it)", "evidence", kind=bool, switch="--no-utility")
    utility_steps: int = setting(PROTOCOL.rounds, "rounds of the utility recipe (docs/evidence.md) trained with and "
                                                  "without the defense for the utility section", "evidence", kind=int)
    utility_seeds: int = setting(DEFAULT_SEEDS, "training seeds per arm of the utility section (mean and spread)",
                                 "evidence", kind=int)
    # ---- the run
    defense_timeout: Optional[float] = setting(
        DEFAULT_DEFENSE_TIMEOUT, "abandon a defense call after SECONDS and record it as an error naming the "
                                 "defense; 0: no limit (the default is ~19x the slowest built-in defense call "
                                 "measured, docs/performance.md)", "run", kind=float, metavar="SECONDS")
    out: str = setting("audit-out", "output folder (the results and the report in every format)", "run")
    seed: int = setting(0, "random seed", "run", kind=int)
    device: str = setting("cpu", "torch device: cpu, cuda, cuda:1, mps", "run")
    progress: bool = setting(True, "a progress bar (--quiet: none)", "run", kind=bool, switch="--quiet")
    retry_errors: bool = setting(True, "a rerun retries the stored errors", "run", kind=bool, cli=False)


def config_fields() -> Tuple[Any, ...]:
    return fields(AuditFields)


def default_of(name: str) -> Any:
    """The default of the config field ``name`` (the one place it is written)."""
    for f in fields(AuditFields):
        if f.name == name:
            return f.default
    raise KeyError(name)


def field_help(name: str) -> str:
    """The help of the config field ``name``."""
    return next(f.metadata["help"] for f in fields(AuditFields) if f.name == name)


FIELD_NAMES = tuple(f.name for f in fields(AuditFields))


def default_text(f) -> str:
    """A field's default as the help and the reference print it."""
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    if f.default is None:
        return "none"
    if isinstance(f.default, tuple):
        return ",".join(str(v) for v in f.default)
    if isinstance(f.default, bool):
        return str(f.default).lower()
    return str(f.default)


def options_table() -> str:
    """The reference's table of the audit's settings (``docs/reference.md``), made from the fields:
    the file's key, the command-line option, the default and the help."""
    rows = ["| setting (file key) | option | default | meaning |", "|---|---|---|---|"]
    for f in fields(AuditFields):
        m = f.metadata
        option = (m["switch"] or m["flag"] or "--" + f.name.replace("_", "-")) if m["cli"] else "(file and Python only)"
        if m["aliases"]:
            option += " (" + ", ".join(m["aliases"]) + ")"
        if m["pairs"]:
            option += f" {m['pairs']}"
        cell = lambda text: text.replace("|", "\\|")  # noqa: E731
        rows.append(f"| `{f.name}` | `{cell(option)}` | {cell(default_text(f))} | {cell(m['help'])} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m audit.engine.fields: the reference's table
    print(options_table())
