"""The audit mod's options, validated when the mod is built: a bad option is a one-line
ConfigError naming the fix before the federation starts."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

from audit.core.client_training import client_lr
from audit.core.errors import ConfigError
from audit.core.registry import import_attr
from audit.engine.config import AuditConfig, default_of, make_config
from audit.engine.settings import DEFAULT_BUDGET, AttackSettings
from audit.integrations.flower.defenses import is_flower_mod
from audit.integrations.flower.randomness import preserved_random_state

#: unrelated images of the client kept as the null and the attacker's auxiliary data
DEFAULT_REFERENCE = 512
DEFAULT_LR = default_of("lr")


def _rounds(rounds: Union[str, int, Sequence[int]]) -> Tuple[int, ...]:
    items = rounds.replace(" ", "").split(",") if isinstance(rounds, str) else (
        [rounds] if isinstance(rounds, int) else list(rounds))
    try:
        out = sorted({int(r) for r in items if r != ""})
    except (TypeError, ValueError):
        raise ConfigError(f"rounds must be federation rounds like 1,5,20, got {rounds!r}") from None
    if not out or out[0] < 1:
        raise ConfigError(f"rounds must be a non-empty list of federation rounds >= 1 (Flower counts from 1), "
                          f"got {rounds!r}")
    return tuple(out)


def _factory(model: Any) -> Any:
    return import_attr(model, "model") if isinstance(model, str) and ":" in model else model


def _check_classes(model: Any, num_classes: Optional[int]) -> Optional[int]:
    if num_classes is not None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ConfigError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        return num_classes
    factory = _factory(model)
    try:
        params = inspect.signature(factory).parameters if callable(factory) else {}
    except (TypeError, ValueError):
        params = {}
    takes = "num_classes" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes or (isinstance(factory, str) and ":" not in factory):
        raise ConfigError("the model takes num_classes; give the mod num_classes= (otherwise the class count is read "
                          "from the model's output)")
    return None


#: the config fields the mod takes as options (the others describe the simulated federation
#: that a real one replaces: its data, its training between rounds, its utility run)
MOD_FIELDS = ("defense", "defense_args", "model_args", "model_normalize", "lr", "local_lr", "local_steps",
              "local_epochs", "local_batch_size", "local_optimizer", "client_mode", "share_labels", "attacks",
              "attack_args", "budget", "thresholds", "defense_timeout", "out", "seed", "device")
#: where a round's audit differs from ``gia-audit audit``'s defaults: no defense of its own (the mod
#: mirrors the client's), the model's raw inputs, a fixed budget (no control to search on), the
#: round's images only, no utility run, no progress bar, no limit per defense call (the round's
#: ``timeout`` bounds its whole audit)
MOD_DEFAULTS = dict(defense="none", model_normalize="none", budget=DEFAULT_BUDGET, out="flower-audit", images=1,
                    utility=False, progress=False, steps=(1,), defense_timeout=None)


@dataclass(frozen=True)
class ModSettings:
    """Everything the audit of one round needs besides the round's state and data: ``config``,
    the audit's config (:class:`~audit.engine.config.AuditConfig`, the mod's options over
    :data:`MOD_DEFAULTS`), and the mod's own options (see
    :class:`~audit.integrations.flower.mod.AuditMod` for each)."""

    rounds: Tuple[int, ...]
    config: AuditConfig
    num_classes: Optional[int]
    reference: int
    blocking: bool
    timeout: float
    threads: int
    arrays_key: Optional[str]
    round_key: str
    data_arity: int = 1
    input_shape: Optional[Tuple[int, int, int]] = None

    # the engine's sections of the config, as the worker and the job read them
    model = property(lambda self: self.config.sections().model)
    data = property(lambda self: self.config.sections().data_settings)
    fl = property(lambda self: self.config.sections().fl_settings)
    attacks = property(lambda self: self.config.sections().attack_settings)
    output = property(lambda self: self.config.sections().output_settings)
    defense = property(lambda self: self.config.defense)
    defense_args = property(lambda self: dict(self.config.defense_args or {}))
    seed = property(lambda self: self.config.seed)
    device = property(lambda self: self.config.device)

    @property
    def lr(self) -> float:
        """The client's local learning rate."""
        return self.fl.lr

    @property
    def out(self) -> Path:
        return Path(self.output.out)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


#: the CLI's names in the engine's messages -> the mod's options
MOD_TERMS = {"--model-arg": "model_args=", "--model ": "model= ", "--local-steps": "local_steps=",
             "--local-epochs": "local_epochs=", "--local-batch-size": "local_batch_size=",
             "--local-optimizer": "local_optimizer=", "--client-mode": "client_mode=", "--shares": "shares="}


