"""Label inference from the last-layer gradient, and how an attack gets its labels.

For mean cross-entropy the classifier bias gradient is ``db_c = mean_i p_ic - n_c / B``
(``p`` the softmax outputs, ``n_c`` the count of class ``c``) and the weight gradient rows
are ``dW_c = mean_i (p_ic - y_ic) h_i`` with non-negative features ``h_i`` after ReLU /
sigmoid. Methods (registry :data:`LABEL_METHODS`):

* ``idlg`` -- batch 1: the only negative entry of ``db`` (or the most negative ``dW`` row
  sum without a bias) is the label (Zhao et al., iDLG).
* ``counts`` -- any batch: estimate ``mean p`` by running the white-box model on random
  probe images, then ``n_c ~ B (mean p_c - db_c)``; without a bias, ``db`` is replaced by
  ``dW`` row sums divided by the feature-norm scale, calibrated on classes with positive
  row sums. Every class with a negative entry gets at least one label; the rest is given
  by largest remainder. FedAvg updates are divided by the number of local steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from audit.core.reasons import Reason
from audit.core.errors import ConfigError, NotApplicable
from audit.core.models import last_linear
from audit.core.registry import Registry
from audit.core.types import Observation, trainable_names

LABEL_METHODS = Registry("label method")


@dataclass
class LabelInference:
    """Inferred labels ``(B,)`` (sorted by class for batch methods) and how they were found."""

    labels: Tensor
    method: str
    note: Any  # a Reason's JSON object (the report words it)
    counts: Optional[list] = None

    def info(self) -> Dict[str, Any]:
        out = {"method": self.method, "note": self.note, "labels": self.labels.tolist()}
        if self.counts is not None:
            out["counts"] = self.counts
        return out


def last_layer_gradients(observation: Observation) -> Tuple[Tensor, Optional[Tensor]]:
    """``(dW, db)`` of the classifier head from the shared gradients (per local step)."""
    name, _ = last_linear(observation.model)
    names = trainable_names(observation.model)
    if f"{name}.weight" not in names:
        raise NotApplicable(Reason("labels-head-frozen", layer=name))
    steps = max(1, observation.local_steps)
    dw = observation.gradients[names.index(f"{name}.weight")].detach() / steps
    db = None
    if f"{name}.bias" in names:
        db = observation.gradients[names.index(f"{name}.bias")].detach() / steps
    return dw, db


@LABEL_METHODS.register("idlg", "batch 1: the negative entry of the last-layer bias / weight-row gradient")
def idlg(observation: Observation, seed: int = 0) -> LabelInference:
    if observation.batch_size != 1:
        raise NotApplicable(Reason("idlg-one-image", batch=observation.batch_size))
    dw, db = last_layer_gradients(observation)
    score, source = (db, "bias") if db is not None else (dw.sum(dim=1), "weight-row sums")
    label = int(torch.argmin(score))
    negative = int((score < 0).sum())
    note = Reason("labels-idlg", source=source, negative=negative).to_dict()
    return LabelInference(torch.tensor([label], device=dw.device), "idlg", note)


def mean_probabilities(observation: Observation, seed: int, probes: int = 32) -> Tensor:
    """Mean softmax output of the observation's model (client mode) on uniform random images."""
    from attacks.simulator import ClientReplica

    replica = ClientReplica(observation)
    gen = torch.Generator(device=observation.device).manual_seed(int(seed))
    x = torch.rand((probes, *observation.input_shape), generator=gen, device=observation.device)
    with torch.no_grad():
        return torch.softmax(replica.forward(replica.params, x), dim=1).mean(0)


def allocate_counts(estimate: Tensor, present: Tensor, batch_size: int) -> Tensor:
    """Integer counts summing to ``batch_size``: one for each ``present`` class (largest
    estimates first), the rest one at a time to the largest remaining estimate."""
    counts = torch.zeros_like(estimate, dtype=torch.long)
    order = torch.argsort(estimate, descending=True)
    for c in order[present[order]][:batch_size]:
        counts[c] = 1
    for _ in range(batch_size - int(counts.sum())):
        counts[torch.argmax(estimate - counts)] += 1
    return counts


@LABEL_METHODS.register("counts", "any batch: class counts from the last-layer gradient and probe softmax means")
def counts(observation: Observation, seed: int = 0) -> LabelInference:
    b = observation.batch_size
    dw, db = last_layer_gradients(observation)
    p_mean = mean_probabilities(observation, seed).to(dw.dtype)
    if db is not None:
        signal, how = db, "bias gradient"
    else:
        rows = dw.sum(dim=1)
        ratio = rows / p_mean.clamp_min(1e-12)
        positive = ratio[rows > 0]
        if positive.numel() == 0:
            raise NotApplicable(Reason("counts-no-positive-rows"))
        signal, how = rows / positive.median(), "weight-row sums / calibrated feature scale"
    estimate = b * (p_mean - signal)
    present = signal < 0
    n = allocate_counts(estimate, present, b)
    labels = torch.repeat_interleave(torch.arange(len(n), device=dw.device), n)
    note = Reason("labels-counts", source=how, negative=int(present.sum())).to_dict()
    return LabelInference(labels, "counts", note, counts=n.tolist())


def infer_labels(observation: Observation, method: str = "auto", seed: int = 0) -> LabelInference:
    """Labels for an attack: the shared ones if the protocol shares them, else ``method``
    (``auto``: ``idlg`` at batch 1, ``counts`` otherwise)."""
    if observation.labels_shared:
        return LabelInference(observation.labels.to(observation.device).long(), "shared",
                              Reason("labels-shared").to_dict())
    if method == "auto":
        method = "idlg" if observation.batch_size == 1 else "counts"
    return LABEL_METHODS.get(method)(observation, seed=seed)


# --------------------------------------------------------------------------- optimisation side
@dataclass
class LabelPlan:
    """How an attack run handles labels: fixed (shared / inferred) or optimised (DLG).

    ``shape`` is the per-restart shape of the label variable (``None``: nothing to optimise).
    """

    fixed: Optional[Tensor]
    shape: Optional[Tuple[int, int]]
    info: Dict[str, Any] = field(default_factory=dict)

    def targets(self, variable: Optional[Tensor]) -> Tensor:
        """What the client's loss receives: class indices or soft labels (probabilities)."""
        return self.fixed if self.fixed is not None else torch.softmax(variable, dim=-1)

    def final(self, variable: Optional[Tensor]) -> Tensor:
        return self.fixed.clone() if self.fixed is not None else variable.argmax(dim=-1)


LABEL_STRATEGIES = ("infer", "shared", "optimize", *LABEL_METHODS.names())


def plan_labels(strategy: str, observation: Observation, seed: int = 0) -> LabelPlan:
    """``infer`` (shared if available, else inferred), ``shared`` (required), ``optimize``
    (DLG: soft labels optimised jointly unless shared), or a :data:`LABEL_METHODS` name."""
    if strategy not in LABEL_STRATEGIES:
        raise ConfigError(f"unknown label strategy {strategy!r}; valid: {', '.join(LABEL_STRATEGIES)}")
    if strategy == "shared" and not observation.labels_shared:
        raise NotApplicable(Reason("labels-not-shared"))
    if strategy == "optimize" and not observation.labels_shared:
        return LabelPlan(None, (observation.batch_size, observation.num_classes),
                         {"method": "optimize", "note": Reason("labels-optimize").to_dict()})
    method = "auto" if strategy in ("infer", "shared", "optimize") else strategy
    inference = infer_labels(observation, method, seed)
    return LabelPlan(inference.labels, None, inference.info())
