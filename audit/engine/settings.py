"""The engine's view of an :class:`~audit.engine.config.AuditConfig`: five small frozen
sections (model, data, FL training, attacks, output), each checked when built, so a bad value
fails before any work starts with a one-line error naming the field.

:func:`sections_of` builds them from a config; their defaults are the config's fields'
(:func:`~audit.engine.config.default_of`), written there once.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from attacks.presets import uses_budget
from audit.core.errors import ConfigError
from audit.core.client_training import CLIENT_MODES, ClientTraining, client_lr  # noqa: F401  (CLIENT_MODES re-exported)
from audit.core.local_training import LocalOptimizer
from audit.core.model_source import model_label, parse_normalize, source_kind
from audit.core.registry import parse_kv_args
from audit.core.types import BUDGET_DEFINITION, BUDGET_UNIT
from audit.engine.fields import default_of
from audit.report.rule import LeakRule

DEFAULT_STEPS = default_of("steps")
#: the budget search's start and the budget of closed-form attacks
DEFAULT_BUDGET = 200
#: the budget search's word (audit.engine.control)
AUTO_BUDGET = "auto"
DEFAULT_MAX_BUDGET = default_of("max_budget")
DEFAULT_IMAGES = default_of("images")


def _comma_list(value: Any) -> Any:
    """A comma-separated string as its non-empty items (spaces dropped); anything else as is."""
    return [s for s in value.replace(" ", "").split(",") if s] if isinstance(value, str) else value


def _parse_steps(steps: Union[str, Sequence[int]]) -> List[int]:
    given = steps
    steps = _comma_list(steps)
    try:
        out = sorted({int(s) for s in steps})
    except (TypeError, ValueError):
        raise ConfigError(f"steps must be training steps like 0,1,5,20, got {given!r}") from None
    if not out or out[0] < 0:
        raise ConfigError(f"steps must be a non-empty list of steps >= 0, got {steps!r}")
    return out


def _positive(name: str, value: Any, kind=int) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or (
            kind is int and not float(value).is_integer()):
        raise ConfigError(f"{name} must be a positive {'integer' if kind is int else 'number'}, got {value!r}")
    return kind(value)



def _set(obj: Any, **values: Any) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class ModelSettings:
    """The audited model (built by :func:`audit.core.model_source.build_audited_model`):
    ``model`` a registered name, ``"package.module:attr"``, a factory or an ``nn.Module``;
    ``args`` the name's or factory's keywords; ``normalize`` the inputs it expects ("data",
    "none" or (mean, std); None: "data" for a model the audit builds, "none" for a built
    module); ``checkpoint`` a state_dict file its weights start from: the audited steps and
    the utility's training count from there."""

    model: Any = default_of("model")
    args: Mapping[str, Any] = field(default_factory=dict)
    normalize: Any = None
    checkpoint: Optional[Union[str, Path]] = None

    def __post_init__(self):
        source_kind(self.model)  # a model of no known kind is an error now
        _set(self, args=dict(self.args or {}), normalize=parse_normalize(self.normalize),
             checkpoint=None if self.checkpoint is None else Path(self.checkpoint).expanduser())

    def describe(self) -> Dict[str, Any]:
        """JSON-able, for the report and the run key (with the built model's digests)."""
        normalize = self.normalize
        if normalize is None:  # the default, as it applies
            normalize = "none" if source_kind(self.model) == "module" else "data"
        elif not isinstance(normalize, str):
            normalize = {"mean": list(normalize[0]), "std": list(normalize[1])}
        return {"model": self.model if isinstance(self.model, str) else model_label(self.model),
                "args": {k: repr(v) if not isinstance(v, (int, float, str, bool, type(None), list, tuple)) else v
                         for k, v in self.args.items()},
                "normalize": normalize}


