"""The manifest an audit writes before it attacks: its settings, the plan, the threat model
(what the attacker is given, read off a real observation), the null's evidence, the risk ball,
the data and the seeds. The report is rendered from it and the stored results."""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Dict, Sequence

from torch import nn

from attacks.side_information import side_information as attack_side_information
from audit.core.buffers import buffer_effect, upload_statistics
from audit.core.errors import GiaError
from audit.core.files import atomic_write_bytes
from audit.core.manifest import Manifest
from audit.core.reasons import Reason
from audit.engine.identity import data_identity, versions
from audit.engine.null import null_evidence
from audit.engine.scoring import PSNR_CAP
from audit.report.reasons import word
from audit.report.store import ResultStore

CLIENT_MODE_TEXT = {
    "train": "train: the client computes its update in train mode (BatchNorm normalises with the private "
             "batch's own statistics, as clients train)",
    "eval": "eval: the client computes its update in eval mode (BatchNorm uses the running statistics in the "
            "model's buffers, which the attacker sees)",
}
#: the resolved config, written beside the report: ``--config OUT/config.toml`` replays the run
CONFIG_FILE = "config.toml"
METRIC_NOTES = [f"PSNR per image on [0, 1]; an exact reconstruction (infinite PSNR) counts as {PSNR_CAP:g} dB",
                "batch reconstructions are matched to the private images by an optimal assignment on MSE",
                "label accuracy: the fraction of private labels recovered (as a multiset)"]


def key_settings(audit: Any) -> Dict[str, Any]:
    """Every setting that changes a number. Steps, the image count and the attack list are left
    out on purpose: adding a step, an image or an attack reuses the rest."""
    return {
        "defense": audit.defense_ident,
        "model": audit.model_ident,
        "data": data_identity(audit.dataset, audit.data_settings.data_args, audit.data_settings.image_size),
        "fl": asdict(audit.fl_settings), "batch_size": audit.data_settings.batch_size,
        "budget": audit.attack_settings.budget_description(),
        "seed": audit.seed, "share_labels": audit.data_settings.share_labels, "device": audit.device.type,
        "evidence": {"pool": audit.null.pool_size, "candidates": audit.null.candidates,
                     "similarity": audit.null.similarity.name},
    }


def settings(audit: Any) -> Dict[str, Any]:
    """The manifest's ``settings``: the key's and the ones a rerun may change."""
    out, attacks = audit.output_settings, audit.attack_settings
    return {**audit.key_settings(), "steps": list(attacks.steps), "images": audit.data_settings.images,
            "checkpoint": None if audit.model_settings.checkpoint is None else str(audit.model_settings.checkpoint),
            "attacks": list(attacks.names), "attack_args": attacks.args, "utility": out.utility,
            "utility_steps": out.utility_steps, "utility_seeds": out.utility_seeds, "risk_delta": audit.delta}


def write_manifest(audit: Any, store: ResultStore, specs: Sequence[Any], plan: Dict[str, Any]) -> None:
    """Everything the report needs besides the results, written before any attack runs."""
    store.update_manifest(Manifest(
        run_key=store.key, status="running", settings=audit.settings(), steps=list(audit.attack_settings.steps),
        images=audit.data_settings.images, attacks=[s.to_dict() for s in specs], plan=plan,
        defense=audit.defense_ident, differences=list(getattr(audit.defense, "differences", ()) or ()),
        privacy=audit.privacy(), threat_model=audit.threat_model(specs),
        thresholds=audit.output_settings.thresholds.to_dict(),
        null={"description": audit.null.describe(),
              "images": [[e.to_dict() for e in batch] for batch in null_evidence(audit.null, audit.private)]},
        risk_delta={"delta": audit.delta, "description": delta_description(audit.delta, audit.dataset)},
        data=data_description(audit.dataset, audit.private),
        seeds={"seed": audit.seed, "model_init": audit.seed, "private_batches": audit.seed,
               "per_task": "derive_seed(seed, kind, step, attack, image) (sha256)"},
        versions=versions(), failures=list(store.load_manifest().failures or []), metric_notes=METRIC_NOTES))


def write_config(store: ResultStore, config: Any, out: Any) -> None:
    """The run's config (None: the audit was built from sections) as the manifest's ``config``
    record, and as ``OUT/config.toml`` when it can be replayed (``--config`` then resumes the run)."""
    if config is None:
        return
    record = config.record()
    store.update_manifest(config=record)
    if record["replayable"]:
        atomic_write_bytes(Path(out) / CONFIG_FILE, config.toml().encode())


