"""Soteria (Sun et al., CVPR 2021): prune the input representation of one defended layer.

For each input feature ``f`` of the defended ``nn.Linear`` the score
``sum_b ||d r_bf / d x_b|| / |r_bf|`` is computed; the ``ratio`` fraction of features with the
smallest score is pruned, i.e. the matching columns of the layer's weight gradient are
zeroed. Every other gradient tensor (bias included) is shared unchanged.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.models import last_linear
from audit.core.types import Defense, clean_gradients, default_loss_fn, trainable_parameters

from defenses.common import check_range, preserved_buffers, untracked_batchnorm
from defenses.prune import topk_mask
from defenses.registry import DEFENSES


def _batchnorm_in_train_mode(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules())


def _linear_layers(model: nn.Module) -> List[Tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


@DEFENSES.register("soteria", "Prune `ratio` (0.8) of the defended linear layer's input features; only its gradient changes")
class Soteria(Defense):
    """``layer``: ``"last"`` (default), ``"largest"`` (most weights, the Bayes paper's choice)
    or a module name from ``model.named_modules()`` (for the built models, its index)."""

    name = "soteria"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = False

    def __init__(self, ratio: float = 0.8, layer="last", chunk: int = 64):
        self.ratio = check_range(self.name, "ratio", ratio, 0, 1, high_open=True)
        self.layer = str(layer)
        self.chunk = check_range(self.name, "chunk", chunk, 1, None, integer=True)

    def defended_layer(self, model: nn.Module) -> Tuple[str, nn.Linear]:
        linears = _linear_layers(model)
        if not linears:
            raise ConfigError(f"soteria: {type(model).__name__} has no nn.Linear layer to defend")
        if self.layer == "last":
            return last_linear(model)
        if self.layer == "largest":
            return max(linears, key=lambda nm: nm[1].weight.numel())
        for n, m in linears:
            if n == self.layer:
                return n, m
        raise ConfigError(
            f"soteria: layer={self.layer!r} is not an nn.Linear of the model; valid: last, largest, "
            + ", ".join(n for n, _ in linears)
        )

    def defended_parameters(self, model: nn.Module) -> List[int]:
        """Indices (into the trainable parameter list) of the gradients Soteria changes."""
        _, layer = self.defended_layer(model)
        return [i for i, p in enumerate(trainable_parameters(model)) if p is layer.weight]

    def feature_mask(self, model: nn.Module, inputs: Tensor) -> Tensor:
        """Boolean keep-mask over the defended layer's input features (a constant).

        One forward, then the ``f`` VJPs ``d r_f / d x`` (``f`` the layer's input features)
        as batched ``torch.func`` pullbacks, ``chunk / batch`` features at a time. A model with
        BatchNorm in train mode (vmapped, its backward holds memory per seed: 6 GB for 64 seeds
        of ResNet-18 at 32x32) or whose forward ``torch.func`` cannot run takes one autograd
        VJP per feature."""
        _, layer = self.defended_layer(model)
        captured: Dict[str, Tensor] = {}

        def record(mod, inp, out):  # returns None: a returned value would replace the layer's output
            captured.setdefault("r", inp[0])

        def features(x: Tensor) -> Tensor:
            captured.clear()
            hook = layer.register_forward_hook(record)
            try:
                model(x)
            finally:
                hook.remove()
            return captured["r"]

        # BatchNorm leaves its buffers alone; other state the forward changes is restored
        with torch.enable_grad(), untracked_batchnorm(model), preserved_buffers(model):
            pullbacks = None
            if not _batchnorm_in_train_mode(model):
                try:
                    r, pullback = torch.func.vjp(features, inputs.detach())
                    pullbacks = torch.func.vmap(pullback)
                except RuntimeError:  # e.g. a forward that updates its own state in place
                    pullbacks = None
            if pullbacks is None:
                x = inputs.detach().requires_grad_(True)
                r = features(x)

                def pullbacks(seeds: Tensor) -> Tuple[Tensor]:  # one backward's memory at a time
                    return (torch.stack([torch.autograd.grad(r, x, seed, retain_graph=True)[0] for seed in seeds]),)
            if r.dim() != 2:
                raise ConfigError(f"soteria: the defended layer's input must be (batch, features), got {tuple(r.shape)}")
            n_feat = r.shape[1]
            per = max(1, self.chunk // r.shape[0])  # features per batched call: chunk examples' backward
            sensitivity = []
            for start in range(0, n_feat, per):
                idx = torch.arange(start, min(n_feat, start + per), device=r.device)
                seeds = torch.zeros(len(idx), *r.shape, device=r.device, dtype=r.dtype)
                seeds[torch.arange(len(idx)), :, idx] = 1.0
                (jac,) = pullbacks(seeds)
                sensitivity.append(jac.flatten(2).norm(dim=2))  # (chunk, batch)
        dr_dx = torch.cat(sensitivity).T  # (batch, features)
        score = (dr_dx / (r.detach().abs() + 1e-12)).sum(0)  # >= 0: top-k by magnitude = by score
        return topk_mask(score, self.ratio)

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        mask = self.feature_mask(model, inputs)
        grads = clean_gradients(model, inputs, labels, loss_fn)
        defended = self.defended_parameters(model)
        if not defended:
            raise ConfigError("soteria: the defended layer's weight is frozen; defend a trainable layer")
        idx = defended[0]
        grads[idx] = grads[idx] * mask.to(grads[idx].dtype)
        return grads
