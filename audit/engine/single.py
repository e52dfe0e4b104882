"""One attack on one private batch, end to end: what ``gia-audit attack`` runs.

Loads the data (or a user image), builds the model, makes the client's observation,
reconstructs with a progress bar and writes ``original.png``, ``reconstruction.png``,
``comparison.png`` (originals on top, matched reconstructions below), ``metrics.json``
(scores, label inference, threat model, attack trace summary) and ``trace.json`` (the full
trace with the loss history per restart).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch

import adaptive  # noqa: F401  (registers the adaptive attacks in ATTACKS)
from attacks.presets import ATTACKS
from audit.client.observe import observe
from audit.core.errors import ConfigError
from audit.engine.compose import (build_model, check_model, client_model, load_data, reconstruct, resolve_defense,
                                  resolve_device)
from audit.engine.config import AuditConfig, make_config
from audit.report.reasons import trace_words, word


def _private_batch(dataset, index: int, batch: int, image: Optional[str], label: int):
    if image is not None:
        from audit.core.data import load_image

        if batch != 1:
            raise ConfigError("--image attacks one image; use --batch-size 1 (or a data set for batches)")
        if not 0 <= label < dataset.num_classes:
            raise ConfigError(f"--label must be in 0..{dataset.num_classes - 1}, got {label}")
        x = load_image(image, dataset.input_shape[1], dataset.input_shape[0]).reshape(1, *dataset.input_shape)
        return x, torch.tensor([label])
    # private images come from the held-out split: the train split is the attacker's
    # auxiliary data (generators, learned inverters train on it), so the two never overlap
    n = len(dataset.test_labels)
    if not 0 <= index <= n - batch:
        raise ConfigError(f"--index {index} with --batch-size {batch} is outside the {n} held-out (test) images "
                          f"of {dataset.name!r}; use 0..{n - batch}")
    return dataset.test_images[index:index + batch], dataset.test_labels[index:index + batch]


def settings_of(attack: str, attack_args: Optional[Dict[str, Dict[str, Any]]]) -> Dict[str, Any]:
    """The settings of ``attack`` among the audit's ``attack_args`` (``--attack-arg
    ATTACK.NAME=VALUE``); a setting of another attack is a ConfigError."""
    others = sorted(set(attack_args or {}) - {attack})
    if others:
        raise ConfigError(f"--attack-arg sets {', '.join(others)}, not the attack {attack!r}; write {attack}.NAME=VALUE")
    return dict((attack_args or {}).get(attack, {}))


def _progress_bar(total: int, enabled: bool, label: str):
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=label, disable=not enabled or total == 0, leave=False)

    def update(done: int, _total: int, loss: float) -> None:
        bar.update(done - bar.n)
        bar.set_postfix(loss=f"{loss:.4g}", refresh=False)

    return bar, update


def run_attack(attack: str = "ig", config: Optional[AuditConfig] = None, /, *, index: int = 0,
               image: Optional[str] = None, label: int = 0, budget: Optional[int] = None,
               restarts: Optional[int] = None, attack_args: Optional[Dict[str, Any]] = None,
               defense: Any = None, defense_args: Optional[Dict[str, Any]] = None, out: str = "out",
               **fields: Any) -> Dict[str, Any]:
    """Attack one private batch (``index``, or the file ``image`` with ``label``) and write images
    + metrics to ``out``; returns the metrics. The model, the data and the client's training are
    an audit's: ``config`` (:class:`~audit.engine.config.AuditConfig`) with ``fields`` over it
    (``model="lenet", batch_size=2, local_steps=3, ...``), the same defaults as ``audit.run``.
    ``defense``: None attacks the undefended client; ``budget`` None: the attack's own iterations."""
    from audit.core.jsonable import to_jsonable
    from audit.core.metrics import score
    from audit.report.images import batch_to_png_bytes

    config = make_config(config, **fields)
    sections = config.sections()
    fl, model_cfg, batch = sections.fl_settings, sections.model, config.batch_size
    seed, progress = config.seed, config.progress
    device = resolve_device(config.device)
    data = load_data(config.data, config.image_size, sections.data_settings.data_args)
    x, y = _private_batch(data, index, batch, image, label)
    net = build_model(model_cfg, data, seed).to(device)
    check_model(net, model_cfg, data, batch, config.client_mode, None, device, batch_option="--batch-size / batch_size")
    if defense is not None:
        defense = resolve_defense(defense, defense_args)
        net = client_model(defense, net, seed)
    elif defense_args:
        raise ConfigError("--defense-arg needs --defense")
    obs = observe(net, x.to(device), y.to(device), defense, share_labels=config.share_labels, training=fl.client,
                  seed=seed)
    settings = dict(attack_args or {})
    if restarts is not None:
        settings["restarts"] = restarts
    attacker = ATTACKS.build(attack, **settings)
    total = budget if budget is not None else getattr(attacker, "iterations", 0)
    bar, update = _progress_bar(total, progress, attack)
    try:
        rec = reconstruct(attacker, obs, budget, seed, update)
    finally:
        bar.close()
    scores = score(rec.inputs if rec.applicable else None, rec.labels, x.to(device), y.to(device))

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "original.png").write_bytes(batch_to_png_bytes(x))
    trace = {k: v for k, v in rec.trace.items() if k != "loss_history"}
    metrics = {"attack": attack, "applicable": rec.applicable,
               "reason": None if rec.reason is None else word(rec.reason),
               "why": None if rec.reason is None else rec.reason.to_dict(), "scores": scores,
               "true_labels": y.tolist(), "recovered_labels": None if rec.labels is None else rec.labels.tolist(),
               "threat_model": obs.threat_model(), "defense": None if defense is None else repr(defense),
               "model": model_cfg.describe(), "checkpoint": config.checkpoint,
               "dataset": data.name, "index": index if image is None else None, "image": image,
               "seed": seed, "trace": trace, "trace_words": trace_words(trace)}
    if rec.applicable:
        matched = rec.inputs[torch.tensor(scores["assignment"])] if scores.get("assignment") else rec.inputs
        (folder / "reconstruction.png").write_bytes(batch_to_png_bytes(matched))
        both = torch.cat([_row(x), _row(matched)], dim=1)  # originals above reconstructions
        (folder / "comparison.png").write_bytes(batch_to_png_bytes(both.unsqueeze(0), min_height=256))
    metrics["summary"] = _summary(attack, rec, scores, folder)
    (folder / "metrics.json").write_text(json.dumps(to_jsonable(metrics), indent=2))
    (folder / "trace.json").write_text(json.dumps(to_jsonable(rec.trace.to_dict())))
    return metrics


def _row(images: torch.Tensor, pad: int = 1) -> torch.Tensor:
    """``(B, C, H, W)`` -> one image ``(C, H, B*(W+pad)-pad)`` on white padding."""
    images = images.detach().cpu().clamp(0, 1)
    b, c, h, w = images.shape
    row = torch.ones(c, h + pad, b * (w + pad) - pad)
    for i in range(b):
        row[:, :h, i * (w + pad): i * (w + pad) + w] = images[i]
    return row


def _summary(attack: str, rec, scores: Dict[str, Any], folder: Path) -> str:
    if not rec.applicable:
        return f"{attack}: not applicable: {word(rec.reason)} (details in {folder / 'metrics.json'})"
    parts = []
    for name, unit in (("psnr", " dB"), ("ssim", ""), ("lpips", ""), ("label_accuracy", "")):
        value = scores.get(name)
        if value is not None and value.available:
            parts.append(f"{name} {value.value:.3g}{unit}")
        elif value is not None:
            parts.append(f"{name} unavailable ({value.unavailable})")
    failed = f" -- {word(rec.trace.failure)}" if rec.trace.stalled else ""
    return f"{attack}: " + ", ".join(parts) + failed + f"; wrote {folder}/comparison.png and metrics.json"
