"""What an optimisation attack matches: gradient distances and log-likelihoods.

An objective is an object with ``__call__(dummy_grads, target_grads) -> scalar`` (lists of
tensors, one per trainable parameter; lower is better) and ``bind(observation) ->
objective`` (called once per attack run; the default returns the objective itself).
Objectives must be pure torch so they run under ``torch.func.vmap`` (one restart at a time).

Registry :data:`OBJECTIVES`: ``l2``, ``l1``, ``cosine`` (per-layer ``weights`` and
``masks``; ``masks="observed"`` masks the dummy gradient by the non-zeros of the observed
one, read inside the objective so every observation of a grouped run gets its own mask, in
the layers where some target of the group has a zero), ``gaussian(sigma)``, ``laplacian(b)``
(negative log-likelihoods of the shared gradient under additive noise) and ``defense``
(``-observation.defense.log_prob``). ``bind_group(observations)`` binds for a grouped run.
"""
from __future__ import annotations

import copy
import functools
import operator
from typing import List, Optional, Sequence, Union

import torch
from torch import Tensor

from audit.core.reasons import Reason
from audit.core.errors import ConfigError, NotApplicable
from audit.core.registry import Registry
from audit.core.types import Observation

OBJECTIVES = Registry("objective")
#: ``masks=OBSERVED``: each layer is masked by the non-zero entries of the target gradient
#: itself (the pruning mask a defense left in the observation), read inside the objective so
#: a grouped run over several observations matches each with its own mask
OBSERVED = "observed"


class Objective:
    """Base class: ``__call__(dummy_grads, target_grads) -> scalar`` and ``bind(observation)``."""

    name = "objective"

    def bind(self, observation: Observation) -> "Objective":
        return self

    def bind_group(self, observations: Sequence[Observation]) -> "Objective":
        """Bound for a grouped run over ``observations`` (of one model); by default as for the first."""
        return self.bind(observations[0])

    def __call__(self, dummy_grads: Sequence[Tensor], target_grads: Sequence[Tensor]) -> Tensor:
        raise TypeError(f"{type(self).__name__} must implement __call__")

    def __repr__(self) -> str:
        return self.name


