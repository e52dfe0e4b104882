"""Scoring a reconstruction against the private batch (the only place that sees both), and
the small JSON-able summary of an attack's trace that the store keeps."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from audit.core.metrics import score_many
from audit.core.records import Scores
from audit.core.trace import Trace
from audit.core.types import Defense

PSNR_CAP = 200.0  # an exact reconstruction (MSE 0, PSNR inf) is reported as this many dB


def score_reconstruction(rec, images: torch.Tensor, labels: torch.Tensor, null=None, own_chance: bool = False):
    """Metrics of a reconstruction (JSON-able), why any is missing, and the reconstruction
    reordered to match the private batch (for the report's grids). With ``null`` (the
    audit's :class:`~audit.engine.null.Null`), ``metrics["evidence"]`` holds each image's
    evidence for the leak rule; ``own_chance`` adds each reference image's chance level
    (for references whose null is not stored with the audit)."""
    return score_reconstructions([rec], [images], [labels], null, own_chance)[0]


def score_reconstructions(recs: Sequence[Any], images: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
                          null=None, own_chance: bool = False) -> List[Tuple[Dict[str, Any], Dict[str, str], Any]]:
    """:func:`score_reconstruction` for a (step, attack) group: the image metrics (LPIPS
    included) and the null's evidence each run once over every image of the group, on the
    reconstructions' device."""
    results = score_many([r.inputs for r in recs], [r.labels for r in recs],
                         [x.to(r.inputs.device) for r, x in zip(recs, images)],
                         [y.to(r.inputs.device) for r, y in zip(recs, labels)])
    out = [_metrics(result, rec, x) for result, rec, x in zip(results, recs, images)]
    if null is not None:
        live = [k for k, (_, _, aligned) in enumerate(out) if aligned is not None]
        if live:
            matched = torch.cat([out[k][2] for k in live])
            private = torch.cat([images[k].to(matched.device) for k in live])
            evidence = null.score(matched, private)
            start = 0
            for k in live:
                part = evidence[start:start + len(images[k])]
                start += len(images[k])
                if own_chance:
                    part = [replace(e, chance_level=null.evidence(images[k][j]).chance_level)
                            for j, e in enumerate(part)]
                out[k][0]["evidence"] = [e.to_dict() for e in part]
    return out


def _metrics(result: Dict[str, Any], rec, images: torch.Tensor):
    """One scored reconstruction as JSON-able metrics, the missing ones' reasons, and the
    reconstruction aligned to the private batch."""
    names = {"psnr": "psnr", "ssim": "ssim", "lpips": "lpips", "label_acc": "label_accuracy", "mse": "mse"}
    metrics, unavailable = {}, {}
    for ours, theirs in names.items():
        value = result[theirs]
        metrics[ours] = value.value
        if value.unavailable:
            unavailable[ours] = value.unavailable
    if metrics["psnr"] is not None:
        per_image = [min(p, PSNR_CAP) for p in result["psnr"].per_image]
        metrics["psnr"] = sum(per_image) / len(per_image)
        metrics["psnr_per_image"] = per_image
    if result["mse"].per_image is not None:
        numel = images[0].numel()
        metrics["l2"] = [math.sqrt(m * numel) for m in result["mse"].per_image]
    for name in ("ssim", "lpips"):  # per image: a batch is judged by its worst image, not its mean
        if result[name].per_image is not None:
            metrics[f"{name}_per_image"] = list(result[name].per_image)
    aligned = None
    if result["assignment"] is not None:
        aligned = rec.inputs.detach()[torch.as_tensor(result["assignment"], device=rec.inputs.device)].clamp(0, 1)
    return metrics, unavailable, aligned


def trained_batch(defense, images: torch.Tensor, seed: int) -> Optional[torch.Tensor]:
    """The batch the client trained on, for a defense that transforms its inputs (a declared
    ``transform_inputs``): reproduced with the seed its observation's generator got (exact
    for one local step); None for any other defense."""
    own = getattr(type(defense), "transform_inputs", None)
    if own is None or own is Defense.transform_inputs:
        return None
    generator = torch.Generator(device=images.device).manual_seed(int(seed))
    with torch.no_grad():
        return defense.transform_inputs(images, generator).detach().clamp(0, 1)


def score_against_trained(rec, trained: Optional[torch.Tensor], labels: torch.Tensor, null=None) -> Dict[str, Any]:
    """Record fields scoring ``rec`` against what the client trained on (``metrics_trained``;
    the verdict takes, per image, the more leaking of this and the original); {} without one."""
    if trained is None or rec.inputs is None:
        return {}
    metrics, unavailable, _ = score_reconstruction(rec, trained, labels, null, own_chance=True)
    return {"metrics_trained": Scores.from_dict(metrics), "unavailable_trained": unavailable,
            "trained_reference": "the defense's transform_inputs of the private batch, with the observation's seed"}


def trace_summary(trace: Any) -> Trace:
    """The small, JSON-able part of an attack's trace: its typed fields whole, its ``extra``
    summarised (number lists as first, last and length; small dicts of scalars and reasons kept)."""
    trace = Trace.from_dict(trace)
    out: Dict[str, Any] = {}
    for key, value in trace.extra.items():
        if isinstance(value, (int, float, str, bool)) or value is None:
            out[key] = value
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) for v in value):
            out[f"{key}_first"], out[f"{key}_last"], out[f"{key}_len"] = value[0], value[-1], len(value)
        elif isinstance(value, dict) and "code" in value and set(value) <= {"code", "params"}:
            out[key] = value  # a reason's JSON object, whole: the report words it from its code and numbers
        elif isinstance(value, dict) and len(value) <= 12:
            out[key] = {k: v for k, v in value.items() if isinstance(v, (int, float, str, bool)) or v is None}
    return replace(trace, side_information=dict(trace.side_information), extra=out)