def model_settings(model: Any, model_args: Optional[Mapping[str, Any]] = None) -> ModelSettings:
    """``model`` as :class:`ModelSettings`: as it is when it already is one (then without
    ``model_args``), else built from the spec and ``model_args``."""
    if isinstance(model, ModelSettings):
        if model_args:
            raise ConfigError("model_args go into ModelSettings(args=...) when the model is given as ModelSettings")
        return model
    return ModelSettings(model, model_args or {})


@dataclass(frozen=True)
class DataSettings:
    """The private data: a data set (name or :class:`~audit.core.data.Dataset`; ``data_args``
    e.g. ``{"path": ...}``) at ``image_size`` pixels; ``images`` private batches of
    ``batch_size`` images from its test split; whether the protocol shares the labels."""

    data: Any = default_of("data")
    data_args: Mapping[str, Any] = field(default_factory=dict)
    image_size: int = default_of("image_size")
    images: int = default_of("images")
    batch_size: int = default_of("batch_size")
    share_labels: bool = default_of("share_labels")

    def __post_init__(self):
        _set(self, data_args=dict(self.data_args or {}), image_size=_positive("image_size", self.image_size),
             images=_positive("images", self.images), batch_size=_positive("batch_size", self.batch_size),
             share_labels=bool(self.share_labels))


@dataclass(frozen=True)
class FLSettings:
    """How the model is trained between audited checkpoints (see :func:`audit.client.fl.train`):
    FedSGD, or FedAvg with ``local_steps`` / ``local_lr``, over ``clients`` clients (in train
    mode). ``client_mode``: the mode the audited client runs the model in for the update the
    attacker sees ("train": BatchNorm normalises with the batch's statistics, as clients
    train; "eval": with the running statistics of the model's buffers). The audited client's
    training: ``local_steps`` (or ``local_epochs`` over its private batch in mini-batches of
    ``local_batch_size``) of ``local_optimizer`` (``"sgd"``, ``"sgd:momentum=0.9,nesterov=1,
    weight_decay=5e-4"``, ``"adam"``, ``"adamw:weight_decay=0.01"``); ``shares``: what it
    uploads, ``"gradient"`` (FedSGD), ``"update"`` (its weights after training) or ``"state"``
    (weights and buffers: the BatchNorm statistics). ``server_optimizer``: the server's optimiser
    on each round's mean update, its state kept across rounds (FedAvgM / FedOpt; with one
    client and FedSGD, centralised training such as a paper's SGD with momentum)."""

    lr: float = default_of("lr")
    batch_size: int = default_of("train_batch_size")
    clients: int = default_of("clients")
    local_steps: int = default_of("local_steps")
    local_lr: Optional[float] = default_of("local_lr")
    client_mode: str = default_of("client_mode")
    #: the client's local optimiser (:class:`~audit.core.local_training.LocalOptimizer` or its
    #: text, e.g. ``"sgd:momentum=0.9,weight_decay=5e-4"`` / ``"adam"``)
    local_optimizer: Any = default_of("local_optimizer")
    #: the audited client's local mini-batch size (None: its whole private batch each step)
    local_batch_size: Optional[int] = default_of("local_batch_size")
    #: local epochs over the audited client's private batch (replaces local_steps when given)
    local_epochs: Optional[int] = default_of("local_epochs")
    #: what the client uploads: gradient, update or state (None: gradient for one plain step, else update)
    shares: Optional[str] = default_of("shares")
    #: the server's optimiser between audited steps (same text as ``local_optimizer``)
    server_optimizer: Any = default_of("server_optimizer")

    #: the audited client's training as one record, built here once (from the fields above)
    client: ClientTraining = field(init=False, repr=False)

    def __post_init__(self):
        lr = _positive("lr", self.lr, float)
        local_lr = None if self.local_lr is None else _positive("local_lr", self.local_lr, float)
        client = ClientTraining(self.local_optimizer, self.local_steps, self.local_epochs,
                                client_lr(lr, local_lr), self.local_batch_size, self.shares,
                                self.client_mode)
        _set(self, client=client, lr=lr, local_lr=local_lr, local_optimizer=client.optimizer,
             local_steps=client.steps, local_epochs=client.epochs, local_batch_size=client.batch_size,
             shares=client.shares, server_optimizer=LocalOptimizer.parse(self.server_optimizer),
             batch_size=_positive("train_batch_size", self.batch_size), clients=_positive("clients", self.clients))

    def client_steps(self, batch_size: int) -> int:
        """Local steps of the audited client on a private batch of ``batch_size`` images."""
        return self.client.steps_for(batch_size)

    def training_description(self) -> str:
        """The client's local training, in one phrase, for reports."""
        server = "" if self.server_optimizer.plain else \
            f"; the server steps with {self.server_optimizer.describe()} between audited steps"
        return self.client.describe() + server


