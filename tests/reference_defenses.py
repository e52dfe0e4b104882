"""Straightforward reference implementations of the defenses whose built-in versions are
batched for speed: one loop per candidate, feature or layer, in the plainest precision.
The tests compare the built-in defenses with these (same generator draws where the draw
order is kept, else the same distribution)."""
from __future__ import annotations

import math
from typing import List

import torch
from torch import Tensor, nn
from torch.func import functional_call

from audit.core.models import last_linear, preserved_buffers
from audit.core.types import clean_gradients, default_loss_fn, trainable_parameters


def _flat(tensors) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# --------------------------------------------------------------------------- CENSOR
def censor(model: nn.Module, inputs: Tensor, labels: Tensor, *, trials: int = 20, eta: float = 1e-4,
           layerwise: bool = True, generator=None, loss_fn=default_loss_fn) -> List[Tensor]:
    """Per group (layer, or the whole model): ``trials`` Gaussian draws ``(trials, n)``, the rows
    split in 4 near-equal parts, part ``j`` from a generator seeded with the ``j``-th of 4 seeds
    drawn from ``generator`` (each part's rows of every group in turn), projected (float64, twice) off the span of the batch and per-example gradients
    and rescaled to the clean norm; every candidate scored one at a time in float64, eval mode."""
    grads = clean_gradients(model, inputs, labels, loss_fn)
    spans = [[g] for g in grads]
    with preserved_buffers(model):
        for i in range(inputs.shape[0] - 1 if inputs.shape[0] > 1 else 0):
            for span, g in zip(spans, clean_gradients(model, inputs[i:i + 1], labels[i:i + 1], loss_fn)):
                span.append(g)
    groups = [[i] for i in range(len(grads))] if layerwise else [list(range(len(grads)))]
    cands: List[Tensor] = [None] * len(grads)  # type: ignore[list-item]
    seeds = torch.randint(0, 2 ** 62, (4,), generator=generator).tolist()
    streams = [torch.Generator().manual_seed(int(s)) for s in seeds]
    bounds = [trials * j // 4 for j in range(5)]
    for group in groups:
        clean = _flat([grads[i] for i in group])
        draws = torch.cat([torch.randn((bounds[j + 1] - bounds[j], clean.numel()), generator=streams[j],
                                       dtype=clean.dtype) for j in range(4)])
        norm = clean.norm()
        if float(norm.detach()) == 0.0:
            cand = torch.zeros_like(draws)
        else:
            span = torch.stack([_flat([spans[i][k] for i in group]) for k in range(len(spans[group[0]]))]).double()
            basis = (span[0] / span[0].norm()).unsqueeze(1) if span.shape[0] == 1 else torch.linalg.qr(span.T)[0]
            out = draws.double()
            for _ in range(2):
                out = out - (out @ basis) @ basis.T
            cand = (out * (norm.double() / out.norm(dim=1, keepdim=True))).to(clean.dtype)
        start = 0
        for i in group:
            cands[i] = cand[:, start:start + grads[i].numel()].reshape(trials, *grads[i].shape)
            start += grads[i].numel()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach().double() for n, p in model.named_parameters()}
    buffers = {n: b.detach().double() if b.is_floating_point() else b for n, b in model.named_buffers()}
    losses = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for t in range(trials):
            moved = dict(params)
            for n, c in zip(names, cands):
                moved[n] = params[n] - eta * c[t].detach().double()
            losses.append(float(loss_fn(functional_call(model, (moved, buffers), (inputs.detach().double(),)), labels)))
    model.train(was_training)
    best = min(range(trials), key=lambda t: losses[t])
    return [c[best] for c in cands]


# --------------------------------------------------------------------------- Soteria
def soteria_scores(model: nn.Module, inputs: Tensor) -> Tensor:
    """``sum_b ||d r_bf / d x|| / |r_bf|`` per input feature ``f`` of the last linear layer,
    one backward pass per feature (the forward's buffer updates undone)."""
    _, layer = last_linear(model)
    captured = {}
    hook = layer.register_forward_hook(lambda m, i, o: captured.setdefault("r", i[0]))
    x = inputs.detach().requires_grad_(True)
    with torch.enable_grad(), preserved_buffers(model):
        model(x)
        hook.remove()
        r = captured["r"]
        rows = []
        for f in range(r.shape[1]):
            seed = torch.zeros_like(r)
            seed[:, f] = 1.0
            (jac,) = torch.autograd.grad(r, x, seed, retain_graph=True)
            rows.append(jac.flatten(1).norm(dim=1))
    return (torch.stack(rows, dim=1) / (r.detach().abs() + 1e-12)).sum(0)


def soteria(model: nn.Module, inputs: Tensor, labels: Tensor, *, ratio: float = 0.8,
            loss_fn=default_loss_fn) -> List[Tensor]:
    """The clean gradient with the last linear layer's weight columns of the ``ratio`` fraction
    of lowest-scoring features zeroed."""
    score = soteria_scores(model, inputs)
    keep = score.numel() - int(round(ratio * score.numel()))
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    mask[torch.argsort(score, descending=True)[:keep]] = True
    grads = clean_gradients(model, inputs, labels, loss_fn)
    _, layer = last_linear(model)
    return [g * mask.to(g.dtype) if p is layer.weight else g for g, p in zip(grads, trainable_parameters(model))]


