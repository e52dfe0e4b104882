"""Fidelity: does the declared training reproduce the client's real reply?

Before any attack, the declared local training (steps or epochs, batch size, lr, optimiser,
client mode) runs on the declared images from the global model the client received, with the
defense's deterministic part: a deterministic per-step defense as it is, a Flower update mod's
clipping of the whole update (weights and buffers together, as Flower clips the ArrayRecord);
a stochastic per-step defense cannot be replayed, so its reply cannot be checked. Per layer
group (the weights' update, the buffers' change) the real reply is compared with the replay:
cosine and norm ratio (real / replayed). Without noise the groups must agree to
:data:`COSINE_MIN` and :data:`RATIO_TOLERANCE`; with a Flower mod's Gaussian noise of known std
``s`` the residual (real - replayed, every float array) must have the energy of that noise:
``|residual|^2 / (n s^2)`` within :data:`NOISE_SIGMAS` standard deviations of 1, and the replayed
update must carry more energy than that band: where the noise drowns the whole update, no
description could fail the check, so it is "not checkable" (the round is not judged).
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from audit.core.client_training import ClientTraining
from audit.core.types import trainable_names
from audit.engine.audit import client_round  # the audit's own client round (audit.client.observe)
from audit.integrations.flower.reply import NamedArrays, audited_prefix, deployment_module

COSINE_MIN = 0.999  # per layer group, without noise
RATIO_TOLERANCE = 0.01  # |norm ratio - 1|, without noise
NOISE_SIGMAS = 5.0  # the residual's energy against the declared noise's
NOT_REPRODUCED = "not judged: the declared training does not reproduce the client's update"


@dataclass
class Fidelity:
    """The comparison of the real reply with the replayed training: per group (``update``,
    ``buffers``) its cosine and norm ratio, the noise check when the defense adds noise, whether
    it ``reproduces`` the reply (None: it cannot be checked), and ``differs`` (what does not)."""

    groups: Dict[str, Dict[str, float]] = field(default_factory=dict)
    noise: Optional[Dict[str, float]] = None
    reproduces: Optional[bool] = None
    differs: List[str] = field(default_factory=list)
    reason: str = ""

    def to_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "tolerance": tolerance_text(self.noise is not None)}

    def summary(self) -> str:
        """``update: cosine 1.0000, norm ratio 1.0000; buffers: ...`` (or why it was not checked)."""
        parts = [f"{g}: cosine {v['cosine']:.4f}, norm ratio {v['ratio']:.4f}" for g, v in self.groups.items()]
        if self.noise is not None:
            parts.append(f"residual {self.noise['residual_std_ratio']:.3f} x the declared noise std")
        text = "; ".join(parts) or self.reason
        if self.reproduces is None and parts and self.reason:
            text = f"{self.reason} ({text})"
        return text if self.reproduces is not False else f"{text} (differs: {', '.join(self.differs)})"


def tolerance_text(noisy: bool) -> str:
    if noisy:
        return (f"the residual's energy within {NOISE_SIGMAS:g} standard deviations of the declared Gaussian "
                "noise's")
    return f"cosine >= {COSINE_MIN} and norm ratio within {RATIO_TOLERANCE:.0%} of 1 in every layer group"


def _compare(real: Tensor, expected: Tensor) -> Dict[str, float]:
    real, expected = real.double(), expected.double()
    nr, ne = float(real.norm()), float(expected.norm())
    if ne == 0 and nr == 0:
        return {"cosine": 1.0, "ratio": 1.0, "real_norm": 0.0, "replayed_norm": 0.0}
    cosine = float(real @ expected) / (nr * ne) if nr and ne else 0.0
    ratio = nr / ne if ne else math.inf
    return {"cosine": cosine, "ratio": ratio, "real_norm": nr, "replayed_norm": ne}


def _flat(tensors) -> Tensor:
    items = [t.detach().double().flatten() for t in tensors]
    return torch.cat(items) if items else torch.zeros(0, dtype=torch.float64)


def replay(model, images: Tensor, labels: Tensor, *, defense, training: ClientTraining, round: int,
           seed: int) -> NamedArrays:
    """The state the declared ``training`` ends in, from ``model`` (the audited model holding the
    global state), by the deployment's ``state_dict`` names: the audit's own client round
    (:func:`audit.client.observe.client_round`), buffers as the defense's declared effect leaves them."""
    client = copy.deepcopy(model)
    generator = torch.Generator(device=images.device).manual_seed(int(seed))
    done = client_round(client, images, labels, defense, training, generator=generator, round=round)
    net = deployment_module(model)
    before = dict(net.named_parameters())
    names = trainable_names(net)
    weights = {n: (before[n].detach() - training.lr * g).detach() for n, g in zip(names, done.update)}
    prefix = len(audited_prefix(client))
    return NamedArrays(weights, {n[prefix:]: b for n, b in done.buffers.items()
                                 if n.startswith(audited_prefix(client))}, {})


def compare(before: NamedArrays, real: NamedArrays, replayed: NamedArrays, noise_std: float = 0.0) -> Fidelity:
    """The real reply against the replayed training, from the global state ``before``."""
    out = Fidelity()
    weights = list(before.weights)
    out.groups["update"] = _compare(_flat(before.weights[n] - real.weights[n] for n in weights),
                                    _flat(before.weights[n] - replayed.weights[n] for n in weights))
    floats = [n for n, b in real.buffers.items() if b.is_floating_point() and n in before.buffers]
    if floats:
        out.groups["buffers"] = _compare(_flat(real.buffers[n] - before.buffers[n] for n in floats),
                                         _flat(replayed.buffers[n] - before.buffers[n] for n in floats))
    if noise_std > 0:
        keys = weights + floats
        residual = _flat([real.state()[k] - replayed.state()[k] for k in keys])
        n = residual.numel()
        energy = float(residual.pow(2).sum()) / (n * noise_std ** 2)
        band = NOISE_SIGMAS * math.sqrt(2.0 / n)
        signal = float(_flat([replayed.state()[k].double() - before.state()[k].double() for k in keys]).pow(2).sum())
        signal /= n * noise_std ** 2
        out.noise = {"noise_std": noise_std, "entries": n, "residual_std_ratio": math.sqrt(energy),
                     "energy_ratio": energy, "band": band, "signal_energy_ratio": signal}
        if signal <= band:  # even a description that trained nothing would pass: the check sees nothing
            out.reason = (f"fidelity not checkable under this noise: the replayed update's energy is {signal:.3g} "
                          f"of the noise's over its {n} entries, inside the check's band ({band:.3g}), so a wrong "
                          "training description would pass unseen")
            return out
        out.reproduces = abs(energy - 1.0) <= band
        if not out.reproduces:
            out.differs = ["update" + (" and buffers" if floats else "") + " (the residual is not the declared noise)"]
        return out
    out.differs = [g for g, v in out.groups.items()
                   if not (v["cosine"] >= COSINE_MIN and abs(v["ratio"] - 1.0) <= RATIO_TOLERANCE)]
    out.reproduces = not out.differs
    return out


def unverifiable(reason: str) -> Fidelity:
    return Fidelity(reproduces=None, reason=reason)