def in_mod_terms(err: BaseException) -> ConfigError:
    """``err`` as a one-line ConfigError that names the mod's options instead of the CLI's."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    for cli_name, option in MOD_TERMS.items():
        text = text.replace(cli_name, option)
    return ConfigError(text)


def _data_arity(data: Any) -> int:
    """How many arguments ``data`` takes: 1 (``data(context)``) or 2 (``data(context, round)``)."""
    if not callable(data):
        raise ConfigError("data must be a callable taking Flower's Context (and optionally the round) and returning "
                          "(images, labels, trained): images (N, C, H, W) in [0, 1], labels (N,), trained the rows the "
                          "round trained on")
    try:
        params = [p for p in inspect.signature(data).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return 1
    if len(params) not in (1, 2):
        raise ConfigError(f"data takes {len(params)} arguments; give data(context) or data(context, round)")
    return len(params)


def _learning_rate(lr: Optional[float], local_lr: Optional[float]) -> float:
    if lr is not None and local_lr is not None and float(lr) != float(local_lr):
        raise ConfigError(f"lr={lr} and local_lr={local_lr} name the same learning rate; give one")
    return client_lr(DEFAULT_LR if lr is None else lr, local_lr)


#: the mod's own options besides the config's fields (:data:`MOD_FIELDS`)
MOD_OPTIONS = ("rounds", "model", "data", "num_classes", "input_shape", "reference", "blocking", "timeout",
               "threads", "arrays_key", "round_key")


def mod_settings(*, rounds, model, data: Callable, lr: Optional[float] = None, num_classes: Optional[int] = None,
                 input_shape: Optional[Sequence[int]] = None, reference: int = DEFAULT_REFERENCE,
                 blocking: bool = False, timeout: float = 3600.0, threads: int = 1, arrays_key: Optional[str] = None,
                 round_key: str = "server-round", **fields: Any) -> ModSettings:
    """The mod's options as :class:`ModSettings`, each checked now: ``fields``, the config
    fields of :data:`MOD_FIELDS` over :data:`MOD_DEFAULTS` (``lr`` and ``local_lr`` both name
    the client's learning rate), and the mod's own."""
    from audit.engine.compose import resolve_defense, resolve_device

    unknown = sorted(set(fields) - set(MOD_FIELDS))
    if unknown:
        raise ConfigError(f"unknown AuditMod option(s) {', '.join(unknown)}; valid options: "
                          f"{', '.join(sorted(MOD_FIELDS + MOD_OPTIONS))}")
    arity = _data_arity(data)
    local_lr = fields.pop("local_lr", None)
    values = {**MOD_DEFAULTS, **fields, "model": _factory(model), "lr": _learning_rate(lr, local_lr)}
    try:
        config = make_config(**values)
    except ConfigError as err:
        raise in_mod_terms(err) from None
    defense, defense_args = config.defense, dict(config.defense_args or {})
    if not is_flower_mod(defense):  # a Flower mod is read per round; anything else must resolve now
        resolve_defense(defense, defense_args)
    elif defense_args:
        raise ConfigError("defense_args do not apply to a Flower mod: its settings are read from the mod itself")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    resolve_device(config.device)
    _check_attack_names(config.sections().attack_settings)
    return ModSettings(
        rounds=_rounds(rounds), config=config, num_classes=_check_classes(model, num_classes),
        reference=_positive_int("reference", reference), blocking=bool(blocking), timeout=float(timeout),
        threads=_positive_int("threads", threads), arrays_key=arrays_key, round_key=str(round_key),
        data_arity=arity, input_shape=_shape(input_shape))


def _shape(shape: Optional[Sequence[int]]) -> Optional[Tuple[int, int, int]]:
    if shape is None:
        return None
    try:
        out = tuple(int(v) for v in shape)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3 or min(out) < 1:
        raise ConfigError(f"input_shape must be (channels, height, width), got {shape!r}")
    return out


def deployment_model(settings: "ModSettings"):
    """The deployment's network as the factory builds it (``nn.Module``; its weights are the
    round's), under preserved random states; a one-line error naming the mod's options."""
    from audit.core.model_source import MODEL_SOURCES, model_label, source_kind

    spec, args = settings.model.model, settings.model.args
    factory = import_attr(spec, "model") if isinstance(spec, str) and ":" in spec else spec
    try:
        takes_shape = callable(factory) and "input_shape" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_shape = False
    if takes_shape and settings.input_shape is None:
        raise ConfigError("the model takes input_shape; give the mod input_shape=(channels, height, width)")
    with preserved_random_state():
        try:
            return MODEL_SOURCES.get(source_kind(spec))(spec, dict(args), settings.input_shape,
                                                        settings.num_classes or 2, model_label(spec))
        except ConfigError as err:
            raise in_mod_terms(err) from None


def _check_attack_names(settings: AttackSettings) -> None:
    import adaptive  # noqa: F401  (registers the adaptive attacks)
    from attacks import ATTACKS

    for name in [*settings.names, *settings.args]:
        if name != "auto":
            ATTACKS.get(name)  # an unknown name raises ConfigError listing the valid ones
