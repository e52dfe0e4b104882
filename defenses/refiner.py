"""Refiner: upload the gradient of optimised "robust data" instead of the private batch.

``x* = argmin UM(x*, x) - beta * D(x*)`` from ``x*_0 = (1 - alpha) x + alpha v`` (``v`` uniform
noise), ``iota`` gradient steps of size ``lr``, clamped to [0, 1]; ``UM`` is the weighted
gradient distance ``||w * (grad L(x*) - grad L(x))||^2`` with ``w = |grad * theta * tau^i|``
(``i`` the layer index, input layer first) and ``D`` the evaluation network. The robust
gradient ``g*`` is projected onto the ball of radius ``eps`` around the clean gradient ``g``.

Differentiability w.r.t. the private inputs (for adaptive attackers): with ``unroll=True`` the
``iota`` optimisation steps are differentiated through (third-order derivatives, slow); by
default the steps are treated as a constant offset, ``x* = x*_0 + stopgrad(x* - x*_0)``,
which keeps the value exact and the path through the noise-blended initialisation.

D defaults to ``d_width=32`` filters (32/64/128): the paper's 128/256/512 (``d_width=128``)
costs about 16x the CPU time; D is trained once per setting and cached on disk.

Cost: a step's direction is one ``torch.func`` pullback of the parameter gradient along
``2 w^2 (grad L(x*) - grad L(x))`` plus D's input gradient; :meth:`Refiner.many` runs the
optimisations of many batches and draws as one ``vmap``-batched computation (one at a time
for models vmap cannot double-differentiate, e.g. BatchNorm in train mode). Measured cost:
``docs/performance.md``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vjp, vmap

from audit.core.types import Defense, clean_gradients, default_loss_fn, trainable_names

from defenses.common import (
    check_range, global_norm, preserved_buffers, rand, resolve_generator, squared_norms, stack_draws,
    untracked_batchnorm,
)
from defenses.evaluator import load_or_train_evaluator
from defenses.registry import DEFENSES


def layer_indices(model: nn.Module) -> List[int]:
    """For each trainable parameter, the index of its module (input layers first)."""
    owners: Dict[str, int] = {}
    out = []
    for name in trainable_names(model):
        owner = name.rpartition(".")[0]
        out.append(owners.setdefault(owner, len(owners)))
    return out


def project_to_ball(shared: List[Tensor], center: List[Tensor], eps: float) -> List[Tensor]:
    """``shared`` if within ``eps`` of ``center`` (whole-model L2), else its projection."""
    diff = [s - c for s, c in zip(shared, center)]
    dist = global_norm(diff)
    scale = torch.clamp(eps / (dist + 1e-12), max=1.0)
    return [c + scale * d for c, d in zip(center, diff)]


CHUNK_FLOATS = 2 ** 24  # parameter-gradient entries of the problems optimised at once (64 MiB)


class _Problems:
    """Refiner's optimisation for a stack of problems ``p``: a batch ``x_p`` with its labels,
    the clean gradient ``g_p`` and twice the squared importance ``2 w_p^2`` (lists of
    ``(P, *shape)``). :meth:`direction` gives one problem's ``d (UM - beta D) / d x`` (and the
    objective); :meth:`map` runs a function over all problems, vmap-batched where the model
    allows it."""

    def __init__(self, model: nn.Module, loss_fn, d_net: nn.Module, beta: float):
        self.model, self.loss_fn, self.d_net, self.beta = model, loss_fn, d_net, beta
        self.names = trainable_names(model)
        named = dict(model.named_parameters())
        self.params = {n: named[n].detach() for n in self.names}
        self.others = {**{n: p.detach() for n, p in named.items() if n not in self.params},
                       **dict(model.named_buffers())}
        self.batched: Optional[bool] = None  # decided at the first call

    def gradient(self, x: Tensor, y: Tensor) -> List[Tensor]:
        """The parameter gradient of one batch (differentiable w.r.t. ``x`` by outer autograd)."""
        loss = lambda p: self.loss_fn(functional_call(self.model, (p, self.others), (x,)), y)  # noqa: E731
        out = grad(loss)(self.params)
        return [out[n] for n in self.names]

    def direction(self, x, y, g, w2, with_value: bool) -> Tuple[Tensor, Tensor]:
        robust, pullback = vjp(lambda z: self.gradient(z, y), x)
        diff = [r - c for r, c in zip(robust, g)]
        value = sum((w * d * d).sum() for w, d in zip(w2, diff)) if with_value else None
        (gx,) = pullback([d.mul_(w) for w, d in zip(w2, diff)])  # w2 holds 2 w^2
        d_value, d_pullback = vjp(lambda z: self.d_net(z).sum(), x)
        (gd,) = d_pullback(torch.ones_like(d_value))
        value = value / 2 - self.beta * d_value if with_value else d_value.new_zeros(())
        return gx - self.beta * gd, value

    def map(self, fn: Callable, *stacks) -> Tuple:
        """``fn`` over the leading dimension of ``stacks``: one vmap call, or a loop where vmap
        cannot run the model (decided once) or there is one problem."""
        if self.batched is not False and _length(stacks[0]) > 1:
            try:
                out = vmap(fn)(*stacks)
                self.batched = True
                return out
            except Exception:  # an op vmap cannot batch (e.g. BatchNorm's double backward)
                if self.batched:
                    raise
                self.batched = False
        rows = [fn(*[_index(s, p) for s in stacks]) for p in range(_length(stacks[0]))]
        return _restack(rows)

    def optimise(self, start: Tensor, labels: Tensor, g: List[Tensor], w2: List[Tensor], steps: int, lr: float,
                 trace: Optional[List[List[float]]] = None) -> Tensor:
        """``steps`` clamped gradient steps from ``start`` ``(P, B, ...)``; ``trace[p]`` receives
        problem ``p``'s objective before each step and after the last."""
        with_value = trace is not None
        x = start
        for k in range(steps + (1 if with_value else 0)):
            step, value = self.map(lambda *a: self.direction(*a, with_value), x, labels, g, w2)
            if with_value:
                for p, v in enumerate(value.tolist()):
                    trace[p].append(v)
            if k < steps:
                x = (x - lr * step).clamp(0, 1)
        return x


