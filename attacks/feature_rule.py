"""The weight of the per-image features term an attack takes from the observation
(``features="auto"``, :mod:`priors.features`).

The term reads each image's last-layer features off the output layer's gradient, the
dummy's against the observed one's. It is on, at :data:`FEATURES_WEIGHT`, where that reading
is sharp and means the same on both sides:

* the batch leaves at least half of the classes absent. The reading is exact with the right
  softmax, and the run reads both sides with the dummy's own, which is right only once the
  dummy is close; on held-out images the term lifts `ig` by 1.6 dB at batch 4 but costs
  0.75 dB at batch 8 of 10 classes (one image of 16 falls from 30.4 to 16.1 dB);
* the observed output layer has no zeroed entries (a pruned or masked upload would be read
  against an unpruned dummy);
* the attack matches the plain gradient (the run turns it off, with the reason in the trace,
  where the attack replays a defense or masks or reweights layers).

The measurements: docs/strength.md, section 6.
"""
from __future__ import annotations

from audit.core.errors import NotApplicable
from audit.core.types import Observation
from priors import classifier_head

from attacks.tv_rule import ObservedWeight

#: the features term's weight, chosen on held-out embedded images (``bench/bench_strength.py
#: --bn-weight --weight-knob features``; docs/strength.md, section 6)
FEATURES_WEIGHT = 0.1
#: the largest share of the classes a batch may cover for the reading to be used
FEATURES_MAX_CLASS_SHARE = 0.5


def observed_features(obs: Observation) -> float:
    """:data:`FEATURES_WEIGHT` where :func:`observed_features_off` finds no reason against it, else 0."""
    try:
        return 0.0 if observed_features_off(obs) else FEATURES_WEIGHT
    except NotApplicable:
        return 0.0


class AutoFeatures(ObservedWeight):
    """``features="auto"``: :func:`observed_features`, and off where the attack reads differently
    (a class, so copies of an attack, e.g. a captured program's template, still say so)."""


AUTO_FEATURES = AutoFeatures(observed_features, "auto (attacks.feature_rule.observed_features)")


def observed_features_off(obs: Observation) -> str:
    """Why the reading is off for ``obs`` ('' when it is on): the batch covers more than
    :data:`FEATURES_MAX_CLASS_SHARE` of the classes, or the observed output layer is not whole.
    Whole: no zero in its bias, and a zero in its weight only where the whole column is zero (a
    feature no image activates, as ReLU leaves them); a pruned or masked upload zeroes single
    entries. NotApplicable where the model has no output layer to read."""
    weight, bias = classifier_head(obs.model)
    classes = obs.gradients[bias].numel()
    if obs.batch_size > FEATURES_MAX_CLASS_SHARE * classes:
        return (f"a batch of {obs.batch_size} covers more than {FEATURES_MAX_CLASS_SHARE:.0%} of the {classes} classes, "
                "too few absent classes for a sharp reading")
    zero = obs.gradients[weight].reshape(obs.gradients[weight].shape[0], -1) == 0
    if bool((zero.any(0) & ~zero.all(0)).any()) or bool((obs.gradients[bias] == 0).any()):
        return "the observed output layer's gradient has zeroed entries (pruned or masked)"
    return ""
