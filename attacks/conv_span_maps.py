"""Conv-span's deep-map stage: the span convolutions' input map first, then the image under it.

In a sequential model the span convolutions (:mod:`attacks.conv_span_algebra`) all lie in the
children from some index on, so one map, the one entering that child, fixes every one of their
inputs. Taken as the unknown, that map meets the row-space constraints of every span convolution
above it, and the only non-linearity left between it and them is the top's own: on ResNet-18 at
batch 1 (the 16x16x128 output of stage 2) L-BFGS from a random map reaches the true one to a
cosine of 1 - 2e-8 in eval mode, where the same residual taken over the image stalls on some
images. The image is then the one whose bottom maps to it (feature inversion, scale-free), and
the image-domain descent of :mod:`attacks.conv_span` finishes from there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from attacks.conv_span_algebra import RowSpace, span_residual


@dataclass
class Split:
    """A sequential model cut before its first child holding a span convolution: ``bottom`` maps
    the image to the deep map, ``top`` runs from it through the last span convolution."""

    bottom: nn.Sequential
    top: nn.Sequential

    def map_of(self, images: Tensor) -> Tensor:
        return self.bottom(images)


def split(model: nn.Module, layer_names: Sequence[str]) -> Optional[Split]:
    """The cut of ``model`` below every layer in ``layer_names`` (module names), or None where the
    model is not an ``nn.Sequential`` or the first such layer sits in its first child."""
    if not isinstance(model, nn.Sequential) or not layer_names:
        return None
    children = list(model.named_children())

    def holds(child: str) -> bool:
        return any(name == child or name.startswith(child + ".") for name in layer_names)

    held = [i for i, (name, _) in enumerate(children) if holds(name)]
    if not held or held[0] == 0:
        return None
    first, last = held[0], held[-1]
    return Split(nn.Sequential(*[c for _, c in children[:first]]),
                 nn.Sequential(*[c for _, c in children[first:last + 1]]))


def map_residual(top: nn.Sequential, spaces: List[RowSpace], modules: Dict[str, nn.Module],
                 maps: Dict[str, Tensor]) -> Callable[[Tensor], Tensor]:
    """The mean span residual of ``spaces`` for a candidate deep map (``maps`` is filled by the
    caller's forward hooks on ``modules``)."""

    def residual(deep: Tensor) -> Tensor:
        maps.clear()
        top(deep)
        return sum(span_residual(s, modules[s.layer.name], maps[s.layer.name]) for s in spaces) / len(spaces)
    return residual


def feature_mismatch(split_: Split, target: Tensor, centred_stride: int = 0) -> Callable[[Tensor], Tensor]:
    """How far the images' deep maps are from ``target``, each image's map compared by direction (the
    span fixes a map only up to its scale). ``centred_stride``: with train-mode BatchNorm after
    convolutions of that stride, a per-channel constant added to the positions of one residue class
    (the centre taps of a stride-2 3x3 and its 1x1 shortcut) shifts every patch alike, which the
    centring and the normalisation above remove: the span cannot see it, so each class's
    per-channel mean is left out of the comparison."""
    want = _directions(target.detach(), centred_stride)

    def mismatch(images: Tensor) -> Tensor:
        return (_directions(split_.map_of(images), centred_stride) - want).pow(2).sum()
    return mismatch


def _directions(maps: Tensor, centred_stride: int = 0) -> Tensor:
    if centred_stride:
        classes = torch.zeros_like(maps)
        for a in range(centred_stride):
            for b in range(centred_stride):
                part = maps[..., a::centred_stride, b::centred_stride]
                classes[..., a::centred_stride, b::centred_stride] = part.mean((-2, -1), keepdim=True).expand_as(part)
        maps = maps - classes
    flat = maps.reshape(len(maps), -1)
    return flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-30)


def resolutions(size: Sequence[int], levels: int = 3) -> List[tuple]:
    """The image sizes of a coarse-to-fine inversion: each level doubles, ending at ``size``; a
    level below 4 pixels is left out."""
    height, width = int(size[0]), int(size[1])
    found = [(height >> k, width >> k) for k in reversed(range(levels))]
    return [s for s in found if min(s) >= 4] or [(height, width)]


def upsampled(images: Tensor, size: Sequence[int]) -> Tensor:
    """``images`` at ``size`` (bilinear; the same tensor where it is already that size)."""
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    return torch.nn.functional.interpolate(images, size=tuple(size), mode="bilinear", align_corners=False)


