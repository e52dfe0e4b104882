"""Typed result records written by the engine and read by the report."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple


# --- utility
@dataclass(frozen=True)
class TrainingRun:
    """One utility training run (one seed): the test accuracy of the model it left.

    ``diverged_at``: the FL round (0-based) at which training diverged: its shared update was
    not finite, or the parameters after it were not, or (a run that went on to the end) its
    training loss was not. ``accuracy`` is then that of the model the run left, ``note``
    saying how examples with non-finite outputs were scored. ``error``: the defense failed
    (it raised, or returned wrong shapes): no accuracy."""

    seed: int
    accuracy: Optional[float] = None
    final_loss: Optional[float] = None
    seconds: float = 0.0
    diverged_at: Optional[int] = None
    note: str = ""
    error: str = ""

    def as_dict(self) -> Dict[str, Any]:
        return {"seed": self.seed, "accuracy": self.accuracy, "final_loss": self.final_loss,
                "seconds": self.seconds, "diverged_at": self.diverged_at, "note": self.note, "error": self.error}


@dataclass(frozen=True)
class AccuracySpread:
    """The same training over several seeds: per-seed runs and their spread. ``std`` is the
    sample standard deviation (None below two accuracies: the spread is not known)."""

    runs: Tuple[TrainingRun, ...] = ()

    @property
    def accuracies(self) -> List[float]:
        return [r.accuracy for r in self.runs if r.accuracy is not None]

    @property
    def mean(self) -> Optional[float]:
        acc = self.accuracies
        return math.fsum(acc) / len(acc) if acc else None

    @property
    def std(self) -> Optional[float]:
        acc = self.accuracies
        return statistics.stdev(acc) if len(acc) >= 2 else None

    @property
    def min(self) -> Optional[float]:
        return min(self.accuracies, default=None)

    @property
    def max(self) -> Optional[float]:
        return max(self.accuracies, default=None)

    @property
    def final_loss(self) -> Optional[float]:
        losses = [r.final_loss for r in self.runs if r.final_loss is not None and math.isfinite(r.final_loss)]
        return math.fsum(losses) / len(losses) if losses else None

    @property
    def seconds(self) -> float:
        return math.fsum(r.seconds for r in self.runs)

    @property
    def diverged(self) -> List[TrainingRun]:
        return [r for r in self.runs if r.diverged_at is not None]

    @property
    def error(self) -> str:
        """The first failed run's reason ('' when every run has an accuracy)."""
        return next((r.error for r in self.runs if r.error), "")

    def as_dict(self) -> Dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max,
                "seeds": len(self.runs), "runs": [r.as_dict() for r in self.runs]}

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> Optional["AccuracySpread"]:
        if not data:
            return None
        return cls(tuple(TrainingRun(**run) for run in data.get("runs", ())))


@dataclass(frozen=True)
class UtilityResult:
    """Test accuracy after training with the defense (``defended``) and without it
    (``undefended``), the same seeds for both; ``unavailable`` says why nothing was measured."""

    defense: str = ""
    params: Dict[str, Any] = field(default_factory=dict)
    setting: Dict[str, Any] = field(default_factory=dict)
    defended: Optional[AccuracySpread] = None
    undefended: Optional[AccuracySpread] = None
    unavailable: str = ""

    @classmethod
    def missing(cls, reason: str) -> "UtilityResult":
        return cls(unavailable=reason)

    @property
    def relative(self) -> Optional[float]:
        """Mean defended accuracy / mean undefended accuracy."""
        a = self.defended.mean if self.defended else None
        b = self.undefended.mean if self.undefended else None
        return a / b if a is not None and b else None

    def as_dict(self) -> Dict[str, Any]:
        return {"defense": self.defense, "params": self.params, "setting": self.setting,
                "defended": self.defended.as_dict() if self.defended else None,
                "undefended": self.undefended.as_dict() if self.undefended else None,
                "relative": self.relative, "unavailable": self.unavailable}

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "UtilityResult":
        """The record as :meth:`as_dict` wrote it (derived numbers are recomputed); an empty or
        older record reads as unavailable, with the reason."""
        if not data:
            return cls.missing("not measured")
        if "defended" not in data:
            return cls.missing(data.get("unavailable") or "stored in an older format; rerun to measure it")
        return cls(data.get("defense", ""), dict(data.get("params") or {}), dict(data.get("setting") or {}),
                   AccuracySpread.from_dict(data.get("defended")), AccuracySpread.from_dict(data.get("undefended")),
                   data.get("unavailable") or "")
