"""The utility recipe: how the utility section trains the model with and without the defense
(chosen by measurement: ``bench/bench_utility.py``, ``docs/evidence.md``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict

from audit.core.errors import ConfigError

#: training seeds per arm of a utility measurement
DEFAULT_SEEDS = 3

#: learning-rate factor of round ``k`` of ``n``
SCHEDULES: Dict[str, Callable[[int, int], float]] = {
    "constant": lambda k, n: 1.0,
    "cosine": lambda k, n: 0.5 * (1.0 + math.cos(math.pi * k / n)),
}


@dataclass(frozen=True)
class Protocol:
    """A utility training recipe: ``rounds`` FL rounds over ``clients`` clients, each running
    ``local_steps`` SGD steps (1: FedSGD) on batches of ``batch_size``, at learning rate
    ``lr`` times the ``schedule``'s factor of the round."""

    rounds: int
    lr: float
    batch_size: int
    schedule: str = "cosine"
    clients: int = 1
    local_steps: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown learning-rate schedule {self.schedule!r}; known: {', '.join(SCHEDULES)}")

    def factor(self) -> Callable[[int], float]:
        return lambda k: SCHEDULES[self.schedule](k, self.rounds)

    def recipe_key(self) -> str:
        """Everything but the rounds (which the audit's ``utility_steps`` set), as text."""
        return (f"lr {self.lr!r} {self.schedule}, batch {self.batch_size}, clients {self.clients}, "
                f"local steps {self.local_steps}")

    def text(self) -> str:
        fl = "FedSGD" if self.local_steps == 1 else f"FedAvg ({self.local_steps} local steps)"
        return (f"{self.rounds} rounds of {fl}, {self.clients} client{'s' * (self.clients != 1)}, batch "
                f"{self.batch_size}, lr {self.lr:g} ({self.schedule})")


#: the utility recipe of the audit, the sweep and the papers' bench (chosen by measurement:
#: ``bench/bench_utility.py``, ``docs/evidence.md``)
PROTOCOL = Protocol(rounds=800, lr=0.05, batch_size=16, schedule="cosine")
