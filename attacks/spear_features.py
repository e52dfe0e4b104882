"""``spear-ig``: SPEAR's exact per-image features as a prior of the optimisation attack ``ig``.

Where convolutions come before the first ReLU-followed linear layer (``cnn``, ``convbig``),
:class:`~attacks.spear.Spear` recovers that layer's input, each image's features, and each
image's label, certified by reproducing the upload. ``ig`` then runs with one more term,
:class:`ExactFeatures`: the distance between the dummy images' features and the recovered ones,
dummy image ``i`` against row ``i`` (its label is row ``i``'s, so the two stay paired). Without
certified features the run is plain ``ig`` and its trace says why. Measured gain:
docs/strength.md (SPEAR).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from audit.core.types import Observation, Reconstruction
from priors import Prior

from attacks.analytic import leaf_layers
from attacks.presets import ATTACKS
from attacks.spear import Spear, relu_linear_layers

#: the features term's weight (relative squared distance; the cosine match is of order 1)
FEATURES_PRIOR_WEIGHT = 1.0


class ExactFeatures(Prior):
    """``||f(x) - F||^2 / ||F||^2``: ``f`` the layers before the linear layer (frozen copies),
    ``F`` the recovered features, one row per dummy image."""

    name = "exact-features"

    def __init__(self, prefix: nn.Module, features: Tensor):
        self.prefix = copy.deepcopy(prefix).requires_grad_(False)
        self.features = features.detach()
        self.scale = float(features.detach().pow(2).sum().clamp_min(1e-30))

    def __call__(self, x: Tensor, context: Any) -> Tensor:
        return (self.prefix(x).flatten(1) - self.features.to(x.dtype)).pow(2).sum() / self.scale

    def __repr__(self) -> str:
        return f"exact-features({tuple(self.features.shape)})"


class SpearFeaturesIg:
    """``ig`` with SPEAR's certified per-image features and labels (see the module docstring)."""

    name = "spear-ig"

    def __init__(self, weight: float = FEATURES_PRIOR_WEIGHT, spear: Optional[Spear] = None, **ig: Any):
        self.weight, self.spear, self.ig = float(weight), spear or Spear(), ig

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Callable] = None) -> Reconstruction:
        found = self.spear.reconstruct(observation, None, seed)
        attack = ATTACKS.build("ig", **self.ig)
        features = found.trace.get("features")
        if features is None or not found.trace.get("certified"):
            rec = attack.reconstruct(observation, budget, seed, progress=progress)
            why = None if found.reason is None else found.reason.to_dict()  # a code: the report words it
            rec.trace["spear"] = (found.trace.get("failure") or found.trace.get("uncertified") or why
                                  if features is not None else why or "no features")
            return rec
        layers = leaf_layers(observation.model)
        index = relu_linear_layers(observation.model)[0][0].index
        prefix = nn.Sequential(*[layer for _, layer in layers[:index]])
        attack.priors.append((ExactFeatures.name, ExactFeatures(prefix, features.to(observation.device)),
                              self.weight))
        paired = dataclasses.replace(observation, labels=found.labels.to(observation.device))
        rec = attack.reconstruct(paired, budget, seed, progress=progress)
        rec.trace.update(spear={k: found.trace[k] for k in ("layer", "samples", "certificate_error", "seconds")},
                         labels_from="spear")  # read off the upload, paired with the recovered features
        return rec


@ATTACKS.register("spear-ig", "ig with SPEAR's certified per-image features (and labels) as a prior, where "
                  "convolutions come before a ReLU-followed linear layer (cnn, convbig)")
def spear_ig(weight: float = FEATURES_PRIOR_WEIGHT, samples: Optional[int] = None, **ig: Any) -> SpearFeaturesIg:
    return SpearFeaturesIg(weight, Spear(samples=samples), **ig)
