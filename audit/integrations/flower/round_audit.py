"""The engine's audit of one round with the client's real reply as the observation.

:class:`ReplyAudit` is the engine's :class:`~audit.engine.state.StateAudit` of the global model
the client received, whose observation is not simulated: it is the reply the server received
(:mod:`audit.integrations.flower.reply`), the update in gradient units with the uploaded
buffers when the reply holds them (:class:`ReplyClient`). The private batch is the images the
round trained on, in the order it trained on them. A ``cancel`` event stops the audit at its
next progress report (an abandoned inline audit stops using the client's CPU).
"""
from __future__ import annotations

import dataclasses
import hashlib
import threading
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from audit.core.buffers import has_running_stats
from audit.core.types import Observation
from audit.engine.clients import auxiliary_data
from audit.engine.config import AuditConfig
from audit.engine.schedule import Cancelled  # noqa: F401  (re-exported: what a cancelled audit raises)
from audit.engine.settings import FLSettings, ModelSettings
from audit.engine.state import StateAudit
from audit.integrations.flower.reply import audited_prefix, deployment_module, named_arrays, update_in_gradient_units


@dataclass
class ReplyClient:
    """The client of a round: every observation is its ``reply`` (arrays by name) from the
    ``global_arrays`` it received, read once on the model holding the global state. ``fl``: the
    client's declared training; ``extra``: the extras every observation declares."""

    global_arrays: Any
    reply: Any
    round: int
    fl: FLSettings
    defense: Any
    device: Any
    num_classes: int
    share_labels: bool
    extra: Mapping[str, Any]
    observation: Optional[Observation] = None

    def observe(self, model, images, labels, step: int, image: int) -> Observation:
        if self.observation is None:
            self.observation = reply_observation(self, model, images, labels)
        return self.observation


class ReplyAudit(StateAudit):
    """A :class:`StateAudit` of ``round`` whose observation is the client's ``reply`` (arrays by
    name) from the ``global_arrays`` it received (:class:`ReplyClient`); ``trained``: the round's
    images and labels in training order (the client's declared training is the config's);
    ``extra_threat``: lines for the threat model (the fidelity check); ``cancel``: the round's
    event, shared with its control."""

    simulates_client = False  # the reply carries the client's training and its defense as they ran
    control_code = "replica"

    def __init__(self, defense: Any, model: ModelSettings, round: int, *, origin: str, global_arrays, reply,
                 trained, reply_key: str, cancel: Optional[threading.Event] = None,
                 extra_threat: Optional[Dict[str, Any]] = None, **settings: Any):
        self.global_arrays, self.reply, self.reply_key = global_arrays, reply, reply_key
        self.cancel = cancel or threading.Event()
        self.extra_threat = dict(extra_threat or {})
        super().__init__(defense, model, round, origin=origin, **settings)
        self.private = [(trained[0].clone(), trained[1].clone())]
        self._client = ReplyClient(global_arrays, reply, self.round, self.fl_settings, self.defense, self.device,
                                   self.dataset.num_classes, self.data_settings.share_labels,
                                   auxiliary_data(self.dataset))

    def key_settings(self) -> Dict[str, Any]:
        return {**super().key_settings(), "reply": self.reply_key}

    def client(self) -> ReplyClient:
        """The reply as the observation of the model holding the global state."""
        return self._client

    def control_kind(self):
        kind, extra = super().control_kind()
        return ReplicaControl, {**extra, "trained": self.private[0], "cancel": self.cancel}

    def threat_model(self, specs) -> Dict[str, Any]:
        out = super().threat_model(specs)
        out.pop("training_step", None)
        out["private_data"] = (f"the {len(self.private[0][1])} image(s) the client trained on in round {self.round}, "
                               "never given to the attacker")
        out["training_data"] = "the client's own data; the server's global model is the audited state"
        out["shared"] = f"{out.get('shared', '')}: the reply the server received, as the client's mods left it"
        return {**out, "round": self.round, **self.extra_threat}

    def _prepare(self, store):
        specs = super()._prepare(store)
        data = dict(store.load_manifest().data or {})
        data.pop("splits", None)
        data["trained"] = "the audited batch is the images the round trained on; the others are the reference"
        store.update_manifest(data=data)
        return specs

class ReplicaControl(StateAudit):
    """The positive control of a round: the replica's own upload of the round's ``trained``
    images with the declared training and no privacy mod, from the same global model."""

    def __init__(self, *args: Any, trained, cancel: threading.Event, **settings: Any):
        self.cancel = cancel
        super().__init__(*args, **settings)
        self.private = [(trained[0].clone(), trained[1].clone())]
        self.trained_key = hashlib.sha256(b"".join(t.detach().cpu().contiguous().numpy().tobytes()
                                                   for t in trained)).hexdigest()[:12]

    def key_settings(self) -> Dict[str, Any]:
        return {**super().key_settings(), "trained": self.trained_key}


def reply_observation(client: ReplyClient, model, images, labels) -> Observation:
    """The observation of ``client``'s reply on ``model`` (the audited model at the global state)."""
    fl = client.fl
    net = deployment_module(model)
    before = named_arrays(client.global_arrays, net, "the train message")
    after = named_arrays(client.reply, net, "the reply")
    lr, steps = fl.client.lr, fl.client_steps(len(labels))
    prefix = audited_prefix(model)
    buffers = ({prefix + n: v.to(client.device) for n, v in after.buffers.items()}
               if after.buffers and has_running_stats(model) else None)
    defense = client.defense
    if getattr(defense, "whole_update", False) and not (steps == 1 and fl.local_optimizer.plain):
        defense = None  # its transform acts on the whole update, which the attacks cannot replay per step
    first = next(model.parameters())
    shared = [g.to(first.device, first.dtype) for g in update_in_gradient_units(before, after, lr)]
    mean, std = _normalisation(model)
    # what the reply carries decides what was shared: with buffers its state, else the update (gradient for one step)
    training = dataclasses.replace(fl.client, shares="state" if buffers is not None else None)
    return Observation(
        model=model, gradients=shared, input_shape=tuple(images.shape[1:]), num_classes=client.num_classes,
        batch_size=len(labels), labels=labels.clone().to(first.device) if client.share_labels else None,
        training=training, defense=defense, step=client.round,
        data_mean=mean, data_std=std, extra=dict(client.extra), buffers=buffers)


def _normalisation(model):
    """The mean and std of the audited model's Normalize layer (None, None without one)."""
    from audit.core.models import Normalize

    for m in model.modules():
        if isinstance(m, Normalize):
            return tuple(m.mean.flatten().tolist()), tuple(m.std.flatten().tolist())
    return None, None


def audit_config_of(job, folder) -> AuditConfig:
    """The config of ``job``'s round audit: the mod's, with the round's defense, its data set and
    the global state the client received (saved in ``folder``, where the audit writes)."""
    return job.settings.config.replace(
        defense=job.defense, defense_args=dict(job.defense_args or {}) or None, data=job.dataset,
        batch_size=len(job.trained[1]), checkpoint=str(folder / "global_model.pt"), steps=(job.round,), out=str(folder))
