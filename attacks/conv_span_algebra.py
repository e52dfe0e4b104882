"""What a convolution's weight gradient holds, as linear algebra (:mod:`attacks.conv_span`).

For a ``Conv2d`` with input map ``X`` and ``N`` output positions per image, ``dL/dW`` reshaped to
``Cout x (Cin/groups * k * k)`` is ``sum_p delta_p (outer) patch_p(X)``: its row space is the span
of the input's patches wherever ``B * N < min(Cout, Cin/groups * k * k)`` (``B`` images). A
BatchNorm in train mode after the convolution makes ``sum_p delta_p = 0``, so the rank drops by
one and the row space holds the patches centred over all positions of the batch. Measured on
ResNet-18: the patches lie in the row space to 1e-15 for every convolution of stages 3 and 4
(docs/conv-span.md).

This module finds the convolutions where the span holds (:func:`span_layers`), reads their row
spaces off an upload and keeps those whose spectrum shows the gap (:func:`row_spaces`), and
scores how far a candidate map's patches are from them (:func:`span_residual`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from audit.core.reasons import Reason
from audit.core.models import preserved_buffers

#: a row space is read off an upload where the first dropped singular value is below this share
#: of the last kept one (exact uploads: ~1e-6 in float32, ~1e-15 in float64; noise or pruning: ~1)
GAP = 1e-3


@dataclass(frozen=True)
class SpanLayer:
    """A convolution whose weight gradient can span its input's patches: its module name, the
    positions per image, its output channels and the length of one patch."""

    name: str
    positions: int
    out_channels: int
    patch: int

    def holds_for(self, batch: int) -> bool:
        """``batch * positions`` patches fit strictly inside the gradient's rank bound."""
        return batch * self.positions < min(self.out_channels, self.patch)

    @property
    def largest_batch(self) -> int:
        return max(0, (min(self.out_channels, self.patch) - 1) // self.positions)


def conv_layers(model: nn.Module, input_shape: Sequence[int]) -> List[SpanLayer]:
    """Every trainable ``Conv2d`` of ``model`` with its positions for one image of ``input_shape``
    (a probe forward on zeros; the model's buffers are left as they were)."""
    convs = {name: m for name, m in model.named_modules()
             if isinstance(m, nn.Conv2d) and m.weight.requires_grad}
    found: Dict[str, SpanLayer] = {}

    def hook(name):
        def record(module, _inputs, output):
            found[name] = SpanLayer(name, int(output.shape[-1] * output.shape[-2]), module.out_channels,
                                    module.weight[0].numel())
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in convs.items()]
    param = next(model.parameters())
    try:
        with torch.no_grad(), preserved_buffers(model):
            model(torch.zeros(2, *input_shape, dtype=param.dtype, device=param.device))
    finally:
        for h in handles:
            h.remove()
    return [found[n] for n in convs if n in found]


