"""The span attack through a defense: ``conv-span-completed`` (pruning), ``conv-span-denoised`` (noise).

Magnitude pruning and top-k sparsification keep the largest entries of each weight gradient. A
span layer's gradient has rank ``r`` (the positions times the batch), far below its size, so where
the kept entries determine it the rank completes it, on the patch coordinates and channels that kept
``2r`` entries each (:func:`attacks.conv_span_defended.complete_span`). A completion is used only
where a completion from a random start finds the same row space (largest principal sine at most
:data:`AGREEMENT_LIMIT`): the kept entries are a biased sample and can leave a layer undetermined,
and a wrong span would lead the descent astray. The attack then runs as conv-span on those spans,
its colour fit and certificate comparing the upload where it is not zero. Under additive noise the
span is estimated by each layer's top singular subspace instead (:class:`ConvSpanDenoised`).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from torch import Tensor

from attacks.conv_span import ConvSpan
from attacks.conv_span_algebra import RowSpace, row_spaces
from attacks.conv_span_defended import complete_span, denoised_basis, expected_rank
from audit.core.errors import NotApplicable

from adaptive.adapted import register

#: a completed row space that a completion from a random start meets within this principal sine is
#: taken as the layer's span (ResNet-18's stage 4 at 90% pruning: determined 6e-8 to 4e-5, whatever
#: the kernels; undetermined 0.5 and more); a wrong span costs power, not soundness: the certificate
#: then refuses the image
AGREEMENT_LIMIT = 1e-3
#: a noisy upload's span is read off its spectrum where the (r+1)-th singular value is at most this
#: share of the r-th (the noise below the signal's smallest direction)
DENOISED_LIMIT = 0.5


class ConvSpanThrough(ConvSpan):
    """Conv-span on row spaces read through a defense: each span layer whose upload shows no rank
    gap is given to :meth:`read`, which returns its row space, or None and how far it was from one."""

    def read(self, layer, grad: Tensor, rank: int, centred: bool) -> Tuple[Optional[RowSpace], float]:
        """The layer's row space read through the defense, or None where it cannot be (this base
        reads none: it runs as conv-span), and how far the reading was from one."""
        return None, math.inf

    def _row_spaces(self, gradients: Dict[str, Tensor], layers: List, batch: int, centred: bool,
                    steps: int) -> Tuple[List[RowSpace], List[Tuple[str, float]]]:
        whole, broken = row_spaces(gradients, layers, batch, centred, steps)
        if steps != 1:  # an update's rank is read off its spectrum, not known: nothing to read it to
            return whole, broken
        found = {s.layer.name: s for s in whole}
        gaps = dict(broken)
        for layer in layers:
            grad = gradients.get(layer.name)
            if layer.name in found or grad is None:
                continue
            space, gaps[layer.name] = self.read(layer, grad, expected_rank(layer, batch, centred), centred)
            if space is not None:
                found[layer.name] = space
        spaces = [found[layer.name] for layer in layers if layer.name in found]
        return spaces, [(layer.name, gaps[layer.name]) for layer in layers
                        if layer.name not in found and layer.name in gaps]


class ConvSpanCompleted(ConvSpanThrough):
    """Conv-span on the row spaces of a pruned upload completed by their rank (module docstring)."""

    name = "conv-span-completed"
    #: the attack it adapts: what its positive control runs without the defense
    base = "conv-span"
    replay_zeros = True

    def read(self, layer, grad: Tensor, rank: int, centred: bool) -> Tuple[Optional[RowSpace], float]:
        if not bool((grad == 0).any()):
            return None, math.inf
        try:
            span = complete_span(grad, rank)
        except NotApplicable:
            return None, math.inf
        ok = span.agreement <= AGREEMENT_LIMIT
        return (RowSpace(layer, span.basis, centred, span.agreement, span.columns) if ok else None), span.agreement


class ConvSpanDenoised(ConvSpanThrough):
    """Conv-span on the top singular subspaces of a noisy upload: additive noise is full rank, the
    span's gradient rank ``r``; where the ``r+1``-th singular value is at most
    :data:`DENOISED_LIMIT` of the ``r``-th, the top ``r`` right singular vectors estimate the span
    (:func:`attacks.conv_span_defended.denoised_basis`). The certificate compares the noisy upload,
    so it refuses what it cannot reproduce; the image is judged by what it recovers."""

    name = "conv-span-denoised"
    base = "conv-span"

    def read(self, layer, grad: Tensor, rank: int, centred: bool) -> Tuple[Optional[RowSpace], float]:
        basis, ratio = denoised_basis(grad, rank)
        return (RowSpace(layer, basis, centred, ratio) if ratio <= DENOISED_LIMIT else None), ratio


register(ConvSpanCompleted, "conv-span on a pruned upload: each span layer's row space completed by its rank "
                            "where held-out kept entries confirm it")
register(ConvSpanDenoised, "conv-span on a noisy upload: each span layer's row space read as its top singular "
                           "subspace where the spectrum keeps a gap at the rank")