class GradientDistance(Objective):
    """Sum over layers of ``w_l * d(m_l * g_l, m_l * t_l)``; ``weights`` / ``masks`` are
    sequences aligned with the gradient list (``None`` entries mean 1 / no mask), or
    ``masks=OBSERVED``: ``m_l = (t_l != 0)``. A weight of 0 drops a layer (e.g. the layer a
    defense perturbs).

    Bound, the weights are one tensor (None where every weight is 1: no multiplication) and
    the masks tensors of the gradients' dtype, so a captured program reads them as inputs
    and serves any weights or masks of the same shapes (``attacks.capture``)."""

    def __init__(self, weights: Optional[Sequence[Optional[float]]] = None,
                 masks: Union[None, str, Sequence[Optional[Tensor]]] = None):
        if isinstance(masks, str) and masks != OBSERVED:
            raise ConfigError(f"objective masks must be per-layer tensors or {OBSERVED!r}, got {masks!r}")
        self.weights = None if weights is None else list(weights)
        self.masks = masks if masks is None or masks == OBSERVED else list(masks)
        #: ``masks=OBSERVED`` after ``bind_group``: the layers with an exact zero in some target
        #: (the others need no mask), in order; None masks every layer
        self.zero_layers: Optional[tuple] = None

    def bind(self, observation: Observation) -> "GradientDistance":
        grads = observation.gradients
        n = len(grads)
        for what, seq in (("weights", self.weights), ("masks", self.masks)):
            if seq is not None and seq != OBSERVED and len(seq) != n:
                raise ConfigError(f"objective {self.name!r}: {len(seq)} per-layer {what} for {n} "
                                  "gradient tensors; give one entry per trainable parameter (None = default)")
        if self.weights is not None and all(w == 0 for w in self.weights if w is not None) \
                and None not in self.weights:
            raise ConfigError(f"objective {self.name!r}: every per-layer weight is 0, nothing is matched")
        bound = copy.copy(self)
        values = [1.0 if w is None else float(w) for w in self.weights or ()]
        bound.weights = None if all(v == 1.0 for v in values) else \
            torch.tensor(values, dtype=grads[0].dtype, device=grads[0].device)
        if self.masks is not None and self.masks != OBSERVED:
            for i, (m, g) in enumerate(zip(self.masks, grads)):
                if m is not None and tuple(m.shape) != tuple(g.shape):
                    raise ConfigError(f"objective {self.name!r}: mask {i} has shape {tuple(m.shape)}, "
                                      f"the gradient {tuple(g.shape)}")
            bound.masks = [None if m is None else torch.as_tensor(m).to(device=g.device, dtype=g.dtype, copy=True)
                           for m, g in zip(self.masks, grads)]
        return bound

    def bind_group(self, observations: Sequence[Observation]) -> "GradientDistance":
        bound = self.bind(observations[0])
        if self.masks == OBSERVED:
            bound.zero_layers = tuple(i for i in range(len(observations[0].gradients))
                                      if any(bool((o.gradients[i] == 0).any()) for o in observations))
        return bound

    def _layers(self, dummy, target):
        """``(masked dummy, masked target)`` per layer (a layer of weight 0 included when bound:
        its weight multiplies it by 0, so every weighting runs the same operations)."""
        for i, (g, t) in enumerate(zip(dummy, target)):
            if isinstance(self.weights, list) and self.weights[i] is not None and float(self.weights[i]) == 0.0:
                continue  # unbound: the layer is not matched
            if self.masks == OBSERVED:
                if self.zero_layers is None or i in self.zero_layers:
                    g = g * (t != 0)  # the target is its own mask: t * (t != 0) == t
            elif self.masks is not None and self.masks[i] is not None:
                m = self.masks[i] if self.masks[i].dtype == g.dtype else self.masks[i].to(g.dtype)
                g, t = g * m, t * m
            yield g, t

    def _weigh(self, values: List[Tensor]) -> Tensor:
        """``sum_l w_l values[l]``: a plain sum where every weight is 1."""
        weights = self.weights
        if weights is None:
            return functools.reduce(operator.add, values)
        if isinstance(weights, list):  # unbound: the matched layers' weights
            weights = [1.0 if w is None else float(w) for w in weights if w is None or float(w) != 0.0]
            return functools.reduce(operator.add, [w * v for w, v in zip(weights, values)])
        return (weights.to(values[0].dtype) * torch.stack(values)).sum()

    def __call__(self, dummy_grads, target_grads):
        return self._weigh([self.layer_distance(g, t) for g, t in self._layers(dummy_grads, target_grads)])

    def layer_distance(self, g: Tensor, t: Tensor) -> Tensor:
        raise TypeError(f"{type(self).__name__} must implement layer_distance")

    def __repr__(self) -> str:
        parts = []
        if self.weights is not None:
            weights = self.weights.tolist() if isinstance(self.weights, Tensor) else self.weights
            parts.append(f"weights={weights}")
        if self.masks is not None:
            parts.append(f"masks={OBSERVED}" if self.masks == OBSERVED else "masks=[...]")
        return f"{self.name}({', '.join(parts)})" if parts else self.name


class L2Distance(GradientDistance):
    """Squared Euclidean distance (DLG, GradInversion)."""

    name = "l2"

    def layer_distance(self, g, t):
        return (g - t).pow(2).sum()


class L1Distance(GradientDistance):
    """Absolute distance (Laplacian noise)."""

    name = "l1"

    def layer_distance(self, g, t):
        return (g - t).abs().sum()


class CosineDistance(GradientDistance):
    """``1 - <g, t> / (|g| |t|)`` over all (weighted, masked) layers at once (Inverting Gradients)."""

    name = "cosine"

    def __call__(self, dummy_grads, target_grads):
        layers = list(self._layers(dummy_grads, target_grads))
        dot = self._weigh([(g * t).sum() for g, t in layers])
        gg = self._weigh([g.pow(2).sum() for g, _ in layers])
        tt = self._weigh([t.pow(2).sum() for _, t in layers])
        return 1.0 - dot / (torch.sqrt(gg) * torch.sqrt(tt) + 1e-12)


class ScaledDistance(Objective):
    """``scale * distance``: the negative log-likelihood of i.i.d. additive noise, up to a constant."""

    def __init__(self, name: str, distance: GradientDistance, scale: float):
        self.name, self.distance, self.scale = name, distance, float(scale)

    def bind(self, observation):
        return ScaledDistance(self.name, self.distance.bind(observation), self.scale)

    def bind_group(self, observations):
        return ScaledDistance(self.name, self.distance.bind_group(observations), self.scale)

    def __call__(self, dummy_grads, target_grads):
        return self.scale * self.distance(dummy_grads, target_grads)

    def __repr__(self) -> str:
        return self.name


