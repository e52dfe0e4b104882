"""The leak rule: when a reconstructed image counts as recovered, calibrated to chance.

One place for the thresholds and their wording; ``gia-audit audit --thresholds`` and
``gia-audit report --thresholds`` set them (the report re-renders without recomputing,
since every record stores its evidence and the manifest the null's). Why this rule and how
it was measured: ``docs/evidence.md``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Dict, Iterable, Optional, Tuple

from audit.core.errors import ConfigError
from audit.core.evidence import binomial_tail, clopper_pearson, images_needed
from audit.core.records import ImageClass, Interval, NullEvidence
from audit.core.step_records import StepBar


@dataclass(frozen=True)
class LeakRule:
    """Per private image, with ``score`` its aligned PSNR, ``chance`` the best aligned PSNR of
    any null guess on that image, and ``rank`` its rank among K candidates:

    * recovered: ``score >= chance + margin_db`` and ``rank <= identify_rank``;
    * partially recovered: ``score >= chance`` and ``rank <= partial_rank``;
    * not recovered otherwise.
    """

    margin_db: float = 1.0
    identify_rank: int = 1
    partial_rank: int = 3
    level: float = 0.95  # of every interval the report prints
    #: an image recovered by an attack whose reconstruction reproduces the upload within this
    #: relative error (the attack's certificate, e.g. SPEAR's) is labelled "exact"
    exact_error: float = 1e-3
    #: so is one at this aligned PSNR or above against its private image: the auditor's own measure,
    #: for attacks whose certificate is loose where the image is not (conv-span under train-mode
    #: BatchNorm reproduces the upload to ~1e-2 from images exact to 85-107 dB); None: the certificate
    #: alone (a rule stored before this threshold reads so, and its report renders as written)
    exact_db: Optional[float] = 40.0
    #: a step's words calibrated as a whole (:meth:`step_bars`); False: one image at a class makes the
    #: word (a rule stored before the calibration reads so, and its report renders as written)
    calibrated: bool = True

    def __post_init__(self):
        if not self.margin_db >= 0:
            raise ConfigError(f"thresholds: margin_db must be >= 0 dB, got {self.margin_db}")
        if not 1 <= self.identify_rank <= self.partial_rank:
            raise ConfigError(f"thresholds: need 1 <= identify_rank <= partial_rank, got "
                              f"{self.identify_rank} and {self.partial_rank}")
        if not 0 < self.exact_error < 1:
            raise ConfigError(f"thresholds: exact_error must be in (0, 1), got {self.exact_error}")
        if self.exact_db is not None and not self.exact_db > 0:
            raise ConfigError(f"thresholds: exact_db must be > 0 dB, got {self.exact_db}")
        if not 0.5 <= self.level < 1:
            raise ConfigError(f"thresholds: level must be in [0.5, 1), got {self.level}")

    def classify(self, score: Optional[float], rank: Optional[int], chance: Optional[float]) -> Optional[ImageClass]:
        """The image's class, or None when its evidence is missing (never 'not recovered')."""
        if score is None or rank is None or chance is None:
            return None
        if score >= chance + self.margin_db and rank <= self.identify_rank:
            return ImageClass.RECOVERED
        if score >= chance and rank <= self.partial_rank:
            return ImageClass.PARTIAL
        return ImageClass.NOT_RECOVERED

    def exact(self, image_class: Optional[ImageClass], certificate_error: Optional[float],
              aligned_psnr: Optional[float] = None) -> bool:
        """A recovered image whose attack's reconstruction reproduces the upload within
        ``exact_error``, or that matches its private image to ``exact_db`` (aligned); missing
        evidence is never exact."""
        if image_class is not ImageClass.RECOVERED:
            return False
        certified = certificate_error is not None and 0 <= certificate_error <= self.exact_error
        return certified or (self.exact_db is not None and aligned_psnr is not None
                             and aligned_psnr >= self.exact_db)

    def describe(self) -> str:
        return (
            f"an image counts as recovered if its reconstruction's PSNR after the best per-channel gain and offset "
            f"beats the image's chance level (the best any guess made without the shared update reaches on it: "
            f"unrelated images of the data set and data-only guesses) by at least {self.margin_db:g} dB and it "
            f"identifies its private image (rank <= {self.identify_rank} among the K candidates: the private image "
            f"and K-1 unrelated ones); as partially recovered if it reaches the chance level and ranks <= "
            f"{self.partial_rank}; as not recovered otherwise. A recovered image is 'exact' where its attack's "
            f"reconstruction reproduces the upload within a relative error of {self.exact_error:g}"
            f"{'' if self.exact_db is None else f' or its aligned PSNR reaches {self.exact_db:g} dB'}. "
            + (self._calibrated_words() if self.calibrated else
               "A step 'leaks' if any image is recovered; is 'incomplete' (naming the attacks) if any planned attack "
               "raised, failed to optimise, has no evidence or has not run; is 'partially' if any image is partially "
               "recovered, and has 'no recovered image' otherwise; a step where no attack applies is 'not judged'. "
               "The overall verdict is the worst judged step.")
        )

    def _calibrated_words(self) -> str:
        return ("A step 'leaks' if an image is exact or more images are recovered than images that carry nothing "
                f"private would reach at the report's level ({1 - self.level:.0%} of such steps; the per-image rate "
                "is the upper bound of the null items' measured rate, at most the rank bound "
                f"{self.identify_rank}/K); is 'incomplete' (naming the attacks) if any planned attack raised, failed "
                "to optimise, has no evidence or has not run; is 'partially' if more images are partially recovered "
                "or better than such images would reach (the per-image rate is the rank bound "
                f"{self.partial_rank}/K, which holds whatever similarity ranks the candidates, unless the null items' "
                "measured rate is higher), and has 'no recovered image' otherwise; a step where no attack applies is "
                "'not judged'. The overall verdict is the worst judged step.")

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "rule": self.describe()}

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> "LeakRule":
        if "rule" in (data or {}):  # a rule a report stored
            return cls.stored(data)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in (data or {}).items() if k in names})

    @classmethod
    def stored(cls, data: Optional[Dict[str, Any]]) -> "LeakRule":
        """The rule a manifest or report stored: one stored before the PSNR threshold existed
        labels exact by the certificate alone, so its report renders as it was written."""
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in (data or {}).items() if k in names}
        return cls(**{"exact_db": None, "calibrated": False, **data})

    @classmethod
    def of(cls, value: Any) -> "LeakRule":
        """A rule from a LeakRule, a dict of its fields, ``"margin_db=2,..."`` text, or None (the default)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, dict):
            return cls.from_dict(value)
        if isinstance(value, str):
            return cls().with_text(value)
        raise ConfigError(f"thresholds must be a LeakRule, a dict or 'name=value,...' text, got {type(value).__name__}")

    def with_text(self, text: Optional[str]) -> "LeakRule":
        """This rule with ``"margin_db=2,partial_rank=5"`` applied (the CLI's ``--thresholds``)."""
        if not text:
            return self
        kinds = {f.name: f.type for f in fields(self)}
        changes: Dict[str, Any] = {}
        for part in text.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in kinds:
                raise ConfigError(f"--thresholds takes name=value pairs separated by commas, names: "
                                  f"{', '.join(kinds)}; got {part!r}")
            try:
                changes[name] = (int(value) if name.endswith("rank") else value.strip().lower() in ("1", "true", "yes")
                                 if name == "calibrated" else float(value))
            except ValueError:
                raise ConfigError(f"--thresholds {name}: {value!r} is not a number") from None
        return replace(self, **changes)

    # ------------------------------------------------------------------ calibration
    def false_positives(self, nulls: Iterable[NullEvidence]) -> Tuple[Interval, Interval]:
        """The rule applied to every null item of every private image as if it were the
        reconstruction, leave-one-out (each item against the chance level of the others):
        the rate of 'recovered' and of 'partially recovered or worse', with intervals."""
        recovered = partial = total = 0
        for null in nulls:
            for item, (score, rank) in enumerate(zip(null.scores, null.ranks)):
                found = self.classify(score, rank, null.chance_level_without(item))
                total += 1
                recovered += found is ImageClass.RECOVERED
                partial += found in (ImageClass.RECOVERED, ImageClass.PARTIAL)
        return self.interval(recovered, total), self.interval(partial, total)

    def step_bars(self, images: int, measured: Tuple[Interval, Interval], candidates: Optional[int],
                  similarity: Optional[str] = None) -> Tuple[StepBar, StepBar]:
        """What "leaks" and "partially" need of ``images`` judged images: the fewest images whose
        count a step of images carrying nothing private reaches with probability at most
        ``1 - level``, from a per-image rate for each class.

        Under that null each image's rank among K is uniform, so a class that needs rank <= r
        has a per-image rate of at most r / K whatever the similarity and the attack (the rank
        bound). "Recovered" also needs the chance level beaten by ``margin_db``: the null items
        measure that bar, each judged against the best of the others (``measured``, its upper
        bound), and the rank bound caps it. "Partially" needs only the chance level reached, which
        an uninformative attack output meets often and the null items cannot measure, so its rate
        is the rank bound unless the null items' measured rate is higher."""
        alpha = 1.0 - self.level
        bars = []
        for word, rate, rank in (("leaks", measured[0], self.identify_rank),
                                 ("partially", measured[1], self.partial_rank)):
            ranked = rank / candidates if candidates else 1.0
            if word == "leaks":  # the null items' upper bound, capped by the rank bound
                seen, how = (rate.high, "null items, upper bound") if rate.n else (1.0, "no null")
                use_rank = ranked < seen
            else:  # the rank bound, unless the null items reach the class more often
                seen, how = (rate.rate or 0.0, "null items, measured") if rate.n else (1.0, "no null")
                use_rank = ranked >= seen
            bound, basis = ((ranked, f"rank bound ({rank} of K = {candidates})") if use_rank and candidates
                            else (seen, how))
            needed = images_needed(images, bound, alpha)
            at = (lambda p: binomial_tail(images, p, needed))
            bars.append(StepBar(word=word, images=images, needed=needed, per_image=bound, basis=basis,
                                step_rate=at(bound), similarity=similarity,
                                measured={"rate": at(rate.rate or 0.0), "low": at(rate.low), "high": at(rate.high),
                                          "per_image": rate.to_dict()} if rate.n else {}))
        return bars[0], bars[1]

    def interval(self, k: int, n: int) -> Interval:
        low, high = clopper_pearson(k, n, self.level)
        return Interval(k, n, low, high, self.level)