def span_layers(model: nn.Module, input_shape: Sequence[int], batch: int,
                steps: int = 1) -> Tuple[List[SpanLayer], Optional[Reason]]:
    """The convolutions whose weight gradient (or update after ``steps`` full-batch SGD steps,
    whose row space is the union of the steps') spans the patches of a batch of ``batch``, and
    why there is none (None when some are found)."""
    convs = conv_layers(model, input_shape)
    if not convs:
        return [], Reason("conv-span-no-conv")
    held = [c for c in convs if c.holds_for(batch * steps)]
    if held:
        return held, None
    best = min(convs, key=lambda c: c.positions / min(c.out_channels, c.patch))
    if best.largest_batch == 0:
        return [], Reason("conv-span-no-rank", layer=best.name, positions=best.positions,
                          channels=best.out_channels, patch=best.patch)
    return [], Reason("conv-span-batch", batch=batch, steps=steps, patches=batch * steps * best.positions,
                      layer=best.name, spans=min(best.out_channels, best.patch) - 1,
                      largest=best.largest_batch // steps)


@dataclass
class RowSpace:
    """The row space of one convolution's uploaded weight gradient: an orthonormal basis ``(r, D)``,
    whether its patches are centred (train-mode BatchNorm) and the spectral gap it was read at;
    ``columns``: the patch coordinates the basis spans where it is known on those alone (a pruned
    upload completed there, :mod:`attacks.conv_span_defended`), ``basis`` then ``(r, len(columns))``."""

    layer: SpanLayer
    basis: Tensor
    centred: bool
    gap: float
    columns: Optional[Tensor] = None


def row_spaces(gradients: Dict[str, Tensor], layers: Sequence[SpanLayer], batch: int,
               centred: bool, steps: int = 1) -> Tuple[List[RowSpace], List[Tuple[str, float]]]:
    """The row spaces of the layers whose uploaded gradient has the expected rank (``batch *
    positions``, less one when ``centred``) with a gap below :data:`GAP`, and the others with the
    gap they showed (a defense that perturbs a layer breaks its gap). After ``steps`` full-batch
    steps the rank is read off the spectrum between one step's and ``steps`` times it: the
    largest with the gap (the steps' maps may add every direction or none: eval-mode ResNet at
    initialisation adds them, train-mode BatchNorm renormalises them away)."""
    kept, broken = [], []
    for layer in layers:
        grad = gradients.get(layer.name)
        if grad is None:
            broken.append((layer.name, math.inf))
            continue
        one = batch * layer.positions - (1 if centred else 0)
        s, vh = torch.linalg.svd(grad.detach().double().reshape(grad.shape[0], -1), full_matrices=False)[1:]
        gaps = {rank: float(s[rank] / s[rank - 1]) if s[rank - 1] > 0 else math.inf
                for rank in range(one, min(steps * one, len(s) - 1) + 1)}
        rank = max((r for r, g in gaps.items() if g <= GAP), default=min(gaps, key=gaps.get))
        if gaps[rank] <= GAP:
            kept.append(RowSpace(layer, vh[:rank], centred, gaps[rank]))
        else:
            broken.append((layer.name, gaps[rank]))
    return kept, broken


def patches(conv: nn.Conv2d, maps: Tensor) -> Tensor:
    """Every patch the convolution reads from ``maps`` ``(B, C, H, W)``: ``(B * N, C/groups*k*k)``
    in the order of its weight's flattened rows (groups > 1: the first group's channels)."""
    unfolded = F.unfold(maps, conv.kernel_size, conv.dilation, conv.padding, conv.stride)
    if conv.groups > 1:
        unfolded = unfolded[:, :conv.weight[0].numel()]
    return unfolded.transpose(1, 2).reshape(-1, unfolded.shape[1])


def span_residual(space: RowSpace, conv: nn.Conv2d, maps: Tensor) -> Tensor:
    """How far ``maps``' patches are from the uploaded row space, scale-free: the squared share
    of the patches outside it, plus (for a batch) the share of the row space the patches miss,
    so that every image of the batch must be there, not one image copied. Zero for the true maps
    (an update's row space holds every local step's patches: the share is of the dimensions one
    step's patches can fill)."""
    basis = space.basis.to(maps.dtype)
    p = patches(conv, maps)
    if space.columns is not None:
        p = p[:, space.columns.to(p.device)]
    if space.centred:
        p = p - p.mean(0, keepdim=True)
    outside = (p - (p @ basis.T) @ basis).pow(2).sum() / p.pow(2).sum().clamp_min(1e-30)
    if len(maps) == 1:  # one image: its patches are the whole row space already
        return outside
    gram = p @ p.T
    ridge = 1e-6 * gram.diagonal().mean() * torch.eye(len(p), dtype=p.dtype, device=p.device)
    coords = p @ basis.T  # (BN, r)
    covered = (coords * torch.linalg.solve(gram + ridge, coords)).sum() / min(basis.shape[0], len(p) - space.centred)
    return outside + (1 - covered)
