"""A fixed, seeded random projection of a flattened gradient (the learned inverter's input).

A dense Gaussian projection of a 10M-parameter gradient to a few thousand dimensions would
need a 10M x 2048 matrix; a *sparse sign sketch* (each gradient coordinate is added, with
a random sign, to ``hashes`` random buckets, scaled by ``1/sqrt(hashes)``) is a
Johnson-Lindenstrauss projection that costs O(hashes * D) memory and time and runs as one
``index_add_`` for a whole batch. A gradient that already has at most ``dim`` entries is
passed through unchanged (no projection can add information).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from audit.core.errors import ConfigError


def flatten_gradients(grads: Sequence[Tensor]) -> Tensor:
    """``[g_1, ..., g_L]`` (per-parameter tensors) -> one flat vector."""
    return torch.cat([g.reshape(-1) for g in grads])


def flatten_gradient_batch(grads: Sequence[Tensor]) -> Tensor:
    """Per-parameter tensors with a leading batch dim ``(P, *shape)`` -> ``(P, D)``."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1)


class GradientSketch:
    """``sketch(flat)`` maps ``(D,)`` or ``(P, D)`` gradients to ``(dim,)`` / ``(P, dim)``.

    The buckets and signs are drawn once from ``seed`` on the CPU (same numbers on every
    device) and moved to the gradients' device on first use. ``out_dim`` is the feature
    size: ``dim``, or ``input_dim`` when that is smaller (identity).
    """

    def __init__(self, input_dim: int, dim: int, hashes: int = 2, seed: int = 0):
        if input_dim < 1 or dim < 1:
            raise ConfigError(f"sketch dimensions must be >= 1, got input {input_dim}, output {dim}")
        if hashes < 1:
            raise ConfigError(f"sketch hashes must be >= 1, got {hashes}")
        self.input_dim, self.dim, self.hashes, self.seed = int(input_dim), int(dim), int(hashes), int(seed)
        self.identity = self.input_dim <= self.dim
        self.out_dim = self.input_dim if self.identity else self.dim
        if self.identity:
            return
        gen = torch.Generator().manual_seed(self.seed)
        self._buckets = torch.randint(0, self.dim, (self.hashes, self.input_dim), generator=gen)
        signs = torch.randint(0, 2, (self.hashes, self.input_dim), generator=gen) * 2 - 1
        self._signs = signs.float() / self.hashes ** 0.5

    def _on(self, device: torch.device, dtype: torch.dtype):
        if self._buckets.device != device or self._signs.dtype != dtype:
            self._buckets = self._buckets.to(device)
            self._signs = self._signs.to(device=device, dtype=dtype)
        return self._buckets, self._signs

    def __call__(self, flat: Tensor) -> Tensor:
        single = flat.dim() == 1
        batch = flat.unsqueeze(0) if single else flat
        if batch.shape[1] != self.input_dim:
            raise ConfigError(
                f"gradient has {batch.shape[1]} entries but the sketch was built for {self.input_dim}; "
                "the model changed since the inverter was trained (retrain it)"
            )
        if self.identity:
            return flat
        buckets, signs = self._on(batch.device, batch.dtype)
        out = batch.new_zeros(batch.shape[0], self.dim)
        for h in range(self.hashes):
            out.index_add_(1, buckets[h], batch * signs[h])
        return out[0] if single else out
