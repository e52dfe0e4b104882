"""One audited step of a report as typed records: each attack's summary, the worst case over
attacks, the verdict, the empirical risk and the positive control's summary.

Every record here is a :class:`~audit.core.manifest.MappingRecord`: its JSON is the flat object
of its fields (an ``optional`` field only when set), keys it does not know are kept in ``extra``
and written back as they were, and it reads as a mapping of that object. A ``report.json``
written before these records therefore reads, renders and writes back unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from audit.core.manifest import MappingRecord


@dataclass(frozen=True, eq=False)  # equal as mappings: the same JSON object
class MetricMeans(MappingRecord):
    """Each metric's mean over the judged images (``aligned_psnr``: each image's best, the leak
    rule's quantity) and the best-recovered image's PSNR (``psnr_max``)."""

    psnr: Optional[float] = None
    ssim: Optional[float] = None
    lpips: Optional[float] = None
    label_acc: Optional[float] = None
    aligned_psnr: Optional[float] = None
    psnr_max: Optional[float] = None
    keeps_none = True


@dataclass(frozen=True, eq=False)
class AttackSummary(MetricMeans):
    """One attack at one step: its :class:`MetricMeans`, ``images_done`` / ``images_ok`` /
    ``images_not_applicable`` of its results, its ``status`` word, ``reason`` when none applies
    (in words), for an input-transforming defense the PSNR against the original and the
    trained-on batch, metrics it could not compute (``unavailable``) and the results that did
    not finish (``problems``)."""

    images_done: int = 0
    images_ok: int = 0
    images_not_applicable: int = 0
    status: str = "pending"
    reason: Optional[str] = None
    psnr_original: Optional[float] = None
    psnr_trained: Optional[float] = None
    unavailable: Optional[Dict[str, str]] = None
    problems: Optional[List[Dict[str, Any]]] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    optional = ("reason", "psnr_original", "psnr_trained", "unavailable", "problems")


@dataclass(frozen=True, eq=False)
class WorstCase(MetricMeans):
    """The worst case over attacks at one step: per private image (``per_image``: its class, the
    attack that carried it, its evidence and chance level, each metric at its most leaking
    attack), then the :class:`MetricMeans` over the judged images, the best SSIM and the largest
    margin over chance."""

    ssim_max: Optional[float] = None
    above_chance_max: Optional[float] = None
    per_image: List[Dict[str, Any]] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class StepBar(MappingRecord):
    """What a step's word needs: ``needed`` of its ``images`` judged images at the per-image class
    (``recovered`` for "leaks", ``partially or worse`` for "partially"), so that a step of images
    that carry nothing private reads the word with probability ``step_rate`` (<= 1 - the report's
    level) when each image reaches the class with probability ``per_image`` (the larger of the
    null items' measured rate's upper bound and, for "partially", the rank bound
    ``partial_rank / K``: ``basis`` says which). ``measured``: the step rate at the null items'
    measured per-image rate and its interval ({"rate", "low", "high"}), with ``similarity``."""

    word: str = ""
    images: int = 0
    needed: int = 1
    per_image: float = 0.0
    basis: str = ""
    step_rate: float = 0.0
    measured: Dict[str, Any] = field(default_factory=dict)
    similarity: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class StepVerdict(MappingRecord):
    """A step's verdict: its ``label`` and ``reason`` (words the report layer writes), the
    image counts with the recovery and identification rates (an interval's JSON object each),
    the attacks with missing evidence, what a step without a recovered image excludes, the
    paired comparison with the control (``defense_effect``), ``attack_power`` (False when the
    control recovered nothing) and what the uploaded buffers did (``buffers``)."""

    label: str = ""
    reason: str = ""
    recovered: int = 0
    exact: int = 0
    partially: int = 0
    not_recovered: int = 0
    images: int = 0
    judged: Optional[str] = None
    failed_attacks: List[Dict[str, Any]] = field(default_factory=list)
    recovery_rate: Dict[str, Any] = field(default_factory=dict)
    identification_rate: Dict[str, Any] = field(default_factory=dict)
    excludes_rate_above: Optional[float] = None
    images_to_exclude: Optional[Dict[str, Any]] = None
    defense_effect: Optional[Dict[str, Any]] = None
    attack_power: Optional[bool] = None
    buffers: Optional[str] = None
    #: what "leaks" and "partially" need over this step's images (:class:`StepBar` JSON objects)
    bars: Optional[List[Dict[str, Any]]] = None
    #: images that met a per-image class but fell short of the step's bar for its word, in words
    short_of: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    keeps_none = True
    optional = ("excludes_rate_above", "images_to_exclude", "defense_effect", "attack_power", "buffers", "bars", "short_of")


@dataclass(frozen=True, eq=False)
class Risk(MappingRecord):
    """The Bayes paper's empirical adversarial risk at radius ``delta``: per attack the fraction
    of images it reconstructs within ``delta`` (``per_attack``), the strongest attack, its
    ``success`` and ``bayes_risk`` = 1 - success; ``reason`` when no attack finished."""

    delta: Optional[float] = None
    strongest_attack: Optional[str] = None
    success: Optional[float] = None
    bayes_risk: Optional[float] = None
    per_attack: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    reason: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    keeps_none = True
    optional = ("reason",)


@dataclass(frozen=True, eq=False)
class ControlSummary(MappingRecord):
    """The positive control at one step: its ``budget``, ``attacks`` and ``description``, the
    attacks that did not apply, whether its evidence is complete (``available``, else
    ``reason``), and when judged its label, ``recovered`` of ``images`` with the rate's
    interval, the images it recovered (``per_image``: each with ``recovered``) and mean PSNR."""

    budget: Optional[int] = None
    attacks: List[str] = field(default_factory=list)
    description: str = ""
    not_applicable: Optional[List[str]] = None
    available: bool = False
    label: Optional[str] = None
    recovered: Optional[int] = None
    images: Optional[int] = None
    recovery_rate: Optional[Dict[str, Any]] = None
    recovered_images: Optional[List[List[int]]] = None
    per_image: Optional[List[Dict[str, Any]]] = None
    mean_psnr: Optional[float] = None
    reason: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    keeps_none = True
    optional = ("not_applicable", "label", "recovered", "images", "recovery_rate", "recovered_images", "per_image",
                "mean_psnr", "reason")


@dataclass(frozen=True, eq=False)
class StepReport(MappingRecord):
    """One audited step of a report, built once from its judged evidence: per attack its
    :class:`AttackSummary`, the :class:`WorstCase`, the :class:`StepVerdict` (qualified by
    the positive control), the :class:`Risk`, the :class:`ControlSummary` (None in a report
    stored before controls) and ``originals``: where the private images' pictures are,
    relative to the report's folder (None: ``originals`` of the run). Its JSON object is the
    step's entry in ``report.json``."""

    step: int
    attacks: Dict[str, AttackSummary] = field(default_factory=dict)
    worst_case: WorstCase = field(default_factory=WorstCase)
    verdict: StepVerdict = field(default_factory=StepVerdict)
    risk: Risk = field(default_factory=Risk)
    control: Optional[ControlSummary] = None
    originals: Optional[str] = None
    extra: Dict[str, Any] = field(default_factory=dict)
    keeps_none = True
    optional = ("originals",)

    def __post_init__(self):
        sections = {"attacks": {a: AttackSummary.from_dict(s) for a, s in (self.attacks or {}).items()},
                    "worst_case": WorstCase.from_dict(self.worst_case), "verdict": StepVerdict.from_dict(self.verdict),
                    "risk": Risk.from_dict(self.risk),
                    "control": None if self.control is None else ControlSummary.from_dict(self.control)}
        for name, value in sections.items():
            object.__setattr__(self, name, value)

    @property
    def label(self) -> str:
        """The step's verdict label."""
        return self.verdict.label

    @property
    def per_image(self) -> List[Dict[str, Any]]:
        """The worst case's entry per private image."""
        return self.worst_case.per_image