def invert(mismatch: Callable[[Tensor], Tensor], start: Tensor, steps: int, lr: float = 0.05,
           report: Optional[Callable] = None) -> Tuple[Tensor, List[float]]:
    """The images (in [0, 1]) whose ``mismatch`` is least, found coarse to fine from ``start``: at each
    level of :func:`resolutions`, Adam with a cosine-decayed step, projected onto [0, 1] after each
    step; ``report(n, of, loss)`` after each. Returns the images at ``start``'s size and the losses.

    The box is what makes it converge: under train-mode BatchNorm the bottom of ResNet-18 does not
    see an image's gain or offset, and an unbounded descent (L-BFGS or Adam alike) drifts along
    them into a local minimum (3 of 8 test images stalled at a mismatch of 0.2-0.5); projected onto
    the pixels' range, the same 900 steps reach a mismatch of 3e-4 on each of them."""
    size, levels = start.shape[-2:], resolutions(start.shape[-2:])
    x, losses = start.detach().clamp(0, 1), []
    for k, level in enumerate(levels):
        part = steps // len(levels) + (steps % len(levels) if k == len(levels) - 1 else 0)
        coarse = torch.nn.functional.interpolate(x, size=level, mode="bilinear", align_corners=False,
                                                 antialias=True).clamp(0, 1).requires_grad_(True)
        optimizer = torch.optim.Adam([coarse], lr=lr)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(1, part))
        for _ in range(part):
            optimizer.zero_grad()
            value = mismatch(upsampled(coarse, size))
            value.backward()
            optimizer.step()
            schedule.step()
            with torch.no_grad():
                coarse.clamp_(0, 1)
            losses.append(float(value.detach()))
            if report is not None:
                report(len(losses), steps, losses[-1])
        x = upsampled(coarse.detach(), size)
    return x, losses


#: a separated map's entry counts as zero below this share of its largest (the maps meet the span to a
#: few percent before their last descent) ...
ZERO = 3e-2
#: ... and a candidate's negative entries count this many times against its zeros
NEGATIVE_WEIGHT = 10
#: candidates closer than this cosine are the same map
SAME = 0.98


def separate(maps: Tensor, generator: torch.Generator, trials: Optional[int] = None) -> Tensor:
    """The batch's own maps out of ``maps``: non-negative maps (they leave a ReLU) that meet the span
    together span the same space as the true ones, but any non-negative mixture of those meets it
    too. As SPEAR separates a batch, a true map is the sparsest direction in that space: the one
    vanishing on ``batch - 1`` random entries where one map is zero (a quarter of a ReLU's output or
    more) is that map, and a mixture vanishes only where all its maps do. Of ``trials`` such
    directions, each polished to the one least on all the entries it nearly zeroes, the ``batch``
    most nearly zero and least negative, pairwise distinct, are kept (scaled as ``maps``); ``maps``
    is returned as it is where fewer distinct ones are found."""
    count = len(maps)
    if count < 2:
        return maps
    flat = maps.detach().flatten(1).double()
    basis = torch.linalg.svd(flat.T, full_matrices=False)[0]  # (entries, batch)
    scored = []
    for _ in range(trials or 100 * count):
        rows = torch.randperm(len(basis), generator=generator)[:count - 1]
        v = _signed(basis @ _least(basis[rows]))
        # polished: the direction least on every entry it (nearly) zeroes, not on the few it was drawn on
        v = _signed(basis @ _least(basis[v.abs() <= ZERO]))
        scored.append((int((v.abs() <= ZERO).sum()) - NEGATIVE_WEIGHT * int((v < -ZERO).sum()), v / v.norm()))
    picked: List[Tensor] = []
    for _, v in sorted(scored, key=lambda t: -t[0]):
        if all(abs(float(v @ w)) < SAME for w in picked):
            picked.append(v)
        if len(picked) == count:
            break
    if len(picked) < count:
        return maps
    scale = flat.norm(dim=1).mean()
    return (torch.stack(picked).clamp_min(0) * scale).to(maps).view_as(maps)


def _least(rows: Tensor) -> Tensor:
    """The unit coefficients least on ``rows``: their last right singular vector (the thin SVD where
    there are more rows than coefficients: the full one of thousands of rows builds their whole basis)."""
    return torch.linalg.svd(rows, full_matrices=len(rows) < rows.shape[1])[2][-1]


def _signed(v: Tensor) -> Tensor:
    """``v`` with its larger side positive, scaled to a largest entry of 1."""
    return (v if v.sum() >= 0 else -v) / v.abs().max().clamp_min(1e-300)


def non_negative(split_: Split, images: Tensor) -> bool:
    """Whether the bottom's map is non-negative for ``images`` (it leaves a ReLU): the unknown map is
    then searched among non-negative ones."""
    with torch.no_grad():
        return bool((split_.map_of(images) >= 0).all())