@dataclass(frozen=True)
class AttackSettings:
    """What is attacked and how hard: the audited training ``steps``; ``names`` ("auto" = the
    base attacks plus the planner's, or registry names, or both); per-attack ``args`` over the
    planner's; ``budget`` in gradient evaluations of the model per attack and private batch."""

    steps: Tuple[int, ...] = default_of("steps")
    names: Union[str, Sequence[str]] = default_of("attacks")
    args: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: gradient evaluations, or "auto": found on the positive control (audit.engine.control);
    #: None: "auto", or the start when every named attack is closed-form (a search gives it nothing)
    budget: Union[int, str, None] = default_of("budget")
    #: the ceiling of the "auto" budget search, in gradient evaluations and in wall minutes
    max_budget: int = default_of("max_budget")
    max_minutes: float = default_of("max_minutes")

    def __post_init__(self):
        _set(self, steps=tuple(_parse_steps(self.steps)), names=tuple(attack_names(self.names)),
             args={name: dict(kv) for name, kv in (self.args or {}).items()},
             max_budget=_positive("max_budget", self.max_budget), max_minutes=_positive("max_minutes", self.max_minutes, float))
        _set(self, budget=_budget(self.budget) if self.budget is not None else _default_budget(self.names))

    @property
    def searches_budget(self) -> bool:
        """Whether the budget is found by the control's search (``budget="auto"``)."""
        return self.budget == AUTO_BUDGET

    def budget_description(self) -> Dict[str, Any]:
        return {"value": self.budget, "unit": BUDGET_UNIT, "definition": BUDGET_DEFINITION}


def _default_budget(names: Sequence[str]) -> Union[int, str]:
    """"auto", unless every named attack spends no budget (closed form): then the start."""
    named = [n for n in names if n != "auto"]
    if named and len(named) == len(names) and not any(uses_budget(n) for n in named):
        return DEFAULT_BUDGET
    return AUTO_BUDGET


def _budget(value: Any) -> Union[int, str]:
    """A budget: a positive integer (also as text) or "auto"."""
    if isinstance(value, str):
        if value.strip().lower() == AUTO_BUDGET:
            return AUTO_BUDGET
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"budget must be a positive integer or 'auto', got {value!r}") from None
    return _positive("budget", value)


@dataclass(frozen=True)
class OutputSettings:
    """Where and what is written: the output folder, the utility measurement (``utility_steps``
    FL rounds with and without the defense, on ``utility_seeds`` seeds each), the verdict thresholds, the risk radius ``delta``
    (None: RMSE 0.1 per pixel) and the progress bar; how the run treats a defense:
    ``defense_timeout`` seconds per call (default :data:`~audit.core.defense_call.DEFAULT_DEFENSE_TIMEOUT`;
    None or 0: no limit; a call past it is abandoned and recorded as an error), and whether a rerun retries stored errors (``retry_errors``)."""

    out: Union[str, Path] = default_of("out")
    utility: bool = default_of("utility")
    utility_steps: int = default_of("utility_steps")
    thresholds: LeakRule = field(default_factory=LeakRule)
    delta: Optional[float] = default_of("delta")
    progress: bool = default_of("progress")
    defense_timeout: Optional[float] = default_of("defense_timeout")
    retry_errors: bool = default_of("retry_errors")
    utility_seeds: int = default_of("utility_seeds")

    def __post_init__(self):
        _set(self, out=Path(self.out), utility=bool(self.utility),
             utility_steps=_positive("utility_steps", self.utility_steps),
             utility_seeds=_positive("utility_seeds", self.utility_seeds),
             thresholds=LeakRule.of(self.thresholds),
             delta=None if self.delta is None else _positive("delta", self.delta, float),
             defense_timeout=None if self.defense_timeout in (None, 0) else _positive(
                 "defense_timeout (seconds)", self.defense_timeout, float),
             retry_errors=bool(self.retry_errors))


