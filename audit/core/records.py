"""Typed result records written by the engine and read by the report.

Statuses and verdict labels are enums whose values are the words stored in JSON and
printed in reports; evidence records are dataclasses with ``to_dict`` / ``from_dict`` so the
store keeps plain JSON while every floor above it handles typed values.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional


class Status(str, Enum):
    """What became of one (step, attack, image) result."""

    OK = "ok"
    NOT_APPLICABLE = "not_applicable"
    ERROR = "error"
    FAILED_TO_OPTIMISE = "failed_to_optimise"


class ImageClass(str, Enum):
    """How much of one private image the strongest attack recovered, judged against chance."""

    RECOVERED = "recovered"
    PARTIAL = "partially recovered"
    NOT_RECOVERED = "not recovered"


class Verdict(str, Enum):
    """A step's or the audit's verdict. Missing evidence is never ``PRIVATE``."""

    LEAKS = "leaks"
    PARTIALLY = "partially"
    PRIVATE = "no recovered image"
    INCOMPLETE = "incomplete"
    NOT_JUDGED = "not judged"


#: how bad a judged verdict is for the defender; "not judged" is listed, never ranked
SEVERITY = {Verdict.LEAKS: 3, Verdict.PARTIALLY: 2, Verdict.INCOMPLETE: 1, Verdict.PRIVATE: 0}


class _Record:
    """``to_dict`` / ``from_dict`` for the dataclasses below (unknown keys are ignored)."""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Dict[str, Any]):
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in (data or {}).items() if k in names})


@dataclass(frozen=True)
class ImageEvidence(_Record):
    """One reconstructed image against its private image: PSNR after the per-channel gain and
    offset fit (dB), and the private image's rank among ``candidates`` (1 = identified);
    ``chance_level`` only for a reference whose null the audit does not store (the batch an
    input-transforming defense trained on)."""

    aligned_psnr: float
    rank: int
    candidates: int
    chance_level: Optional[float] = None


@dataclass(frozen=True)
class NullEvidence(_Record):
    """What guesses made without the shared update score against one private image.

    ``scores[i]`` (aligned PSNR) and ``ranks[i]`` (rank among the candidates, with item ``i``
    itself left out of them) are null item ``names[i]`` fed to the rule as a reconstruction.
    """

    names: List[str]
    scores: List[float]
    ranks: List[int]
    candidates: int
    pool: int
    similarity: str

    @property
    def chance_level(self) -> float:
        """The best aligned PSNR any null item reaches on this image."""
        return max(self.scores)

    def chance_level_without(self, item: int) -> float:
        """The chance level with null item ``item`` left out (to judge that item fairly)."""
        return max(s for i, s in enumerate(self.scores) if i != item)


@dataclass(frozen=True)
class Interval(_Record):
    """``k`` of ``n`` with its exact (Clopper-Pearson) two-sided interval at ``level``."""

    k: int
    n: int
    low: float
    high: float
    level: float = 0.95

    @property
    def rate(self) -> Optional[float]:
        return self.k / self.n if self.n else None

    def text(self) -> str:
        if not self.n:
            return "0 of 0"
        return f"{self.k} of {self.n} ({self.rate:.0%}; {self.level:.0%} CI {self.low:.1%}-{self.high:.1%})"


@dataclass(frozen=True)
class ImageJudgement(_Record):
    """One private image of a step: its class, the attack that carried it, its evidence."""

    image: int
    index: int
    image_class: Optional[str]
    best_attack: Optional[str]
    aligned_psnr: Optional[float]
    rank: Optional[int]
    chance_level: Optional[float]
    candidates: Optional[int]
    metrics: Dict[str, Optional[float]] = field(default_factory=dict)
