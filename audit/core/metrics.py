"""Reconstruction quality: MSE, PSNR, SSIM, LPIPS and label accuracy.

Images are compared per image on [0, 1] (``(B, C, H, W)``; a single ``(C, H, W)`` image is a
batch of one). A batch reconstruction is first matched to the private batch by an optimal
assignment on per-pair MSE (:func:`match_batches`). A metric that cannot be computed is a
:class:`MetricValue` with ``value=None`` and the reason -- never NaN, never a number from a
random LPIPS backbone. PSNR of identical images is ``inf`` and stays ``inf``;
:func:`audit.core.jsonable.to_jsonable` writes it as the string ``"inf"``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from audit.core.errors import DataError, GiaError
import audit.core.lpips_weights as lpips_weights

LPIPS_MIN_SIDE = 31  # AlexNet's first two pooling layers need at least 31 x 31 pixels


class MetricUnavailable(GiaError):
    """A metric that cannot be computed here; the message is the reason."""


# --------------------------------------------------------------------------- values
@dataclass(frozen=True)
class MetricValue:
    """A metric's mean over images and its per-image values, or the reason it is missing."""

    value: Optional[float]
    per_image: Optional[Tuple[float, ...]] = None
    unavailable: Optional[str] = None

    @classmethod
    def of(cls, per_image: Sequence[float] | Tensor) -> "MetricValue":
        """From per-image values; the mean keeps ``inf``; any NaN makes it unavailable."""
        vals = [float(v) for v in (per_image.detach().cpu().flatten().tolist()
                                   if isinstance(per_image, Tensor) else per_image)]
        if not vals:
            return cls.missing("no images to score")
        bad = [i for i, v in enumerate(vals) if math.isnan(v)]
        if bad:
            return cls.missing(f"computed NaN for image(s) {bad}")
        return cls(float(np.mean(vals)), tuple(vals))

    @classmethod
    def scalar(cls, value: float) -> "MetricValue":
        return cls.missing("computed NaN") if math.isnan(value) else cls(float(value))

    @classmethod
    def missing(cls, reason: str) -> "MetricValue":
        return cls(None, None, reason)

    @property
    def available(self) -> bool:
        return self.value is not None

    def to_dict(self) -> Dict[str, Any]:
        if not self.available:
            return {"value": None, "unavailable": self.unavailable}
        out: Dict[str, Any] = {"value": self.value}
        if self.per_image is not None:
            out["per_image"] = list(self.per_image)
        return out


