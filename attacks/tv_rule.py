"""The total-variation weight an attack takes from what the server observes (``tv="auto"``).

Inverting Gradients' 5e-2 is tuned for one 32x32 image on a small ConvNet. More private pixel
values per gradient entry need a stronger prior, and a client whose BatchNorm normalises with
the batch's own statistics hides each channel's scale and offset from the gradient, which the
prior then has to supply. The rule reads only the observation (never the ground truth) and
the run's length (:mod:`attacks.budget_rule`); the measurements behind it: docs/strength.md,
sections 5 and 6.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from audit.core.types import Observation

from attacks.budget_rule import BUDGET_RULE, TV_GROWTH_LONG, lengthened, long_share

#: TV weight of a 32x32 batch of one (Inverting Gradients' 5e-2), and the private pixel
#: values it is tuned for
TV_REFERENCE, TV_REFERENCE_UNKNOWNS = 5e-2, 3 * 32 * 32
#: gradient entries per private pixel value of the model the rule is tuned on (the project's
#: ConvNet, 108,170 parameters, at 32x32 batch 1)
TV_REFERENCE_ENTRIES = 108170 / 3072
#: TV weight of a 32x32 batch of one when the client's BatchNorm normalises with the batch's own
#: statistics (it grows with the batch as :data:`TV_REFERENCE` does)
TV_BATCHNORM_TRAIN = 0.5
#: the rule's constants, for the fingerprint of the attacks that use it
RULE = {"reference": TV_REFERENCE, "reference_unknowns": TV_REFERENCE_UNKNOWNS,
        "reference_entries": TV_REFERENCE_ENTRIES, "batchnorm_train": TV_BATCHNORM_TRAIN, "budget": BUDGET_RULE}


def batchnorm_layers(obs: Observation) -> List[torch.nn.Module]:
    return [m for m in obs.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def observed_tv(obs: Observation, iterations: Optional[int] = None) -> float:
    """The TV weight for ``obs``: it grows with the private pixel values beyond a 32x32 image,
    but only while the gradient has fewer entries per pixel value than the reference ConvNet
    (:data:`TV_REFERENCE_ENTRIES`); with BatchNorm in train mode it starts from
    :data:`TV_BATCHNORM_TRAIN` instead of :data:`TV_REFERENCE` and grows alike. A run of more
    than :data:`attacks.budget_rule.SHORT` ``iterations`` on an upload whose buffers reveal the
    batch's statistics lets the weight grow less (:func:`attacks.budget_rule.long_share`): at
    :data:`attacks.budget_rule.LONG` by :data:`attacks.budget_rule.TV_GROWTH_LONG` of the
    growth, never below the one-image weight."""
    growth = max(1.0, min(obs.unknowns / TV_REFERENCE_UNKNOWNS,
                          TV_REFERENCE_ENTRIES * obs.unknowns / max(1, obs.gradient_entries)))
    base = TV_BATCHNORM_TRAIN if obs.client_mode == "train" and batchnorm_layers(obs) else TV_REFERENCE
    return lengthened(base * growth, base * max(1.0, growth * TV_GROWTH_LONG), long_share(obs, iterations))


class ObservedWeight:
    """A prior weight resolved per observation when an attack runs (``tv="auto"``), from the
    observation and the run's planned optimiser iterations (None: unknown)."""

    def __init__(self, rule=observed_tv, label: str = "auto (attacks.tv_rule.observed_tv)"):
        self.rule, self.label = rule, label

    def __call__(self, obs: Observation, iterations: Optional[int] = None) -> float:
        return float(self.rule(obs, iterations))

    def __repr__(self) -> str:
        return self.label


AUTO_TV = ObservedWeight()
