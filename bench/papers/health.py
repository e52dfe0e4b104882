"""What the row's model and defense do, measured beside its cells: the model at each step as
the audit trains it (a collapsed step is not judged), and how far Refiner's projection moves
the upload."""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Dict

from bench.papers.cells import Profile, plan_cells
from bench.papers.spec import Row


def refiner_projection(row: Row, profile: Profile, run: Dict[str, Any], images: int = 8) -> Dict[str, Any]:
    """How far Refiner's robust gradient lies from the clean one on the row's model, against
    the projection radius: per alpha, the mean ``||g* - g||`` and ``||g||``, how many uploads
    the eps-ball projection cut back, and the upload's cosine to the clean gradient."""
    import torch

    from audit.core.data import load_dataset
    from audit.core.models import build_model
    from audit.core.types import clean_gradients, default_loss_fn
    from defenses import build_defense

    data = load_dataset("embedded")
    model = build_model(row.model, data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                        **run["model_args"])
    out: Dict[str, Any] = {"images": images, "eps": row.defense_args["eps"], "alphas": {}}
    for alpha in (0.0, 0.5, 0.9):
        defense = build_defense(row.defense, **{**row.defense_args, "alpha": alpha})
        dist, norms, cut, cos = [], [], 0, []
        for i in range(images):
            x, y = data.test_images[i:i + 1], data.test_labels[i:i + 1]
            g = clean_gradients(model, x, y, default_loss_fn)
            robust_x = defense.robust_data(model, x, y, generator=torch.Generator().manual_seed(i), grads=g)
            robust = clean_gradients(model, robust_x, y, default_loss_fn)
            d = float(torch.sqrt(sum(((r - c) ** 2).sum() for r, c in zip(robust, g))))
            up = defense(model, x, y, generator=torch.Generator().manual_seed(i))
            n = float(torch.sqrt(sum((c * c).sum() for c in g)))
            dot = float(sum((u * c).sum() for u, c in zip(up, g)))
            cos.append(dot / (float(torch.sqrt(sum((u * u).sum() for u in up))) * n))
            dist.append(d)
            norms.append(n)
            cut += d > out["eps"]
        out["alphas"][str(alpha)] = {"robust_distance": sum(dist) / images, "clean_norm": sum(norms) / images,
                                     "projected": cut, "upload_cosine_min": min(cos)}
    return out


def projection_text(m: Dict[str, Any]) -> str:
    parts = [f"alpha {a}: ||g* - g|| {v['robust_distance']:.1f}, cut back {v['projected']} of {m['images']}, "
             f"cosine to the clean gradient >= {v['upload_cosine_min']:.5f}" for a, v in m["alphas"].items()]
    norm = next(iter(m["alphas"].values()))["clean_norm"]
    return (f"measured on {m['images']} images of the row's model: ||g|| {norm:.1f} against eps {m['eps']:g}; "
            + "; ".join(parts) + ". The projection returns g + eps (g* - g) / ||g* - g|| whenever ||g* - g|| > "
            "eps (the paper's App. J), so every alpha uploads the clean gradient moved by eps: alpha cannot change "
            "what leaks here")


#: a model whose logits spread this much (standard deviation over the private images' logits) has
#: diverged: its softmax saturates, so its gradient no longer carries the image
DIVERGED_LOGIT_STD = 1e3


def model_health(call: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per step of an ``audit.run`` call, the model the audit trains there (the engine's own
    training, same seed) on the call's private images in the client's mode: its logits' spread,
    and how many images' clean gradients are non-finite or exactly zero."""
    import torch

    from audit.core.types import clean_gradients, default_loss_fn
    from audit.engine.audit import Audit, _train, audit_settings

    flat = {k: v for k, v in call.items() if k not in ("defense", "defense_args", "out", "progress")}
    audit = Audit(call["defense"], defense_args=call.get("defense_args"), **audit_settings(**flat))
    steps = sorted(int(s) for s in call["steps"])
    states, _ = _train(audit, max(steps), set(steps))
    out = {}
    for step in steps:
        if step not in states:
            out[str(step)] = {"trained": False}
            continue
        model = copy.deepcopy(audit.model)
        model.load_state_dict(states[step])
        model.train(audit.fl_settings.client_mode == "train")
        logits, finite, zero = [], 0, 0
        for x, y in audit.private:
            with torch.no_grad():
                logits.append(model(x))
            grads = clean_gradients(model, x, y, default_loss_fn)
            finite += all(bool(torch.isfinite(g).all()) for g in grads)
            zero += all(not bool(g.any()) for g in grads)
        spread = torch.cat(logits).double()
        out[str(step)] = {"trained": True, "images": len(audit.private), "logit_std": float(spread.std()),
                          "finite": finite, "zero": zero}
    return out


def collapsed(health: Dict[str, Any]) -> str:
    """Why a step's model cannot be judged ('' where it can): not trained to, a non-finite or
    exactly zero upload, or diverged logits (:data:`DIVERGED_LOGIT_STD`)."""
    if not health.get("trained"):
        return "the model was not trained to this step"
    if health["finite"] < health["images"]:
        return f"non-finite gradients on {health['images'] - health['finite']} of {health['images']} images"
    if health["zero"]:
        return f"exactly zero gradients on {health['zero']} of {health['images']} images"
    if not math.isfinite(health["logit_std"]) or health["logit_std"] > DIVERGED_LOGIT_STD:
        return f"the model diverged (logit std {health['logit_std']:.2g})"
    return ""


def store_health(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
                 stored: Dict[str, Any]) -> None:
    """Measure, where not stored under the paper cell's key, the model at each step of a row
    judged step by step (:func:`model_health`), into ``stored["health"]``."""
    plan = plan_cells(row, profile, data, data_args, out, (stored.get("search") or {}).get("chosen"))[0]
    if (stored.get("health") or {}).get("key") != plan.key:
        stored["health"] = {"key": plan.key, "steps": model_health(plan.call)}


def health_text(stored: Dict[str, Any]) -> str:
    """The stored model health per step (:func:`model_health`), in words ('' where none)."""
    steps = (stored.get("health") or {}).get("steps") or {}
    return "; ".join(f"step {s}: " + (collapsed(h) or f"logit std {h['logit_std']:.2g}, {h['finite']} of {h['images']} "
                                      "gradients finite, none zero") for s, h in sorted(steps.items(), key=lambda i: int(i[0])))