def side_information(audit: Any) -> Dict[str, Dict[str, Any]]:
    """What the attacks use beyond the shared weights, read off the first observation
    (:mod:`attacks.side_information`), per item a :class:`~audit.core.reasons.Reason`'s JSON
    object (the report words it): the optimisation attacks (ig, gi, the portfolio and the
    adaptive attacks built on them) add each term they use; the others ignore it."""
    x, y = audit.private[0]
    try:
        obs = audit.observe(audit.model, x, y, 0, 0)
    except GiaError as err:
        return {"unavailable": Reason("first-observation-failed", error=str(err)).to_dict()}
    side = attack_side_information(obs, "auto")
    return {k: (Reason(v.code, **v.params, every_attack=True) if k in side.used else Reason.of(v)).to_dict()
            for k, v in side.notes.items()}


def threat_model(audit: Any, specs: Sequence[Any]) -> Dict[str, Any]:
    """What the attacker was given; from a real observation of step 0, image 0."""
    x, y = audit.private[0]
    obs = None
    try:
        obs = audit.observe(audit.model, x, y, 0, 0)
        declared = obs.threat_model()
    except GiaError as err:
        declared = {"unavailable": f"the defense failed on the first observation: {err}"}
    data, train = audit.dataset, len(audit.dataset.train_labels)
    return {
        **declared,
        "private_data": f"{data.name} test split: {audit.data_settings.images} private batch(es) of "
                        f"{audit.data_settings.batch_size} image(s) of the audited client, never given to the attacker",
        "training_data": f"{data.name} train split ({train} images), split between {audit.fl_settings.clients} "
                         "client(s); disjoint from the private test split",
        "attacker_auxiliary_data": f"the {data.name} train split ({train} images and labels), declared to every "
                                   "attack as extras aux_images / aux_labels; the only data learned attacks may use",
        "attacks_run": [s.id for s in specs],
        "client_mode": CLIENT_MODE_TEXT[audit.fl_settings.client_mode],
        "model_state": state_description(audit.model_settings, audit.seed),
        "client_training": audit.fl_settings.training_description(),
        **buffer_note(obs, audit.defense, audit.fl_settings.shares),
    }


def state_description(settings: Any, seed: int) -> str:
    """What the model of audited step 0 is, for the threat model."""
    if settings.checkpoint is not None:
        start = f"the weights of checkpoint {settings.checkpoint}"
    elif isinstance(settings.model, nn.Module):
        start = "the weights of the given module"
    else:
        start = f"a fresh initialisation (seed {seed})"
    return f"step 0 is {start}; step N is N FL rounds of defended training after it"


def buffer_note(obs, defense, shares: str) -> Dict[str, str]:
    """The threat model's lines on the uploaded buffers (shares="state" only): what the defense
    declares it does to them (:func:`audit.core.buffers.buffer_effect`) and whether the upload
    of ``obs`` (None: no observation) reveals the batch's statistics (:func:`upload_statistics`)."""
    if shares != "state":
        return {}
    effect = buffer_effect(defense)
    std = getattr(defense, "buffer_noise_std", None)
    if std is not None and effect.name == "noised":
        effect = replace(effect, text=effect.text.replace("std buffer_noise_std", f"std {float(std):.3g}"))
    if obs is None:
        return {"buffers": f"{effect.name}: {effect.text}", "buffers_reveal": "not judged: no observation"}
    revealed, why = upload_statistics(obs)
    return {"buffers": f"{effect.name}: {effect.text}",
            "buffers_reveal": word(revealed.reason()) if revealed is not None else f"nothing: {word(why)}"}


def delta_description(delta: float, dataset) -> str:
    c, h, w = dataset.input_shape
    rmse = delta / math.sqrt(c * h * w)
    psnr = -20 * math.log10(rmse) if rmse > 0 else float("inf")
    return (f"l2 norm over the {c}x{h}x{w} pixels of an image in [0, 1]; = per-pixel RMSE {rmse:.3g}, "
            f"i.e. PSNR {psnr:.1f} dB")


def data_description(dataset, private) -> Dict[str, Any]:
    return {"name": dataset.name, "input_shape": list(dataset.input_shape), "classes": dataset.num_classes,
            "train_images": len(dataset.train_labels), "test_images": len(dataset.test_labels),
            "private_labels": [y.tolist() for _, y in private],
            "splits": "FL clients train on the train split; the private batches come from the disjoint test split"}