# --------------------------------------------------------------------------- SVDefense
def svdefense(grads: List[Tensor], *, eta: float = 0.3, energy=None, weighting: str = "sqrt") -> List[Tensor]:
    """Per weight tensor: rows weighted by their norms (``sqrt``) or squared norms, a float32
    SVD, the smallest rank keeping ``E = 1 - exp(-eta H)`` of the spectral energy (or
    ``energy``), and ``W^-1 U_k U_k^T W G``; 1-D tensors unchanged."""
    out = []
    for g in grads:
        matrix = g.reshape(g.shape[0], -1) if g.dim() >= 2 else None
        w = None if matrix is None else (matrix ** 2).sum(1)
        if matrix is None or float(w.max()) == 0.0:
            out.append(g)
            continue
        w = w.sqrt() if weighting == "sqrt" else w
        u, s, _ = torch.linalg.svd(w[:, None] * matrix, full_matrices=False)
        p = (s ** 2 / (s ** 2).sum())
        p = p[p > 0]
        e = energy if energy is not None else min(1.0, 1.0 - math.exp(-eta * float(-(p * p.log()).sum())))
        cum = torch.cumsum(s.double() ** 2, 0)
        k = max(1, min(int((cum < e * cum[-1] * (1 - 1e-12)).sum()) + 1, s.numel()))
        inv = torch.where(w > 0, 1.0 / torch.where(w > 0, w, torch.ones_like(w)), torch.zeros_like(w))
        out.append((inv[:, None] * (u[:, :k] @ (u[:, :k].T @ (w[:, None] * matrix)))).reshape(g.shape))
    return out


# --------------------------------------------------------------------------- Refiner
def refiner(model: nn.Module, inputs: Tensor, labels: Tensor, d_net: nn.Module, *, eps: float = 0.1,
            alpha: float = 0.5, beta: float = 1.0, iota: int = 10, tau: float = 0.95, lr: float = 1.0,
            unroll: bool = False, generator=None, loss_fn=default_loss_fn) -> List[Tensor]:
    """``x*`` by ``iota`` plain-autograd steps on ``||w (grad L(x*) - grad L(x))||^2 - beta D(x*)``
    from ``(1 - alpha) x + alpha U(0, 1)``, clamped to [0, 1]; the gradient at ``x*`` projected
    onto the ``eps``-ball around the clean gradient."""
    differentiable = bool(inputs.requires_grad) and unroll
    with preserved_buffers(model):
        grads = clean_gradients(model, inputs, labels, loss_fn)
        fixed = grads if differentiable else [g.detach() for g in grads]
        owners: dict = {}
        layer = [owners.setdefault(n.rpartition(".")[0], len(owners))
                 for n, p in model.named_parameters() if p.requires_grad]
        weights = [(g * p.detach() * tau ** i).abs() for g, p, i in zip(fixed, trainable_parameters(model), layer)]
        start = (1 - alpha) * inputs + alpha * torch.rand(inputs.shape, generator=generator, dtype=inputs.dtype)
        x_star = start
        for _ in range(iota):
            if not differentiable:
                x_star = x_star.detach().requires_grad_(True)
            robust = clean_gradients(model, x_star, labels, loss_fn, create_graph=True)
            value = sum(((w * (r - g)) ** 2).sum() for w, r, g in zip(weights, robust, fixed)) - beta * d_net(x_star).sum()
            (step,) = torch.autograd.grad(value, x_star, create_graph=differentiable)
            x_star = (x_star - lr * step).clamp(0, 1)
    if not differentiable:
        x_star = start + (x_star - start).detach() if inputs.requires_grad else x_star.detach()
    robust = clean_gradients(model, x_star, labels, loss_fn, create_graph=bool(inputs.requires_grad))
    diff = [r - g for r, g in zip(robust, grads)]
    dist = torch.sqrt(sum((d.double() ** 2).sum() for d in diff)).to(diff[0].dtype)
    scale = torch.clamp(eps / (dist + 1e-12), max=1.0)
    return [g + scale * d for g, d in zip(grads, diff)]


# --------------------------------------------------------------------------- DP-SGD
def dp_sgd(model: nn.Module, inputs: Tensor, labels: Tensor, *, clip: float = 1.0, noise_multiplier: float = 1.0,
           per_layer: bool = False, generator=None, loss_fn=default_loss_fn) -> List[Tensor]:
    """Each example's gradient (one backward pass each) clipped to ``clip`` (whole model) or
    ``clip / sqrt(L)`` per tensor, averaged, plus ``N(0, (noise_multiplier clip / B)^2)``."""
    rows = []
    with preserved_buffers(model):
        for i in range(inputs.shape[0]):
            grads = clean_gradients(model, inputs[i:i + 1], labels[i:i + 1], loss_fn)
            if per_layer:
                bound = clip / math.sqrt(len(grads))
                rows.append([g * torch.clamp(bound / (g.norm() + 1e-12), max=1.0) for g in grads])
            else:
                norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).to(grads[0].dtype)
                rows.append([g * torch.clamp(clip / (norm + 1e-12), max=1.0) for g in grads])
    mean = [torch.stack(column).mean(0) for column in zip(*rows)]
    with torch.no_grad():
        model(inputs.detach())
    std = noise_multiplier * clip / inputs.shape[0]
    return [m + std * torch.randn(m.shape, generator=generator, dtype=m.dtype) for m in mean] if noise_multiplier else mean