# --------------------------------------------------------------------------- per-image metrics
def _pair(a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
    a, b = (x.unsqueeze(0) if x.ndim == 3 else x for x in (a, b))
    if a.ndim != 4 or a.shape != b.shape:
        raise DataError(f"cannot compare images of shapes {tuple(a.shape)} and {tuple(b.shape)}; "
                        "expected two (B, C, H, W) batches of the same shape")
    return a, b.to(a.device)


def mse(a: Tensor, b: Tensor) -> Tensor:
    """Mean squared error per image, ``(B,)`` float64."""
    a, b = _pair(a, b)
    return (a.double() - b.double()).pow(2).flatten(1).mean(1)


def psnr(a: Tensor, b: Tensor) -> Tensor:
    """PSNR in dB per image for data range 1: ``10 log10(1 / MSE)``; ``inf`` when identical."""
    return 10.0 * torch.log10(1.0 / mse(a, b))


def _ssim_window(h: int, w: int) -> int:
    side = min(7, h, w)
    side -= 1 - side % 2  # odd
    if side < 3:
        raise MetricUnavailable(f"SSIM needs images of at least 3x3 pixels, got {h}x{w}")
    return side


def ssim(a: Tensor, b: Tensor) -> Tensor:
    """SSIM per image (scikit-image, data_range 1, 7x7 window or the largest odd that fits)."""
    from skimage.metrics import structural_similarity

    a, b = _pair(a, b)
    win = _ssim_window(*a.shape[-2:])
    xs, ys = (t.detach().double().cpu().numpy() for t in (a, b))
    vals = []
    for x, y in zip(xs, ys):
        if x.shape[0] == 1:
            vals.append(structural_similarity(x[0], y[0], data_range=1.0, win_size=win))
        else:
            vals.append(structural_similarity(x, y, data_range=1.0, win_size=win, channel_axis=0))
    return torch.tensor(vals, dtype=torch.float64)


_LPIPS_CACHE: Dict[Tuple[str, int, str], nn.Module] = {}


def lpips_model(device: torch.device | str = "cpu") -> nn.Module:
    """The LPIPS (AlexNet) model on ``device``, cached; raises :class:`MetricUnavailable` with
    the reason when no valid ImageNet backbone is installed. Never downloads."""
    problems = []
    for path in lpips_weights.installed_paths():
        key = (str(path), path.stat().st_mtime_ns, str(torch.device(device)))
        if key not in _LPIPS_CACHE:
            try:
                _LPIPS_CACHE[key] = lpips_weights.load_lpips(path, device)
            except DataError as err:
                problems.append(str(err))
                continue
            except ImportError as err:
                raise MetricUnavailable(f"LPIPS needs the lpips package ({err}); pip install lpips") from None
        return _LPIPS_CACHE[key]
    raise MetricUnavailable("; ".join(problems) or lpips_weights.weights_available()[1])


def lpips_distance(a: Tensor, b: Tensor) -> Tensor:
    """LPIPS (AlexNet, v0.1) per image; grayscale is repeated to RGB. Needs >= 31x31 pixels."""
    a, b = _pair(a, b)
    h, w = a.shape[-2:]
    if min(h, w) < LPIPS_MIN_SIDE:
        raise MetricUnavailable(f"LPIPS (AlexNet) needs images of at least {LPIPS_MIN_SIDE}x"
                                f"{LPIPS_MIN_SIDE} pixels, these are {h}x{w}")
    if a.shape[1] not in (1, 3):
        raise MetricUnavailable(f"LPIPS needs 1- or 3-channel images, these have {a.shape[1]}")
    model = lpips_model(a.device)
    a, b = (x.float().expand(-1, 3, -1, -1) for x in (a, b))
    with torch.no_grad():
        return model(a, b, normalize=True).flatten().double().cpu()


def label_accuracy(pred: Tensor, true: Tensor) -> float:
    """Fraction of the true labels recovered, as multisets (order-free, like label inference)."""
    pred, true = (torch.as_tensor(x).long().flatten().cpu() for x in (pred, true))
    if len(true) == 0:
        raise DataError("label_accuracy needs at least one true label")
    if (len(pred) and pred.min() < 0) or true.min() < 0:
        raise DataError("labels must be class indices >= 0")
    n = int(max(pred.max() if len(pred) else 0, true.max())) + 1
    hit = torch.minimum(torch.bincount(pred, minlength=n), torch.bincount(true, minlength=n))
    return float(hit.sum()) / len(true)


# --------------------------------------------------------------------------- matching + scoring
def match_batches(recon: Tensor, truth: Tensor) -> Tensor:
    """``perm`` with ``recon[perm[i]]`` the reconstruction assigned to ``truth[i]``: the
    assignment of least total per-pair MSE (scipy ``linear_sum_assignment``)."""
    from scipy.optimize import linear_sum_assignment

    if recon.ndim != 4 or truth.ndim != 4 or recon.shape[1:] != truth.shape[1:]:
        raise DataError(f"reconstruction {tuple(recon.shape)} and private batch {tuple(truth.shape)} "
                        "must be (B, C, H, W) batches of the same image shape")
    if len(recon) < len(truth):
        raise DataError(f"the reconstruction has {len(recon)} images but the private batch has "
                        f"{len(truth)}; every private image needs a reconstruction")
    r = recon.detach().double().flatten(1).cpu()
    t = truth.detach().double().flatten(1).cpu()
    if not (torch.isfinite(r).all() and torch.isfinite(t).all()):
        raise DataError("cannot match images that contain NaN/inf values")
    cost = (t.pow(2).sum(1, keepdim=True) + r.pow(2).sum(1) - 2.0 * t @ r.T) / t.shape[1]
    rows, cols = linear_sum_assignment(cost.numpy())
    return torch.as_tensor(cols[np.argsort(rows)], dtype=torch.long)


IMAGE_METRICS: Dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "mse": mse,
    "psnr": psnr,
    "ssim": ssim,
    "lpips": lpips_distance,
}


