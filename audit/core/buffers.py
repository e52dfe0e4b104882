"""What a client's uploaded BatchNorm buffers reveal about its private batch.

A client that sends its state (``model.state_dict()``, as Flower's PyTorch examples do)
sends every BatchNorm layer's ``running_mean`` / ``running_var`` after its local training.
Each train-mode forward pass updates them as ``new = (1 - m) * old + m * s`` with ``s`` the
batch's mean and *unbiased* variance of the layer's input, so with the global model's
buffers ``old`` the server recovers

    (new - prod_k (1 - m_k) * old) / (1 - prod_k (1 - m_k)) = sum_k w_k s_k,

the exact batch statistics after one local step, and for ``K`` steps the mixture of the
steps' statistics with weights ``w_k = m_k prod_{j>k} (1 - m_j) / (1 - prod_k (1 - m_k))``
(``m_k = 1 / (tracked + k + 1)`` for a layer with ``momentum=None``). The attacker's replica
predicts the same mixture from its own unroll (:mod:`priors.batchnorm`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.core.registry import Registry

NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


def norm_layers(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of every BatchNorm layer, in module order (the replica's order)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, NORM_TYPES)]


def state_buffers(model: nn.Module) -> Dict[str, Tensor]:
    """Every buffer of ``model`` by its ``state_dict`` name, detached copies: what a client
    that uploads its state sends besides its weights."""
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def has_running_stats(model: nn.Module) -> bool:
    """True when the model has BatchNorm layers that keep running statistics."""
    return any(m.track_running_stats and m.running_mean is not None for _, m in norm_layers(model))


@dataclass
class RevealedStatistics:
    """Per BatchNorm layer (module order), the batch statistics the upload reveals: ``means``
    and unbiased ``variances``, each the ``weights``-mixture of the local steps' statistics
    (one weight per local step, summing to 1; a single 1.0 after one step: exact)."""

    layers: List[str]
    means: List[Tensor]
    variances: List[Tensor]
    weights: List[Tuple[float, ...]]

    def tensors(self) -> List[Tensor]:
        """``[mean_0, var_0, mean_1, var_1, ...]`` (an observation's per-member targets)."""
        return [t for pair in zip(self.means, self.variances) for t in pair]

    def reason(self) -> Reason:
        """What they are, as a code and its numbers (``buffers-reveal``: layers, local steps mixed)."""
        return Reason("buffers-reveal", layers=len(self.layers), steps=len(self.weights[0]) if self.weights else 0)


def _factors(module: nn.Module, steps: int) -> List[float]:
    if module.momentum is None:  # cumulative moving average
        tracked = int(module.num_batches_tracked) if module.num_batches_tracked is not None else 0
        return [1.0 / (tracked + k + 1) for k in range(steps)]
    return [float(module.momentum)] * steps


def revealed_statistics(model: nn.Module, uploaded: Optional[Dict[str, Tensor]], steps: int,
                        client_mode: str) -> Tuple[Optional[RevealedStatistics], Optional[Reason]]:
    """The statistics ``uploaded`` (the client's buffers after ``steps`` local steps from
    ``model``'s) reveal, or ``(None, why not)`` (a :class:`~audit.core.reasons.Reason`)."""
    if uploaded is None:
        return None, Reason("buffers-not-shared")
    layers = [(n, m) for n, m in norm_layers(model) if m.track_running_stats and m.running_mean is not None]
    if not layers:
        return None, Reason("no-running-statistics")
    if client_mode != "train":
        return None, Reason("buffers-eval-mode")
    names, means, variances, weights = [], [], [], []
    for name, module in layers:
        prefix = f"{name}." if name else ""
        new_mean, new_var = uploaded.get(prefix + "running_mean"), uploaded.get(prefix + "running_var")
        if new_mean is None or new_var is None:
            return None, Reason("buffers-missing", layer=name)
        factors = _factors(module, steps)
        keep = 1.0
        raw = []
        for f in reversed(factors):
            raw.append(f * keep)
            keep *= 1.0 - f
        raw.reverse()
        total = 1.0 - keep
        if total <= 1e-12:
            return None, Reason("buffers-zero-momentum", layer=name)
        old_mean, old_var = module.running_mean.detach(), module.running_var.detach()
        device = old_mean.device
        names.append(name)
        means.append(((new_mean.to(device) - keep * old_mean) / total).detach())
        variances.append(((new_var.to(device) - keep * old_var) / total).clamp_min(0).detach())
        weights.append(tuple(w / total for w in raw))
    if all(torch.equal(uploaded[(f"{n}." if n else "") + "running_mean"].to(m.running_mean.device), m.running_mean)
           for n, m in layers):
        return None, Reason("buffers-global")
    return RevealedStatistics(names, means, variances, weights), None


# --------------------------------------------------------------------------- what a defense does to them
@dataclass(frozen=True)
class BufferEffect:
    """What a defense does to the buffers a client uploads with its state: ``text`` for the
    threat model; ``records(defense, inputs, generator)`` the inputs whose statistics the
    training loop's forward pass records (``generator`` at the state the defense's call began
    with); ``uploads(defense, trained, before, generator)`` the buffers sent (``trained``: the
    client's after training, ``before``: the global model's); ``reveals``: whether the upload's
    statistics are the attack's to use (:func:`upload_statistics`); ``on_state``: the defense
    transforms the whole reply, weights' update and buffers together, by its
    ``transform_state(update, buffers, before, lr=, generator=)`` (as Flower's mods do), instead
    of each local step's gradient, where the client shares its state."""

    name: str
    text: str
    records: Callable[[Any, Tensor, Optional[torch.Generator]], Tensor]
    uploads: Callable[[Any, Dict[str, Tensor], Dict[str, Tensor], Optional[torch.Generator]], Dict[str, Tensor]]
    reveals: bool = True
    on_state: bool = False


BUFFER_EFFECTS = Registry("buffer effect")
NOT_DECLARED = "not declared"


def _private(defense, inputs, generator):
    return inputs


def _trained(defense, trained, before, generator):
    return trained


def _transformed_inputs(defense, inputs, generator):
    record = getattr(defense, "buffer_inputs", None)
    if not callable(record):
        raise ConfigError(f"defense {getattr(defense, 'name', defense)!r} declares buffer_effect 'transformed' "
                          "but has no buffer_inputs(inputs, generator): add it, or declare another effect")
    return record(inputs, generator)


def _noised(defense, trained, before, generator):
    std = float(getattr(defense, "buffer_noise_std", 0.0))
    return {n: b + std * torch.randn(b.shape, generator=generator, device=b.device, dtype=b.dtype)
            if b.is_floating_point() and std > 0 else b for n, b in trained.items()}


def _dropped(defense, trained, before, generator):
    return {n: b.detach().clone() for n, b in before.items()}


for _effect in (
    BufferEffect("untouched", "the defense acts on the gradient only: the uploaded BatchNorm buffers carry the "
                              "private batch's statistics untouched", _private, _trained),
    BufferEffect("transformed", "the client trains on transformed inputs: the uploaded BatchNorm buffers carry the "
                                "statistics of the batch it trained on (buffer_inputs)", _transformed_inputs, _trained),
    BufferEffect("noised", "the defense adds Gaussian noise to every uploaded buffer (std buffer_noise_std); the "
                           "attacks do not model that noise and leave the buffers' statistics unused",
                 _private, _noised, reveals=False),
    BufferEffect("clipped", "the defense clips the client's whole update, the buffers' change with the weights' "
                            "(one norm over both): the uploaded buffers' change is scaled by a factor the attacker "
                            "does not know, so their statistics are not used", _private, _trained, reveals=False,
                 on_state=True),
    BufferEffect("clipped and noised", "the defense clips the client's whole update, the buffers' change with the "
                                       "weights', and adds Gaussian noise to every array it uploads: the buffers' "
                                       "statistics are not used", _private, _trained, reveals=False, on_state=True),
    BufferEffect("dropped", "the defense uploads the global model's buffers: they carry no batch statistics",
                 _private, _dropped, reveals=False),
    BufferEffect(NOT_DECLARED, "the defense does not declare what it does to the buffers (buffer_effect): the "
                               "simulated client uploads the private batch's statistics untouched, which a real "
                               "client running this defense may not", _private, _trained),
):
    BUFFER_EFFECTS.add(_effect.name, _effect, _effect.text)


def buffer_effect(defense: Any) -> BufferEffect:
    """The effect ``defense`` declares (its ``buffer_effect``); no defense: untouched; a defense
    that declares none: :data:`NOT_DECLARED`."""
    if defense is None:
        return BUFFER_EFFECTS.get("untouched")
    return BUFFER_EFFECTS.get(getattr(defense, "buffer_effect", None) or NOT_DECLARED)


def upload_statistics(obs: Any) -> Tuple[Optional[RevealedStatistics], Optional[Reason]]:
    """The one predicate of "the upload reveals the private batch's statistics": what
    ``obs``' uploaded buffers reveal (:func:`revealed_statistics`) where its defense's
    declared effect leaves them usable, else ``(None, why not)``."""
    effect = BUFFER_EFFECTS.get(getattr(obs, "buffer_effect", "untouched"))
    if obs.buffers is not None and not effect.reveals:
        return None, Reason("buffers-not-revealing", effect=effect.name)
    return revealed_statistics(obs.model, obs.buffers, obs.local_steps, obs.client_mode)
