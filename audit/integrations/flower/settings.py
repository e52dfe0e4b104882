"""The audit mod's options, validated when the mod is built: a bad option is a one-line
ConfigError naming the fix before the federation starts."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

from audit.core.errors import ConfigError
from audit.core.registry import import_attr
from audit.engine.settings import AttackSettings, DataSettings, FLSettings, ModelSettings, OutputSettings
from audit.integrations.flower.defenses import is_flower_mod

#: unrelated images of the client kept as the null and the attacker's auxiliary data
DEFAULT_REFERENCE = 512


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


@dataclass(frozen=True)
class ModSettings:
    """Everything the audit of one round needs besides the round's state and data (see
    :class:`~audit.integrations.flower.mod.AuditMod` for the meaning of each option)."""

    rounds: Tuple[int, ...]
    model: ModelSettings
    defense: Any
    defense_args: Mapping[str, Any]
    data: DataSettings
    fl: FLSettings
    attacks: AttackSettings
    output: OutputSettings
    num_classes: Optional[int]
    reference: int
    seed: int
    device: str
    blocking: bool
    timeout: float
    threads: int
    arrays_key: Optional[str]
    round_key: str

    @property
    def out(self) -> Path:
        return Path(self.output.out)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def mod_settings(*, rounds, model, data: Callable, defense: Any = "none", defense_args=None, lr: float = 0.1,
                 images: int = 1, batch_size: int = 1, budget: int = 200, attacks: Any = "auto",
                 attack_args=None, thresholds=None, device: str = "cpu", out="flower-audit", seed: int = 0,
                 model_args=None, model_normalize: Any = "none", num_classes: Optional[int] = None,
                 client_mode: str = "train", share_labels: bool = False, reference: int = DEFAULT_REFERENCE,
                 blocking: bool = False, timeout: float = 3600.0, threads: int = 1, defense_timeout=None,
                 arrays_key: Optional[str] = None, round_key: str = "server-round") -> ModSettings:
    """The mod's options as :class:`ModSettings`, each checked now."""
    from audit.engine.compose import resolve_defense, resolve_device

    if not callable(data):
        raise ConfigError("data must be a callable taking Flower's Context and returning the client's (images, "
                          "labels): images (N, C, H, W) in [0, 1], labels (N,) class indices")
    if not is_flower_mod(defense):  # a Flower mod is read per round; anything else must resolve now
        resolve_defense(defense, dict(defense_args or {}))
    elif defense_args:
        raise ConfigError("defense_args do not apply to a Flower mod: its settings are read from the mod itself")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    resolve_device(device)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    attack_settings = AttackSettings(steps=(1,), names=attacks, args=attack_args or {}, budget=budget)
    _check_attack_names(attack_settings)
    return ModSettings(
        rounds=_rounds(rounds), model=ModelSettings(_factory(model), model_args or {}, model_normalize),
        defense=defense, defense_args=dict(defense_args or {}),
        data=DataSettings(images=images, batch_size=batch_size, share_labels=share_labels),
        fl=FLSettings(lr=lr, client_mode=client_mode), attacks=attack_settings,
        output=OutputSettings(out=out, utility=False, thresholds=thresholds, progress=False,
                              defense_timeout=defense_timeout),
        num_classes=_check_classes(model, num_classes), reference=_positive_int("reference", reference),
        seed=seed, device=str(device), blocking=bool(blocking), timeout=float(timeout),
        threads=_positive_int("threads", threads), arrays_key=arrays_key, round_key=str(round_key))


def _check_attack_names(settings: AttackSettings) -> None:
    import adaptive  # noqa: F401  (registers the adaptive attacks)
    from attacks import ATTACKS

    for name in [*settings.names, *settings.args]:
        if name != "auto":
            ATTACKS.get(name)  # an unknown name raises ConfigError listing the valid ones
