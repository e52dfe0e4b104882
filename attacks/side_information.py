"""Side information an observation shares beyond its gradient, turned into attack terms.

Today: the private batch's BatchNorm statistics that a client's uploaded buffers reveal
(``shares="state"``, :mod:`audit.core.buffers`). Every optimisation attack (``ig``, ``gi``,
the portfolio's strategies, the adaptive attacks built on :class:`~attacks.optimization.
OptimizationAttack`, the generative attacks' scorer) adds the :class:`~priors.batchnorm.
UploadedBatchNormStatistics` term when the observation has them, weighted by
:func:`upload_weight` unless the attack sets ``bn_upload``; where it does not apply, the
trace says why (``side_information``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from audit.core.buffers import RevealedStatistics, upload_statistics
from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.core.types import Observation
from priors import UploadedBatchNormStatistics

#: the bn-upload term's weight on the ConvNet's :data:`BN_UPLOAD_LAYERS` BatchNorm layers (the
#: term is in units of the revealed variance and averages its layers): the best mean PSNR of
#: ``ig`` over weights 0.1-10 on held-out embedded images at batch sizes 1 and 4
#: (``bench/bench_strength.py --bn-weight``; bench/results/strength/strength.md (The weights of what a client uploads))
BN_UPLOAD_WEIGHT = 3.0
BN_UPLOAD_LAYERS = 5


def upload_weight(layers: int) -> float:
    """The term's default weight for ``layers`` revealed BatchNorm layers: every layer weighs
    what one of the ConvNet's does (the term averages its layers, so a deeper model's early
    layers, which pin the image's contrast and colour, would otherwise count less); measured
    on held-out images with ResNet-18's 20 layers (``--bn-weight --bn-weight-model``)."""
    return BN_UPLOAD_WEIGHT * layers / BN_UPLOAD_LAYERS


@dataclass
class SideInformation:
    """What an attack run uses beyond the gradient: extra ``(key, prior, weight)`` terms, the
    revealed statistics (None when not used), a note per item (a :class:`Reason` the report
    words, or the attack's own line for people reading the trace), and ``used``: the codes of the
    items the run matches (:data:`audit.core.trace.SIDE_INFORMATION`), which is what the engine
    and the report decide from."""

    priors: List[Tuple[str, Any, float]]
    revealed: Optional[RevealedStatistics]
    notes: Dict[str, Union[Reason, str]]
    used: List[str] = field(default_factory=list)

    def traced(self) -> Dict[str, Any]:
        """The notes as the trace stores them (a reason as its JSON object)."""
        return {k: v.to_dict() if isinstance(v, Reason) else v for k, v in self.notes.items()}

    def use(self, code: str, note: str) -> None:
        """Mark ``code`` as matched by the run, with its note."""
        self.notes[code] = note
        if code not in self.used:
            self.used.append(code)

    def drop(self, code: str, note: str) -> None:
        """Mark ``code`` as not matched by the run, with why."""
        self.notes[code] = note
        if code in self.used:
            self.used.remove(code)

    def tensors(self) -> List[Any]:
        return [] if self.revealed is None else self.revealed.tensors()


def check_weight(weight: Union[str, float, None]) -> Union[str, float]:
    """``"auto"`` / None (the measured default) or a number >= 0 (0: off)."""
    if weight is None or weight == "auto":
        return "auto"
    try:
        value = float(weight)
    except (TypeError, ValueError):
        raise ConfigError(f"bn_upload must be 'auto' or a weight >= 0, got {weight!r}") from None
    if value < 0:
        raise ConfigError(f"bn_upload must be 'auto' or a weight >= 0, got {weight!r}")
    return value


def side_information(observation: Observation, weight: Union[str, float]) -> SideInformation:
    """The side-information terms for an attack on ``observation`` (``weight``: ``bn_upload``)."""
    revealed, why = upload_statistics(observation)
    if revealed is None:
        return SideInformation([], None, {"bn-upload": Reason("bn-upload-unused", why=why.to_dict())})
    if weight == 0:
        return SideInformation([], None, {"bn-upload": Reason("bn-upload-off")})
    value = upload_weight(len(revealed.layers)) if weight == "auto" else float(weight)
    note = Reason("bn-upload-used", weight=value, **revealed.reason().params)
    return SideInformation([("bn-upload", UploadedBatchNormStatistics(), value)], revealed, {"bn-upload": note},
                           ["bn-upload"])


def revealed_for_member(template: RevealedStatistics, tensors: List[Any]) -> RevealedStatistics:
    """``template``'s layers and weights with one member's statistics (``tensors`` as
    :meth:`RevealedStatistics.tensors` orders them; under vmap, that member's slices)."""
    return RevealedStatistics(template.layers, list(tensors[0::2]), list(tensors[1::2]), template.weights)
