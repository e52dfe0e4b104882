"""The manifest an audit writes before it attacks: its settings, the plan, the threat model
(what the attacker is given, read off a real observation), the null's evidence, the risk ball,
the data and the seeds, from the audit as built (:class:`~audit.engine.built.BuiltRun`) and
the entries the audit computes itself. The report is rendered from it and the stored results."""
from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from torch import nn

from attacks.side_information import side_information as attack_side_information
from audit.core.buffers import buffer_effect, upload_statistics
from audit.core.errors import GiaError
from audit.core.files import atomic_write_bytes
from audit.core.manifest import Manifest
from audit.core.reasons import Reason
from audit.core.types import Observation
from audit.engine.built import BuiltRun
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


def key_settings(run: BuiltRun) -> Dict[str, Any]:
    """Every setting that changes a number. Steps, the image count and the attack list are left
    out on purpose: adding a step, an image or an attack reuses the rest."""
    parts, data, null = run.parts, run.data_settings, run.null
    return {
        "defense": parts.defense_ident,
        "model": run.model_ident,
        "data": data_identity(parts.dataset, data.data_args, data.image_size),
        "fl": asdict(run.fl_settings), "batch_size": data.batch_size,
        "budget": run.attack_settings.budget_description(),
        "seed": run.seed, "share_labels": data.share_labels, "device": parts.device.type,
        "evidence": {"pool": null.pool_size, "candidates": null.candidates, "similarity": null.similarity.name},
    }


def settings(run: BuiltRun, key: Dict[str, Any]) -> Dict[str, Any]:
    """The manifest's ``settings``: the run key's ``key`` and the ones a rerun may change."""
    out, attacks, checkpoint = run.output_settings, run.attack_settings, run.model.checkpoint
    return {**key, "steps": list(attacks.steps), "images": run.data_settings.images,
            "checkpoint": None if checkpoint is None else str(checkpoint),
            "attacks": list(attacks.names), "attack_args": attacks.args, "utility": out.utility,
            "utility_steps": out.utility_steps, "utility_seeds": out.utility_seeds, "risk_delta": run.delta}


def write_manifest(store: ResultStore, run: BuiltRun, specs: Sequence[Any], plan: Dict[str, Any], *,
                   key: Dict[str, Any], privacy: Dict[str, Any], threat_model: Dict[str, Any]) -> None:
    """Everything the report needs besides the results, written before any attack runs; the
    audit's own entries: its run ``key``'s settings (:func:`key_settings`), ``privacy`` and
    ``threat_model``."""
    defense, dataset, null = run.parts.defense, run.parts.dataset, run.null
    store.update_manifest(Manifest(
        run_key=store.key, status="running", settings=settings(run, key), steps=list(run.attack_settings.steps),
        images=run.data_settings.images, attacks=[s.to_dict() for s in specs], plan=plan,
        defense=run.parts.defense_ident, differences=list(getattr(defense, "differences", ()) or ()),
        privacy=privacy, threat_model=threat_model, thresholds=run.output_settings.thresholds.to_dict(),
        null={"description": null.describe(),
              "images": [[e.to_dict() for e in batch] for batch in null_evidence(null, run.private)]},
        risk_delta={"delta": run.delta, "description": delta_description(run.delta, dataset)},
        data=data_description(dataset, run.private),
        seeds={"seed": run.seed, "model_init": run.seed, "private_batches": run.seed,
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


def first_observation(run: BuiltRun) -> Tuple[Optional[Observation], Optional[GiaError]]:
    """The client's observation of step 0, image 0 (on the model as built), or the defense's error on it."""
    x, y = run.private[0]
    try:
        return run.client.observe(run.parts.model, x, y, 0, 0), None
    except GiaError as err:
        return None, err


def side_information(run: BuiltRun) -> Dict[str, Dict[str, Any]]:
    """What the attacks use beyond the shared weights, read off the first observation
    (:mod:`attacks.side_information`), per item a :class:`~audit.core.reasons.Reason`'s JSON
    object (the report words it): the optimisation attacks (ig, gi, the portfolio and the
    adaptive attacks built on them) add each term they use; the others ignore it."""
    obs, error = first_observation(run)
    if error is not None:
        return {"unavailable": Reason("first-observation-failed", error=str(error)).to_dict()}
    side = attack_side_information(obs, "auto")
    return {k: (Reason(v.code, **v.params, every_attack=True) if k in side.used else Reason.of(v)).to_dict()
            for k, v in side.notes.items()}


def threat_model(run: BuiltRun, specs: Sequence[Any]) -> Dict[str, Any]:
    """What the attacker was given; from a real observation of step 0, image 0."""
    obs, error = first_observation(run)
    if error is None:
        try:
            declared = obs.threat_model()
        except GiaError as err:
            error = err
    if error is not None:
        declared = {"unavailable": f"the defense failed on the first observation: {error}"}
    data, train, fl = run.parts.dataset, len(run.parts.dataset.train_labels), run.fl_settings
    return {
        **declared,
        "private_data": f"{data.name} test split: {run.data_settings.images} private batch(es) of "
                        f"{run.data_settings.batch_size} image(s) of the audited client, never given to the attacker",
        "training_data": f"{data.name} train split ({train} images), split between {fl.clients} "
                         "client(s); disjoint from the private test split",
        "attacker_auxiliary_data": f"the {data.name} train split ({train} images and labels), declared to every "
                                   "attack as extras aux_images / aux_labels; the only data learned attacks may use",
        "attacks_run": [s.id for s in specs],
        "client_mode": CLIENT_MODE_TEXT[fl.client_mode],
        "model_state": state_description(run.model, run.seed),
        "client_training": fl.training_description(),
        **buffer_note(obs, run.parts.defense, fl.shares),
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


