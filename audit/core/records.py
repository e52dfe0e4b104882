"""Typed result records written by the engine and read by the report.

Statuses and verdict labels are enums whose values are the words stored in JSON and
printed in reports; evidence records are dataclasses with ``to_dict`` / ``from_dict`` so the
store keeps plain JSON while every floor above it handles typed values.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional, Tuple

from audit.core.reasons import Reason
from audit.core.step_records import StepReport  # noqa: F401  (re-exported: a report's step)
from audit.core.trace import Trace


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
    #: the defended run recovered nothing, but neither did the same attacks without the
    #: defense (the positive control): the audit measured its attacks, not the defense
    INCONCLUSIVE = "inconclusive"
    NOT_JUDGED = "not judged"


#: how bad a verdict is for the defender, worst first: every verdict that lacks evidence
#: ranks above "no recovered image", so an overall verdict never reads private while any
#: step is incomplete, inconclusive or not judged
SEVERITY = {Verdict.LEAKS: 5, Verdict.PARTIALLY: 4, Verdict.INCOMPLETE: 3, Verdict.INCONCLUSIVE: 2,
            Verdict.NOT_JUDGED: 1, Verdict.PRIVATE: 0}


class _Record:
    """``to_dict`` / ``from_dict`` for the dataclasses below (unknown keys are ignored)."""

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Any):
        if isinstance(data, cls):
            return data
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
        top = max(range(len(self.scores)), key=self.scores.__getitem__)
        if item != top:
            return self.scores[top]
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
        return f"{self.k} of {self.n} ({self.rate:.1%}; {self.level:.0%} CI {self.low:.2%}-{self.high:.2%})"


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


# --------------------------------------------------------------------------- attack results
@dataclass
class Scores(_Record):
    """A reconstruction scored against one reference batch: batch means, per-image values,
    l2 distances per image, and the leak rule's :class:`ImageEvidence` per image."""

    psnr: Optional[float] = None
    ssim: Optional[float] = None
    lpips: Optional[float] = None
    label_acc: Optional[float] = None
    mse: Optional[float] = None
    psnr_per_image: Optional[List[float]] = None
    ssim_per_image: Optional[List[float]] = None
    lpips_per_image: Optional[List[float]] = None
    l2: Optional[List[float]] = None
    evidence: List[ImageEvidence] = field(default_factory=list)

    def __post_init__(self):
        self.evidence = [e if isinstance(e, ImageEvidence) else ImageEvidence.from_dict(e) for e in self.evidence or []]

    def per_image(self, name: str, count: int) -> List[Optional[float]]:
        """One value of metric ``name`` per image: the per-image list, else the batch value for
        each (a batch mean never stands in for a worse image when the list is there)."""
        values = getattr(self, f"{name}_per_image", None)
        if isinstance(values, list) and len(values) == count:
            return [None if v is None else float(v) for v in values]
        value = getattr(self, name, None)
        return [None if value is None else float(value)] * count

    def count(self) -> int:
        """How many images the scored batch had (1 when no per-image list says otherwise)."""
        for values in (self.psnr_per_image, self.ssim_per_image, self.lpips_per_image, self.l2, self.evidence):
            if values:
                return len(values)
        return 1


def _status(value: Any) -> Any:
    """A known status as :class:`Status`; an unknown word stays as it is (read as missing evidence)."""
    try:
        return Status(value)
    except ValueError:
        return value


@dataclass
class AttackResult(_Record):
    """One finished (step, attack, image): what ran, its status, and its scores against the
    private batch (``metrics``) and, for input-transforming defenses, against the batch the
    client trained on (``metrics_trained``). ``why``: a not-applicable result's reason, as a code
    and its values (the report words it); ``reason``: an error's message (and the sentence a
    not-applicable result stored before reasons had codes). Written by the engine, stored as
    JSON by the result store, read by the report."""

    step: int
    attack_id: str
    image: int
    attack: str = ""
    status: Any = Status.OK
    seed: Optional[int] = None
    settings: Dict[str, Any] = field(default_factory=dict)
    defaults: str = ""  # attacks.presets.defaults_fingerprint: what the settings left out ran with
    defense: Optional[str] = None
    budget: Optional[int] = None
    reason: str = ""
    why: Optional[Reason] = None
    failed: Optional[str] = None  # "attack" or "defense" for an error
    metrics: Optional[Scores] = None
    unavailable: Dict[str, str] = field(default_factory=dict)
    metrics_trained: Optional[Scores] = None
    unavailable_trained: Dict[str, str] = field(default_factory=dict)
    trained_reference: Optional[str] = None
    trace: Trace = field(default_factory=Trace)
    time_s: Optional[float] = None
    png: Optional[str] = None

    def __post_init__(self):
        self.status = _status(self.status)
        self.trace = Trace.from_dict(self.trace)
        if self.why is not None:
            self.why = Reason.of(self.why)
        for name in ("metrics", "metrics_trained"):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, Scores.from_dict(value))

    @property
    def effective_status(self) -> Any:
        """The status, with an "ok" whose trace says the optimisation stalled read as
        :attr:`Status.FAILED_TO_OPTIMISE`."""
        return Status.FAILED_TO_OPTIMISE if self.status is Status.OK and self.trace.stalled else self.status

    def references(self) -> List[Scores]:
        """The scores this result has: against the original, and against what the client trained on."""
        return [s for s in (self.metrics, self.metrics_trained) if s is not None]

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["status"] = getattr(self.status, "value", self.status)
        out["trace"] = self.trace.to_dict()
        out["why"] = None if self.why is None else self.why.to_dict()
        return out

    @property
    def not_applicable_reason(self) -> Optional[Reason]:
        """Why a not-applicable result does not apply: its code, else the sentence it stored."""
        if self.why is not None:
            return self.why
        return Reason.of(self.reason) if self.reason else None


# --------------------------------------------------------------------------- utility
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

    def to_dict(self) -> Dict[str, Any]:
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

    def to_dict(self) -> Dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max,
                "seeds": len(self.runs), "runs": [r.to_dict() for r in self.runs]}

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

    def to_dict(self) -> Dict[str, Any]:
        return {"defense": self.defense, "params": self.params, "setting": self.setting,
                "defended": self.defended.to_dict() if self.defended else None,
                "undefended": self.undefended.to_dict() if self.undefended else None,
                "relative": self.relative, "unavailable": self.unavailable}

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> "UtilityResult":
        """The record as :meth:`to_dict` wrote it (derived numbers are recomputed); an empty or
        older record reads as unavailable, with the reason."""
        if not data:
            return cls.missing("not measured")
        if "defended" not in data:
            return cls.missing(data.get("unavailable") or "stored in an older format; rerun to measure it")
        return cls(data.get("defense", ""), dict(data.get("params") or {}), dict(data.get("setting") or {}),
                   AccuracySpread.from_dict(data.get("defended")), AccuracySpread.from_dict(data.get("undefended")),
                   data.get("unavailable") or "")
