"""How the prior weights an attack takes from the observation move with its length, where the
client shares its BatchNorm buffers.

The TV rule (:mod:`attacks.tv_rule`) and the features rule (:mod:`attacks.feature_rule`) were
chosen at :data:`SHORT` optimiser iterations. Where the uploaded buffers give away the batch's
statistics, a longer run fits them, the gradient and each image's features more closely, and
each further image of the batch needs less of the TV prior's smoothing: on held-out embedded
images at :data:`LONG` iterations, a TV weight that grows half as fast with the batch as the TV
rule's (the same at batch 1, half of it at batch 4 and 8) and features weight 1 score best
(bench/results/strength/strength.md (The weights of what a client uploads)). In between, the weights move geometrically with the iterations;
at :data:`SHORT` or fewer, and wherever the buffers reveal nothing, the rules' weights stand.
"""
from __future__ import annotations

import math
from typing import Optional

from audit.core.buffers import upload_statistics
from audit.core.types import Observation

#: the iterations the rules' weights were chosen at, and those where the long-run weights take over
SHORT, LONG = 400, 1600
#: at :data:`LONG` iterations: the factor on the TV rule's growth with the private pixel values
#: (:func:`attacks.tv_rule.observed_tv`), and the features term's weight
TV_GROWTH_LONG, FEATURES_WEIGHT_LONG = 0.5, 1.0
#: the rule's constants, for the fingerprint of the attacks that use it
BUDGET_RULE = {"short": SHORT, "long": LONG, "tv_growth_long": TV_GROWTH_LONG,
               "features_weight_long": FEATURES_WEIGHT_LONG}


def reveals_batch_statistics(obs: Observation) -> bool:
    """Whether the upload's buffers give away the private batch's BatchNorm statistics: the one
    predicate (:func:`audit.core.buffers.upload_statistics`) the prior and the report use too."""
    return upload_statistics(obs)[0] is not None


def long_share(obs: Observation, iterations: Optional[int]) -> float:
    """0 at :data:`SHORT` iterations or fewer (or unknown, or no statistics revealed), 1 at
    :data:`LONG` or more, by the logarithm of the iterations in between."""
    if iterations is None or iterations <= SHORT or not reveals_batch_statistics(obs):
        return 0.0
    return min(1.0, math.log(iterations / SHORT) / math.log(LONG / SHORT))


def lengthened(weight: float, long_weight: float, share: float) -> float:
    """``weight`` moved geometrically towards ``long_weight`` by ``share`` (0: unchanged)."""
    return weight if share <= 0 or weight <= 0 else weight * (long_weight / weight) ** share