def _index(stack, p):
    return [t[p] for t in stack] if isinstance(stack, list) else stack[p]


def _length(stack) -> int:
    return len(stack[0]) if isinstance(stack, list) else len(stack)


def _restack(rows):
    if isinstance(rows[0], (tuple, list)) and not isinstance(rows[0], Tensor):
        return type(rows[0])(_restack([r[i] for r in rows]) for i in range(len(rows[0])))
    return torch.stack(rows)


@DEFENSES.register("refiner", "Gradient of robust data (evaluation network + weighted utility), eps-projected (eps=0.1)")
class Refiner(Defense):
    name = "refiner"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = True
    differences = (
        "The evaluation network D defaults to d_width=32 (32/64/128 filters) instead of the paper's "
        "128/256/512 (d_width=128, about 16x the CPU time), trained on the embedded data set.",
        "For adaptive attackers x* is differentiable only through its noise-blended start (the iota "
        "steps are a constant offset) unless unroll=True.",
    )

    def __init__(self, eps: float = 0.1, alpha: float = 0.5, beta: float = 1.0, iota: int = 10,
                 tau: float = 0.95, lr: float = 1.0, dataset: str = "embedded", d_width: int = 32,
                 d_epochs: int = 20, d_seed: int = 0, unroll: bool = False,
                 evaluator: Optional[nn.Module] = None):
        self.eps = check_range(self.name, "eps", eps, 0, None)
        self.alpha = check_range(self.name, "alpha", alpha, 0, 1)
        self.beta = check_range(self.name, "beta", beta, 0, None)
        self.iota = check_range(self.name, "iota", iota, 0, None, integer=True)
        self.tau = check_range(self.name, "tau", tau, 0, 1)
        self.lr = check_range(self.name, "lr", lr, 0, None, low_open=True)
        self.dataset = str(dataset)
        self.d_width = check_range(self.name, "d_width", d_width, 1, None, integer=True)
        self.d_epochs = check_range(self.name, "d_epochs", d_epochs, 1, None, integer=True)
        self.d_seed = int(d_seed)
        self.unroll = bool(unroll)
        self._evaluators: Dict[Tuple, nn.Module] = {}
        if evaluator is not None:
            self._evaluators["given"] = evaluator.eval().requires_grad_(False)

    @property
    def unstable_probe(self) -> Optional[str]:
        """Why its probe output is machine-bound: unless given one, it trains its evaluation network
        before it answers, and training carries the kernels' last-bit differences past any rounding."""
        if "given" in self._evaluators:
            return None
        return "it trains its evaluation network before it answers, which carries the kernels' last-bit differences"

    def evaluator(self, input_shape, device, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The evaluation network D for this input shape (trained once, cached on disk), in the
        inputs' precision."""
        if "given" in self._evaluators:
            return self._evaluators["given"].to(device=device, dtype=dtype)
        key = (tuple(input_shape), str(device), str(dtype))
        if key not in self._evaluators:
            self._evaluators[key] = load_or_train_evaluator(
                tuple(input_shape), dataset=self.dataset, width=self.d_width, epochs=self.d_epochs,
                seed=self.d_seed, device=device).to(dtype=dtype)
        return self._evaluators[key]

    def importance(self, model: nn.Module, grads: List[Tensor]) -> List[Tensor]:
        """``w = |grad * theta * tau^i|`` per parameter (per problem for stacked ``grads``)."""
        params = [p.detach() for p in model.parameters() if p.requires_grad]
        return [(g * p * self.tau ** i).abs() for g, p, i in zip(grads, params, layer_indices(model))]

    def robust_data(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None,
                    grads: Optional[List[Tensor]] = None, trace: Optional[List[float]] = None) -> Tensor:
        """Optimise ``x*``; differentiable w.r.t. ``inputs`` when ``inputs.requires_grad``.

        ``trace``, when a list, receives the objective ``UM - beta * D`` before each of the
        ``iota`` steps and after the last one (one more gradient evaluation)."""
        gen = resolve_generator(generator, inputs.device)
        if grads is None:
            with preserved_buffers(model):
                grads = clean_gradients(model, inputs, labels, loss_fn)
        noise = rand(inputs.shape, generator=gen, device=inputs.device, dtype=inputs.dtype)
        start = (1 - self.alpha) * inputs + self.alpha * noise
        traces = None if trace is None else [trace]
        x_star = self._optimise(model, start.unsqueeze(0), labels.unsqueeze(0), [g.unsqueeze(0) for g in grads],
                                loss_fn, bool(inputs.requires_grad), traces)[0]
        return x_star

    def _optimise(self, model, start: Tensor, labels: Tensor, grads: List[Tensor], loss_fn, differentiable: bool,
                  trace: Optional[List[List[float]]] = None) -> Tensor:
        """``x*`` for a stack of problems (``start`` ``(P, B, ...)``, ``grads`` ``(P, *shape)``);
        unrolled through the steps when ``unroll`` and ``differentiable``, else the steps as a
        constant offset from the (differentiable) start."""
        unroll = differentiable and self.unroll
        d_net = self.evaluator(start.shape[2:], start.device, start.dtype)
        if not unroll:
            grads = [g.detach() for g in grads]
        w2 = [2 * w * w for w in self.importance(model, grads)]
        with untracked_batchnorm(model), preserved_buffers(model):
            problems = _Problems(model, loss_fn, d_net, self.beta)
            x_star = problems.optimise(start if unroll else start.detach(), labels, grads, w2, self.iota, self.lr,
                                       trace)
        if unroll or not differentiable:
            return x_star if unroll else x_star.detach()
        return start + (x_star - start).detach()

    def many(self, model, inputs, labels, *, draws=1, loss_fn=default_loss_fn, generator=None):
        """``draws`` shared gradients for each batch of ``inputs`` ``(N, B, ...)``, ``(N, draws,
        *shape)`` per parameter: the clean gradients of all batches, then every (batch, draw)
        optimisation as one stack of problems (chunked by memory); the noise is drawn batch by
        batch, draw by draw, as that many calls in a row would."""
        gen = resolve_generator(generator, inputs.device)
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        per = max(1, CHUNK_FLOATS // max(numel, 1) // draws)  # batches per chunk
        out: List[List[Tensor]] = []
        with untracked_batchnorm(model), preserved_buffers(model):
            problems = _Problems(model, loss_fn, self.evaluator(inputs.shape[2:], inputs.device, inputs.dtype),
                                 self.beta)
            for lo in range(0, len(inputs), per):
                x, y = inputs[lo:lo + per], labels[lo:lo + per]
                clean = problems.map(problems.gradient, x, y)
                noise = torch.stack([rand(x.shape[1:], generator=gen, device=x.device, dtype=x.dtype)
                                     for _ in range(len(x) * draws)]).view(len(x), draws, *x.shape[1:])
                start = ((1 - self.alpha) * x.unsqueeze(1) + self.alpha * noise).flatten(0, 1)
                y_rep = y.repeat_interleave(draws, 0)
                g_rep = [g.repeat_interleave(draws, 0) for g in clean]
                x_star = self._optimise(model, start, y_rep, g_rep, loss_fn, bool(inputs.requires_grad))
                shared = project_stacked(problems.map(problems.gradient, x_star, y_rep), g_rep, self.eps)
                out += [[s[k * draws:(k + 1) * draws] for s in shared] for k in range(len(x))]
        return stack_draws(out)

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        with preserved_buffers(model):
            grads = clean_gradients(model, inputs, labels, loss_fn)
        x_star = self.robust_data(model, inputs, labels, loss_fn=loss_fn, generator=generator, grads=grads)
        robust = clean_gradients(model, x_star, labels, loss_fn, create_graph=bool(inputs.requires_grad))
        return project_to_ball(robust, grads, self.eps)


def project_stacked(shared: List[Tensor], center: List[Tensor], eps: float) -> List[Tensor]:
    """:func:`project_to_ball` for stacks ``(P, *shape)``: each problem on its own ball."""
    diff = [s - c for s, c in zip(shared, center)]
    dist = torch.sqrt(sum(squared_norms(d) for d in diff)).to(diff[0].dtype)
    scale = torch.clamp(eps / (dist + 1e-12), max=1.0)
    return [c + scale.view(-1, *[1] * (d.dim() - 1)) * d for c, d in zip(center, diff)]
