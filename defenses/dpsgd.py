"""DP-SGD: per-example clipping, averaging, Gaussian noise (Abadi et al.)."""
from __future__ import annotations

import torch

from audit.core.types import Defense, default_loss_fn

from defenses.clip import clip_by_norm
from defenses.common import check_range, per_example_gradients
from defenses.noise import add_noise
from defenses.registry import DEFENSES


@DEFENSES.register(
    "dp-sgd", "Per-example clipping to `clip` + Gaussian noise of std noise_multiplier*clip/batch"
)
class DPSGD(Defense):
    """Clip each example's gradient to norm ``clip`` (whole model, or per layer), average, and
    add ``N(0, (noise_multiplier * clip / B)^2)`` to every coordinate of the average."""

    name = "dp-sgd"
    stochastic = True

    def __init__(self, clip: float = 1.0, noise_multiplier: float = 1.0, per_layer: bool = False):
        self.clip = check_range(self.name, "clip", clip, 0, None, low_open=True)
        self.noise_multiplier = check_range(self.name, "noise_multiplier", noise_multiplier, 0, None)
        self.per_layer = bool(per_layer)

    def noise_std(self, batch_size: int) -> float:
        """Standard deviation of the noise on the averaged gradient of a batch."""
        return self.noise_multiplier * self.clip / batch_size

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        per_example = per_example_gradients(model, inputs, labels, loss_fn)
        clipped = [clip_by_norm(g, self.clip, self.per_layer) for g in per_example]
        mean = [torch.stack(column).mean(0) for column in zip(*clipped)]
        # the per-example passes leave buffers untouched; update them once, as a client would
        with torch.no_grad():
            model(inputs.detach())
        if self.noise_multiplier == 0:
            return mean
        return add_noise(mean, "gaussian", self.noise_std(inputs.shape[0]), generator)