def attack_names(attacks: Union[str, Sequence[str]]) -> List[str]:
    """``"auto,dlg"`` or ``["auto", "dlg"]`` -> the distinct names, in order."""
    names = [str(a) for a in _comma_list(attacks)]
    if not names:
        raise ConfigError("attacks must be 'auto', a non-empty list of attack names (see `gia-audit list "
                          "attacks`), or both, e.g. 'auto,dlg'")
    return list(dict.fromkeys(names))


def parse_attack_args(pairs: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``["learned-inverter.pairs=256", "ig.restarts=2"]`` -> ``{"learned-inverter": {"pairs": 256}, ...}``."""
    out: Dict[str, Dict[str, Any]] = {}
    for pair in pairs:
        name, dot, rest = pair.partition(".")
        if not dot or "=" not in rest or not name:
            raise ConfigError(f"attack argument {pair!r} is not of the form attack.setting=value "
                              "(e.g. ig.restarts=2)")
        out.setdefault(name, {}).update(parse_kv_args([rest]))
    return out


@dataclass(frozen=True)
class Sections:
    """The engine's settings of one config: what :class:`~audit.engine.audit.Audit` and the
    sweep run on."""

    model: ModelSettings
    data_settings: DataSettings
    fl_settings: FLSettings
    attack_settings: AttackSettings
    output_settings: OutputSettings
    seed: int
    device: Any

    def as_kwargs(self) -> Dict[str, Any]:
        """As :class:`~audit.engine.audit.Audit`'s keywords (the defense aside)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def sections_of(config: Any) -> Sections:
    """The engine's settings of ``config`` (an :class:`~audit.engine.config.AuditConfig`),
    built and checked once per config."""
    built = config.__dict__.get("_sections")
    if built is None:
        c = config
        data_args = dict(c.data_args or {})
        if c.data_path is not None:
            if data_args.get("path", c.data_path) != c.data_path:
                raise ConfigError(f"data_path {c.data_path!r} and data_args path {data_args['path']!r} differ; give one")
            data_args["path"] = c.data_path
        built = Sections(
            model=ModelSettings(c.model, dict(c.model_args or {}), c.model_normalize, c.checkpoint),
            data_settings=DataSettings(c.data, data_args, c.image_size, c.images, c.batch_size, c.share_labels),
            fl_settings=FLSettings(lr=c.lr, batch_size=c.train_batch_size, clients=c.clients,
                                   local_steps=c.local_steps, local_lr=c.local_lr, client_mode=c.client_mode,
                                   local_optimizer=c.local_optimizer, local_batch_size=c.local_batch_size,
                                   local_epochs=c.local_epochs, shares=c.shares, server_optimizer=c.server_optimizer),
            attack_settings=AttackSettings(c.steps, c.attacks, dict(c.attack_args or {}), c.budget, c.max_budget,
                                           c.max_minutes),
            output_settings=OutputSettings(c.out, c.utility, c.utility_steps, LeakRule.of(c.thresholds), c.delta,
                                           c.progress, c.defense_timeout, c.retry_errors, utility_seeds=c.utility_seeds),
            seed=c.seed, device=c.device)
        object.__setattr__(config, "_sections", built)
    return built


def plain_dict(settings: Any) -> Dict[str, Any]:
    """A settings object as a JSON-able dict (paths and tuples made plain)."""
    out = asdict(settings)
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v) for k, v in out.items()}
