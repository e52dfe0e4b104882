"""The weight of the per-image features term an attack takes from the observation
(``features="auto"``, :mod:`priors.features`).

The term reads each image's last-layer features off the output layer's gradient, the
dummy's against the observed one's. It is on where that reading means the same on both sides:

* the observed output layer has no zeroed entries (a pruned or masked upload would be read
  against an unpruned dummy);
* the attack matches the plain gradient (the run turns it off, with the reason in the trace,
  where the attack replays a defense or masks or reweights layers).

Its weight depends on how the upload is read. Where the softmax recovered from the upload
itself explains it (:func:`priors.features.observed_reading`: one plain gradient or one local
step) the upload's features are exact, and the term weighs :data:`FEATURES_WEIGHT`. Elsewhere
(several local steps, noise) the run reads the upload with the dummy's softmax, right only once
the dummy is close: :data:`FEATURES_WEIGHT_DUMMY_SOFTMAX`, and only where the batch leaves at
least half of the classes absent (at batch 8 of 10 classes that reading cost 0.75 dB). The
exact reading's weight grows with the run's length where the buffers are shared
(:mod:`attacks.budget_rule`).

The measurements: bench/results/strength/strength.md (The weights of what a client uploads).
"""
from __future__ import annotations

from typing import Optional, Tuple

from audit.core.errors import NotApplicable
from audit.core.reasons import Reason
from audit.core.types import Observation
from priors import classifier_head

from attacks.budget_rule import FEATURES_WEIGHT_LONG, lengthened, long_share
from attacks.tv_rule import ObservedWeight

#: the features term's weight where the upload is read exactly, chosen on held-out embedded
#: images (``bench/bench_strength.py --bn-weight --weight-knob features``; bench/results/strength/strength.md (The weights of what a client uploads))
FEATURES_WEIGHT = 0.3
#: its weight where the upload is read with the dummy's softmax (chosen the same way, with that reading)
FEATURES_WEIGHT_DUMMY_SOFTMAX = 0.1
#: the largest share of the classes a batch may cover for the dummy-softmax reading to be used
FEATURES_MAX_CLASS_SHARE = 0.5


def observed_features(obs: Observation, iterations: Optional[int] = None) -> float:
    """:data:`FEATURES_WEIGHT` where :func:`observed_features_off` finds no reason against it, else 0
    (the run lowers it with :func:`dummy_softmax_weight` where the upload cannot be read exactly);
    towards :data:`attacks.budget_rule.FEATURES_WEIGHT_LONG` for a long run on shared buffers."""
    try:
        if observed_features_off(obs):
            return 0.0
    except NotApplicable:
        return 0.0
    return lengthened(FEATURES_WEIGHT, FEATURES_WEIGHT_LONG, long_share(obs, iterations))


def dummy_softmax_weight(obs: Observation) -> Tuple[float, Optional[Reason]]:
    """The weight where the upload is read with the dummy's softmax, and why it is 0 (None
    else): the batch covers more than :data:`FEATURES_MAX_CLASS_SHARE` of the classes."""
    _, bias = classifier_head(obs.model)
    classes = obs.gradients[bias].numel()
    if obs.batch_size > FEATURES_MAX_CLASS_SHARE * classes:
        return 0.0, Reason("features-classes-crowded", batch=obs.batch_size, share=FEATURES_MAX_CLASS_SHARE,
                           classes=classes)
    return FEATURES_WEIGHT_DUMMY_SOFTMAX, None


class AutoFeatures(ObservedWeight):
    """``features="auto"``: :func:`observed_features`, and off where the attack reads differently
    (a class, so copies of an attack, e.g. a captured program's template, still say so)."""


AUTO_FEATURES = AutoFeatures(observed_features, "auto (attacks.feature_rule.observed_features)")


def observed_features_off(obs: Observation) -> Optional[Reason]:
    """Why the reading is off for ``obs`` (None when it is on): the observed output layer is not
    whole. Whole: no zero in its bias, and a zero in its weight only where the whole column is
    zero (a feature no image activates, as ReLU leaves them); a pruned or masked upload zeroes
    single entries. NotApplicable where the model has no output layer to read."""
    weight, bias = classifier_head(obs.model)
    zero = obs.gradients[weight].reshape(obs.gradients[weight].shape[0], -1) == 0
    if bool((zero.any(0) & ~zero.all(0)).any()) or bool((obs.gradients[bias] == 0).any()):
        return Reason("features-upload-zeroed")
    return None
