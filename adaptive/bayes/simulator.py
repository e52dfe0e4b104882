"""The delta-ball Monte Carlo simulator of the Bayes-optimal adversary (Algorithm 1).

It wraps any :class:`~attacks.simulator.GradientSimulator`: the dummy batch ``x`` (the
ball's centre) is moved to ``k`` points ``x_i = x + u_i``, ``u_i`` uniform in the L2 ball
of radius ``delta`` (fresh points at every evaluation), and each point goes ``draws`` times
through the inner simulator (``draws > 1`` samples the defense's randomness for the Monte
Carlo likelihood; a defense simulator runs them all as one batched defense call,
``Defense.many``). The gradients come back stacked as ``(k, draws, *param_shape)`` for
:mod:`adaptive.bayes.likelihood`'s objectives; the points are in
``features["ball_points"]`` for :class:`adaptive.bayes.priors.BallAveragedPrior`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from attacks.simulator import ClientReplica, GradientSimulator, SimContext
from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.core.types import Observation

from adaptive.bayes.ball import uniform_ball_offsets


class BallSimulator(GradientSimulator):
    """``k`` ball points x ``draws`` runs of ``inner`` per evaluation (see module docstring)."""

    def __init__(self, inner: GradientSimulator, k: int = 1, delta: float = 0.0, draws: int = 1):
        super().__init__()
        if k < 1 or draws < 1:
            raise ConfigError(f"ball samples k and draws must be >= 1, got k={k}, draws={draws}")
        if delta < 0:
            raise ConfigError(f"the ball radius delta must be >= 0, got {delta}")
        self.inner, self.k, self.delta, self.draws = inner, int(k), float(delta), int(draws)

    @property
    def batchable(self) -> bool:
        return self.inner.batchable

    def prepare(self, observation: Observation) -> ClientReplica:
        return self.inner.prepare(observation)

    def points(self, x: Tensor, context: SimContext) -> Tensor:
        """``(k, *x.shape)``: the centre plus k uniform offsets (the centre itself if delta = 0)."""
        if self.delta == 0.0:
            return x.unsqueeze(0).expand(self.k, *x.shape)
        offsets = uniform_ball_offsets(x.shape, self.k, self.delta, generator=context.generator,
                                       device=x.device, dtype=x.dtype)
        return x.unsqueeze(0) + offsets

    def client_gradients(self, replica: ClientReplica, x: Tensor, y: Tensor, *, functional: bool,
                         context: SimContext) -> Tuple[List[Tensor], Dict[str, Any]]:
        points = self.points(x, context)
        batched = getattr(self.inner, "batched_draws", None)
        stacked = None if batched is None else batched(replica, points, y, self.draws, context)
        if stacked is not None:  # one batched defense call for every point and draw
            return stacked, {"ball_points": points}
        features: Dict[str, Any] = {}
        per_point = []
        for i in range(self.k):
            runs = []
            for _ in range(self.draws):
                grads, feats = self.inner(replica, points[i], y, functional=functional, context=context)
                features = features or dict(feats)
                runs.append(grads)
            per_point.append([torch.stack(layer) for layer in zip(*runs)])
        stacked = [torch.stack(layer) for layer in zip(*per_point)]
        return stacked, {**features, "ball_points": points}

    def many_members(self, replica: ClientReplica, xs: Tensor, ys: Tensor,
                     context: SimContext) -> Tuple[List[Tensor], Dict[str, Tensor]]:
        """Every member's ``k`` points x ``draws`` through one stacked call of ``inner``, per
        parameter ``(M, k, draws, *shape)``; the points in ``features["ball_points"]``."""
        points = torch.stack([self.points(x, context) for x in xs])
        labels = ys.repeat_interleave(self.k, 0)
        stacked, _ = self.inner.many_members(replica, points.flatten(0, 1), labels, context, draws=self.draws)
        return [g.reshape(len(xs), self.k, *g.shape[1:]) for g in stacked], {"ball_points": points}

    def cannot_stack(self, observation: Observation) -> Optional[Reason]:
        if not callable(getattr(self.inner, "many_members", None)):
            return Reason("no-stacked-call", simulator=self.inner.describe())
        why = getattr(self.inner, "cannot_stack", None)
        return why(observation) if callable(why) else None

    def gradient_evaluations(self, observation: Observation) -> int:
        return self.k * self.draws * self.inner.gradient_evaluations(observation)

    def describe(self) -> str:
        return f"BallSimulator(k={self.k}, delta={self.delta:g}, draws={self.draws}, inner={self.inner.describe()})"
