"""``conv-span-completed``: the span attack on a pruned upload, its row spaces completed by their rank.

Magnitude pruning and top-k sparsification keep the largest entries of each weight gradient. A
span layer's gradient has rank ``r`` (the positions times the batch), far below its size, so where
the kept entries determine it the rank completes it, on the patch coordinates and channels that kept
``2r`` entries each (:func:`attacks.conv_span_defended.complete_span`). A completion is used only
where it predicts kept entries it was not shown (held-out relative error at most
:data:`HELD_OUT_LIMIT`): the kept entries are a biased sample and can leave a layer undetermined,
and a wrong span would lead the descent astray. The attack then runs as conv-span on those spans,
its colour fit and certificate comparing the upload where it is not zero.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch import Tensor

from attacks.conv_span import ConvSpan
from attacks.conv_span_algebra import RowSpace, row_spaces
from attacks.conv_span_defended import complete_span, expected_rank
from audit.core.errors import NotApplicable

from adaptive.adapted import register

#: a completion predicting its held-out entries to this relative error is taken as the layer's span
#: (ResNet-18's stage 4 at 90% pruning: exact completions 1e-10 to 3e-4, wrong ones 3e-3 to 0.4);
#: a wrong span costs power, not soundness: the certificate then refuses the image
HELD_OUT_LIMIT = 1e-3


class ConvSpanCompleted(ConvSpan):
    """Conv-span on the row spaces of a pruned upload completed by their rank (module docstring)."""

    name = "conv-span-completed"
    #: the attack it adapts: what its positive control runs without the defense
    base = "conv-span"
    replay_zeros = True

    def _row_spaces(self, gradients: Dict[str, Tensor], layers: List, batch: int, centred: bool,
                    steps: int) -> Tuple[List[RowSpace], List[Tuple[str, float]]]:
        whole, broken = row_spaces(gradients, layers, batch, centred, steps)
        if steps != 1:  # an update's rank is read off its spectrum, not known: nothing to complete to
            return whole, broken
        found = {s.layer.name: s for s in whole}
        gaps = dict(broken)
        for layer in layers:
            grad = gradients.get(layer.name)
            if layer.name in found or grad is None or not bool((grad == 0).any()):
                continue
            try:
                span = complete_span(grad, expected_rank(layer, batch, centred))
            except NotApplicable:
                continue
            gaps[layer.name] = span.held_out
            if span.held_out <= HELD_OUT_LIMIT:
                found[layer.name] = RowSpace(layer, span.basis, centred, span.held_out, span.columns)
        spaces = [found[layer.name] for layer in layers if layer.name in found]
        return spaces, [(layer.name, gaps[layer.name]) for layer in layers
                        if layer.name not in found and layer.name in gaps]


register(ConvSpanCompleted, "conv-span on a pruned upload: each span layer's row space completed by its rank "
                            "where held-out kept entries confirm it")
