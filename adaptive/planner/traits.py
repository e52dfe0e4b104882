"""What probing a defense found out: per-layer measurements and the defense's traits.

The planner (:mod:`adaptive.planner.plan`) turns :class:`DefenseTraits` into attacks; what the
probe could not measure, and what else it saw, are codes that ``gia-audit plan`` and the report word.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

from audit.core.reasons import Reason


@dataclass
class LayerProbe:
    """One trainable parameter's defended gradient compared with its clean gradient."""

    name: str
    shape: tuple
    changed: bool  # differs from the clean gradient (relative difference above tolerance)
    rel_diff: float  # ||d - c|| / ||c||
    cosine: float  # <d, c> / (||d|| ||c||)
    norm_ratio: float  # ||d|| / ||c||
    zero_frac_clean: float
    zero_frac_defended: float
    rank_clean: Optional[int] = None  # numerical rank of the (out, rest) matrix, >= 2-D only
    rank_defended: Optional[int] = None
    magnitude_levels: Optional[int] = None  # distinct |values| among non-zeros (capped)
    noise_std: Optional[float] = None  # std of the random part, stochastic defenses only
    varies: bool = False  # output differs between two generators

    @property
    def extra_zeros(self) -> float:
        return self.zero_frac_defended - self.zero_frac_clean

    @property
    def rank_reduced(self) -> bool:
        return (self.rank_clean is not None and self.rank_defended is not None
                and self.rank_defended < self.rank_clean)


@dataclass
class DefenseTraits:
    """The traits of a defended-gradient function, from probing plus declared knowledge.

    ``None`` means "not measured" (e.g. input-transform consistency needs a model whose
    first trainable layer is linear).
    """

    name: str
    stochastic: bool
    reproducible: bool  # same generator seed -> same output
    differentiable: bool  # the output carries a non-zero gradient back to the inputs
    changed_layers: List[str]
    unchanged_layers: List[str]
    sparse: bool
    sparsity: float  # extra fraction of exact zeros over the changed layers
    norm_preserving: bool
    orthogonal: bool
    rescaled: bool  # same direction, other norm (clipping)
    low_rank: bool
    rank_reduced_layers: List[str]
    quantized: bool
    sign_only: bool
    noise_std: Optional[float]
    noise_relative: Optional[float]  # noise std / RMS of the clean gradient
    noise_family: Optional[str]  # "gaussian", "laplace" or None
    architectural: bool  # wrap_model changes the client model (PRECODE)
    input_transform: Optional[bool]
    input_transform_source: Reason  # declared, probed, or why it could not be measured
    analytic_layers: List[str]  # linear layers whose batch-1 gradient stays rank-1 consistent
    has_log_prob: bool
    declared_stochastic: Optional[bool]
    layers: List[LayerProbe] = field(default_factory=list)
    notes: List[Reason] = field(default_factory=list)  # what else the probe saw (codes the report words)
    #: calls at several FL rounds x trained checkpoints: how often the clean gradient (or an
    #: exact multiple) was shared (:func:`adaptive.planner.probe.probe_rounds`)
    rounds_probe: Dict[str, Any] = field(default_factory=dict)
    #: the input of the model's first biased Linear followed by ReLU: "image" (an MLP), "features"
    #: (convolutions come first) or "" (none): where SPEAR's recovery lands
    relu_linear_input: str = ""
    #: the convolutions whose weight gradient spans their input's patches for one image
    #: (positions < output channels and patch entries): where the conv-span attack reads
    conv_span_layers: List[str] = field(default_factory=list)

    @property
    def sometimes_clean(self) -> bool:
        """Some probe calls shared the clean gradient (or an exact multiple) though the
        defense changes it otherwise (a schedule, a fallback, a random skip, clipping)."""
        return bool(self.rounds_probe.get("clean_calls")) and not self.identity

    @property
    def identity(self) -> bool:
        """The defense shares the clean gradient unchanged."""
        return not (self.changed_layers or self.stochastic or self.architectural or self.rescaled
                    or self.input_transform)

    @property
    def one_layer_changed(self) -> bool:
        return len(self.changed_layers) == 1 and bool(self.unchanged_layers) and not self.architectural

    @property
    def few_layers_changed(self) -> bool:
        """Some, not all, layers are perturbed: the rest can be matched exactly."""
        kept = [p for p in self.layers if not p.changed and len(p.shape) >= 2]
        return bool(self.changed_layers) and bool(kept) and not self.architectural

    def layer(self, name: str) -> LayerProbe:
        return next(p for p in self.layers if p.name == name)

    def flags(self) -> Dict[str, bool]:
        """The boolean traits, for tests and the report."""
        return {
            "identity": self.identity,
            "stochastic": self.stochastic,
            "differentiable": self.differentiable,
            "sparse": self.sparse,
            "norm_preserving": self.norm_preserving,
            "orthogonal": self.orthogonal,
            "rescaled": self.rescaled,
            "low_rank": self.low_rank,
            "quantized": self.quantized,
            "sign_only": self.sign_only,
            "one_layer_changed": self.one_layer_changed,
            "architectural": self.architectural,
            "input_transform": bool(self.input_transform),
            "analytic_linear": bool(self.analytic_layers),
            "has_log_prob": self.has_log_prob,
            "sometimes_clean": self.sometimes_clean,
        }

    def to_dict(self) -> Dict[str, Any]:
        out = asdict(self)
        out["input_transform_source"] = self.input_transform_source.to_dict()
        out["notes"] = [n.to_dict() for n in self.notes]
        out["flags"] = self.flags()
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "DefenseTraits":
        """The traits :meth:`to_dict` wrote (its ``flags`` are derived, so left out); a key
        the record does not know raises ``TypeError``, a missing one ``KeyError``."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        unknown = set(data) - names - {"flags"}
        if unknown:
            raise TypeError(f"DefenseTraits has no field(s) {sorted(unknown)}")
        values["input_transform_source"] = Reason.of(data["input_transform_source"])
        values["notes"] = [Reason.of(n) for n in data.get("notes") or ()]
        values["layers"] = [LayerProbe(**{**layer, "shape": tuple(layer["shape"])}) for layer in data.get("layers") or ()]
        return cls(**values)
