"""The audited client's training, as one frozen record: what the client runs between receiving
the global model and uploading (optimiser, steps or epochs, learning rate, local mini-batch,
the mode it runs the model in) and what it uploads. Built and checked once (from the CLI,
``audit.run`` or the Flower mod's options, through :class:`~audit.engine.settings.FLSettings`)
and passed whole to the client round (:func:`audit.client.observe.client_round`), the FL
trainer between audited steps and the Flower fidelity replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from audit.core.errors import ConfigError
from audit.core.local_training import LocalOptimizer
from audit.core.unroll import steps_for_epochs

CLIENT_MODES = ("train", "eval")

#: what a client uploads: its defended gradient (FedSGD), its update after local training
#: (weights only), or that update with its buffers (the state a PyTorch client sends)
SHARES = ("gradient", "update", "state")


def resolve_shares(shares: Optional[str], local_steps: int, optimizer: LocalOptimizer) -> str:
    """``shares`` checked against the local training (None: ``"gradient"`` for one plain SGD
    step, ``"update"`` otherwise); a gradient cannot be shared after local training."""
    trains = local_steps > 1 or not optimizer.plain
    if shares is None:
        return "update" if trains else "gradient"
    if shares not in SHARES:
        raise ConfigError(f"shares must be one of {', '.join(SHARES)}, got {shares!r}")
    if shares == "gradient" and trains:
        raise ConfigError(f"a client that trains locally ({local_steps} step(s) of {optimizer.describe()}) uploads "
                          "an update, not a gradient: use shares='update' or 'state' (--shares update|state)")
    return shares


def _count(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or not float(value).is_integer():
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def client_lr(lr: float, local_lr: Optional[float]) -> float:
    """The one place that decides the client's learning rate: ``local_lr`` if given, else ``lr``."""
    return lr if local_lr is None else local_lr


@dataclass(frozen=True)
class ClientTraining:
    """``steps`` local steps (or ``epochs`` over the private batch in mini-batches of
    ``batch_size``; None: the whole batch each step) of ``optimizer`` at learning rate ``lr``,
    with the model in ``mode`` ("train" / "eval"); ``shares``: "gradient", "update" or "state"
    (None: gradient for one plain step, else update). Invalid values are a ConfigError now."""

    optimizer: Any = "sgd"
    steps: int = 1
    epochs: Optional[int] = None
    lr: float = 0.1
    batch_size: Optional[int] = None
    shares: Optional[str] = None
    mode: str = "train"

    def __post_init__(self):
        set_ = lambda **kv: [object.__setattr__(self, k, v) for k, v in kv.items()]  # noqa: E731
        if self.mode not in CLIENT_MODES:
            raise ConfigError(f"client_mode must be 'train' or 'eval', got {self.mode!r}")
        if self.epochs is not None and self.steps != 1:
            raise ConfigError("give local_steps or local_epochs, not both (--local-steps / --local-epochs)")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ConfigError(f"local_lr must be a positive number, got {self.lr!r}")
        set_(optimizer=LocalOptimizer.parse(self.optimizer), steps=_count("local_steps", self.steps),
             epochs=_count("local_epochs", self.epochs), batch_size=_count("local_batch_size", self.batch_size),
             lr=float(self.lr))
        if self.shares == "gradient" and self.trains:
            raise ConfigError(f"a client that trains locally ({self.steps_text()} of {self.optimizer.describe()}) "
                              "uploads an update, not a gradient: use shares='update' or 'state' (--shares update|state)")
        set_(shares=resolve_shares(self.shares, 2 if self.trains else 1, self.optimizer))

    @property
    def trains(self) -> bool:
        """Whether the client trains locally (several steps, epochs or an optimiser other than plain SGD)."""
        return self.epochs is not None or self.steps > 1 or not self.optimizer.plain

    def steps_for(self, batch_size: int) -> int:
        """Local steps on a private batch of ``batch_size`` images."""
        return self.steps if self.epochs is None else steps_for_epochs(self.epochs, batch_size, self.batch_size)

    def steps_text(self) -> str:
        return f"{self.epochs} local epoch(s)" if self.epochs is not None else f"{self.steps} local step(s)"

    def describe(self) -> str:
        """The training in one phrase, for reports."""
        batch = "" if self.batch_size is None else f", mini-batches of {self.batch_size}"
        return f"{self.steps_text()} of {self.optimizer.describe()} at lr {self.lr:g}{batch}; uploads its {self.shares}"