class StackedMean(Objective):
    """``mean_s inner(draw_s, target)`` over dummy gradients stacked along their first ``dims``
    dimensions (EOT samples; delta-ball points x defense draws); ``label`` names it in traces."""

    def __init__(self, inner: Objective, label: str, dims: int = 1):
        self.inner, self.label, self.dims = inner, label, int(dims)
        self.name = f"{label}[{inner!r}]"

    def bind(self, observation: Observation) -> "StackedMean":
        return StackedMean(self.inner.bind(observation), self.label, self.dims)

    def bind_group(self, observations: Sequence[Observation]) -> "StackedMean":
        return StackedMean(self.inner.bind_group(observations), self.label, self.dims)

    def __call__(self, dummy_grads, target_grads):
        # unbind: one cheap backward
        draws = list(zip(*[g.flatten(0, self.dims - 1).unbind(0) for g in dummy_grads]))
        return sum(self.inner(list(d), target_grads) for d in draws) / len(draws)


class DefenseLikelihood(Objective):
    """``-observation.defense.log_prob(shared=target, clean=dummy)`` (the Bayes adversary)."""

    name = "defense"

    def bind(self, observation):
        log_prob = getattr(observation.defense, "log_prob", None)
        if log_prob is None:
            raise NotApplicable(Reason("objective-needs-log-prob",
                                       defense=getattr(observation.defense, "name", None)))
        return _BoundLikelihood(log_prob)


class _BoundLikelihood(Objective):
    name = "defense"

    def __init__(self, log_prob):
        self.log_prob = log_prob

    def __call__(self, dummy_grads, target_grads):
        return -self.log_prob(list(target_grads), list(dummy_grads))


def _positive(name: str, value: float) -> float:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")
    return float(value)


@OBJECTIVES.register("l2", "squared L2 gradient distance (per-layer weights / masks)")
def l2(weights=None, masks=None) -> Objective:
    return L2Distance(weights, masks)


@OBJECTIVES.register("l1", "L1 gradient distance (per-layer weights / masks)")
def l1(weights=None, masks=None) -> Objective:
    return L1Distance(weights, masks)


@OBJECTIVES.register("cosine", "1 - cosine similarity over all layers (per-layer weights / masks)")
def cosine(weights=None, masks=None) -> Objective:
    return CosineDistance(weights, masks)


@OBJECTIVES.register("gaussian", "-log N(shared; dummy, sigma^2): sum (g - t)^2 / (2 sigma^2)")
def gaussian(sigma: float = 0.1, weights=None, masks=None) -> Objective:
    sigma = _positive("gaussian sigma", sigma)
    return ScaledDistance(f"gaussian(sigma={sigma:g})", L2Distance(weights, masks), 0.5 / sigma ** 2)


@OBJECTIVES.register("laplacian", "-log Laplace(shared; dummy, b): sum |g - t| / b")
def laplacian(b: float = 0.1, weights=None, masks=None) -> Objective:
    b = _positive("laplacian b", b)
    return ScaledDistance(f"laplacian(b={b:g})", L1Distance(weights, masks), 1.0 / b)


@OBJECTIVES.register("defense", "-log p(shared | dummy) from the observation's defense.log_prob")
def defense_likelihood() -> Objective:
    return DefenseLikelihood()


def build_objective(spec, **settings) -> Objective:
    """An :class:`Objective` from a registered name (with settings) or an object / callable."""
    if isinstance(spec, str):
        return OBJECTIVES.build(spec, **settings)
    if settings:
        raise ConfigError(f"objective settings {sorted(settings)} only apply to a registered objective name")
    if isinstance(spec, Objective):
        return spec
    if callable(spec):
        return _CallableObjective(spec)
    raise ConfigError(f"objective must be one of {OBJECTIVES.names()} or a callable, got {type(spec).__name__}")


class _CallableObjective(Objective):
    def __init__(self, fn):
        self.fn = fn
        self.name = getattr(fn, "__name__", "custom")

    def __call__(self, dummy_grads, target_grads):
        return self.fn(dummy_grads, target_grads)
