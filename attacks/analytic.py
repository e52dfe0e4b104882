"""Analytic inversion of the input of a fully connected layer with a bias (batch 1).

For ``y = W z + b``: ``dL/dW[i, :] = dL/db[i] * z``, so ``z = dW[i] / db[i]`` for any row with
``db[i] != 0`` (the row with the largest ``|db[i]|`` is the best conditioned). This also
holds for a FedAvg update of one image (every local step sees the same ``z``). When the
first parameterised layer of the model is such a Linear layer (an MLP: only ``Normalize``
/ ``Flatten`` before it) ``z`` is the image; otherwise the attack is not applicable for
image recovery and says which layer's input it could recover instead.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor, nn

from audit.core.models import Normalize
from audit.core.reasons import Reason
from audit.core.types import Observation, Reconstruction, trainable_names

from attacks.labels import infer_labels

_INVERTIBLE = (Normalize, nn.Flatten, nn.Identity)


def leaf_layers(model: nn.Module, prefix: str = "") -> List[Tuple[str, nn.Module]]:
    """The layers of (nested) ``nn.Sequential`` models in execution order, with their names."""
    if not isinstance(model, nn.Sequential):
        return [(prefix, model)]
    out = []
    for name, child in model.named_children():
        out += leaf_layers(child, f"{prefix}.{name}" if prefix else name)
    return out


def _first_biased_linear(layers) -> Optional[Tuple[int, str, nn.Linear]]:
    for i, (name, layer) in enumerate(layers):
        if isinstance(layer, nn.Linear) and layer.bias is not None:
            return i, name, layer
    return None


def _no_linear_reason(layers) -> Reason:
    """Why no first fully connected layer was found: none at all, or one inside a module whose
    forward is not a plain sequence of layers (the layers before it are unknown)."""
    for name, layer in layers:
        if any(isinstance(m, nn.Linear) and m.bias is not None for m in layer.modules()):
            return Reason("analytic-fc-inside-module", module=type(layer).__name__, name=name)
    return Reason("analytic-no-fc-bias")


def input_blocker(layers, index: int) -> Optional[Tuple[str, nn.Module]]:
    """The first layer before ``layers[index]`` that is neither Normalize, Flatten nor Identity
    (None: that layer's input is the image, normalised and flattened)."""
    return next(((n, layer) for n, layer in layers[:index] if not isinstance(layer, _INVERTIBLE)), None)


def layer_input_to_images(z: Tensor, layers, index: int, input_shape) -> Tensor:
    """``(B, features)`` inputs of ``layers[index]`` -> ``(B, C, H, W)`` images: undo each
    Normalize before it (the Flatten becomes the reshape)."""
    x = z.detach()
    for _, layer in reversed(layers[:index]):
        if isinstance(layer, Normalize):
            x = x.reshape(-1, *input_shape) * layer.std.to(x.dtype) + layer.mean.to(x.dtype)
    return x.reshape(-1, *input_shape)


def invert_linear_input(observation: Observation, layer: str) -> Tuple[Tensor, int, float]:
    """``(z, row, |db[row]|)``: the recovered input of the Linear layer named ``layer``."""
    names = trainable_names(observation.model)
    try:
        dw = observation.gradients[names.index(f"{layer}.weight")]
        db = observation.gradients[names.index(f"{layer}.bias")]
    except ValueError:
        raise ValueError(f"layer {layer!r} has no trainable weight and bias") from None
    row = int(torch.argmax(db.abs()))
    return dw[row] / db[row], row, float(db[row].abs())


class AnalyticInversion:
    """Exact first-layer inversion (no optimisation; ``budget`` is unused)."""

    name = "analytic"
    uses_budget = False  # closed form: a larger budget gives it nothing

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress=None) -> Reconstruction:
        layers = leaf_layers(observation.model)
        found = _first_biased_linear(layers)
        if found is None:
            return Reconstruction.not_applicable(_no_linear_reason(layers))
        index, name, linear = found
        first = input_blocker(layers, index)
        if first is not None:
            return Reconstruction.not_applicable(
                Reason("analytic-features-not-image", layer=name, features=linear.in_features, before=first[0],
                       before_type=type(first[1]).__name__),
                feature_layer=name, feature_count=linear.in_features)
        if observation.batch_size != 1:
            return Reconstruction.not_applicable(Reason("analytic-one-image", batch=observation.batch_size))
        if name + ".bias" not in trainable_names(observation.model):
            return Reconstruction.not_applicable(Reason("bias-frozen", layer=name))
        z, row, strength = invert_linear_input(observation, name)
        if strength == 0.0:
            return Reconstruction.not_applicable(Reason("analytic-zero-bias-gradient", layer=name))
        x = layer_input_to_images(z.unsqueeze(0), layers, index, observation.input_shape)
        labels = infer_labels(observation, seed=seed)
        return Reconstruction(x.clamp(0, 1), labels.labels, {
            "attack": self.name, "layer": name, "row": row, "bias_gradient": strength,
            "raw_range": [float(x.min()), float(x.max())], "labels": labels.info(),
            "note": Reason("analytic-read", defense=None if observation.defense is None
                           else observation.defense.name).to_dict(),
        })
