"""What an audit's attack phases run on, as one frozen record (:class:`BuiltRun`): its settings
sections, its parts as built (device, data set, defense, models), the private batches, the
null and the client it observes. The audit reads it off itself when a phase starts; the
planner, the manifest, the schedule and the runner take it and nothing else of the audit."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from audit.engine.clients import Client
from audit.engine.compose import AuditParts
from audit.engine.null import Null
from audit.engine.settings import Sections

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BuiltRun(Sections):
    """One audit as built: its settings sections (``model`` is the model's settings, ``device``
    the device resolved) and ``parts`` (``parts.model``: the client's model as built);
    ``model_ident``: the audited model's identity; ``delta``: the risk ball's radius;
    ``max_members``: the most observations x restarts batched in one computation; ``label``:
    the progress bar's name; ``cancel``: an event that stops the audit at its next progress
    report once it is set."""

    parts: AuditParts
    model_ident: Dict[str, Any]
    private: Tuple[Batch, ...]
    delta: float
    null: Null
    client: Client
    max_members: int
    label: str = "audit"
    cancel: Optional[threading.Event] = None