def _matched(recon: Optional[Tensor], truth: Tensor) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[str]]:
    """``(perm, matched reconstruction, None)`` or ``(None, None, why there is none)``."""
    if recon is None:
        return None, None, "the attack returned no images"
    recon = recon.detach().to(truth.device)
    if recon.ndim != 4 or recon.shape[1:] != truth.shape[1:]:
        raise DataError(f"reconstruction {tuple(recon.shape)} does not match the private batch "
                        f"{tuple(truth.shape)}: expected (B, C, H, W) images of the same shape")
    bad = [i for i in range(len(recon)) if not torch.isfinite(recon[i]).all()]
    if bad:
        return None, None, f"reconstructed image(s) {bad} contain NaN/inf values"
    perm = match_batches(recon, truth)
    return perm, recon[perm.to(recon.device)].clamp(0.0, 1.0), None


def _image_scores_many(recons: Sequence[Optional[Tensor]], truths: Sequence[Tensor], lpips: bool
                       ) -> List[Tuple[Optional[Tensor], Dict[str, MetricValue]]]:
    """Per (reconstruction, private batch): the assignment and the image metrics, each metric
    computed once over every matched image of all the batches (one LPIPS forward for a group)."""
    names = list(IMAGE_METRICS)
    matched = [_matched(r, t) for r, t in zip(recons, truths)]
    out: List[Tuple[Optional[Tensor], Dict[str, MetricValue]]] = [
        (None, {n: MetricValue.missing(why) for n in names}) if why else (perm, {})
        for perm, _, why in matched]
    live = [k for k, (_, m, _) in enumerate(matched) if m is not None]
    if not live:
        return out
    sizes = [len(truths[k]) for k in live]
    every_recon = torch.cat([matched[k][1] for k in live])
    every_truth = torch.cat([truths[k].to(every_recon.device) for k in live])
    for name, fn in IMAGE_METRICS.items():
        if name == "lpips" and not lpips:
            values = [MetricValue.missing("not computed (lpips=False)")] * len(live)
        else:
            try:
                values = [MetricValue.of(part) for part in fn(every_recon, every_truth).split(sizes)]
            except MetricUnavailable as err:
                values = [MetricValue.missing(str(err))] * len(live)
        for k, value in zip(live, values):
            out[k][1][name] = value
    return out


def score_many(recon_images: Sequence[Optional[Tensor]], recon_labels: Sequence[Optional[Tensor]],
               true_images: Sequence[Tensor], true_labels: Sequence[Tensor], lpips: bool = True
               ) -> List[Dict[str, Any]]:
    """:func:`score` for several reconstructions and their private batches at once: each image
    metric runs once over all of them (on the images' device), then is split per batch."""
    truths = []
    for truth in true_images:
        truth = truth.detach()
        if truth.ndim != 4 or len(truth) == 0 or not torch.isfinite(truth).all():
            raise DataError(f"the private batch must be a non-empty finite (B, C, H, W) tensor, "
                            f"got shape {tuple(truth.shape)}")
        truths.append(truth)
    out = []
    for (perm, scores), labels, truth_labels in zip(_image_scores_many(recon_images, truths, lpips),
                                                    recon_labels, true_labels):
        if labels is None:
            scores["label_accuracy"] = MetricValue.missing("the attack returned no labels")
        else:
            scores["label_accuracy"] = MetricValue.scalar(label_accuracy(labels, truth_labels))
        out.append({"assignment": None if perm is None else perm.tolist(), **scores})
    return out


def score(recon_images: Optional[Tensor], recon_labels: Optional[Tensor], true_images: Tensor,
          true_labels: Tensor, lpips: bool = True) -> Dict[str, Any]:
    """Score a reconstruction against the private batch.

    Returns ``{"assignment": [...], "mse" | "psnr" | "ssim" | "lpips" | "label_accuracy":
    MetricValue}``; ``assignment[i]`` is the reconstruction matched to private image ``i``
    (``None`` when there are no usable images). Reconstructions are clamped to [0, 1] first.
    """
    return score_many([recon_images], [recon_labels], [true_images], [true_labels], lpips)[0]
