"""CENSOR (NDSS 2025): orthogonal-subspace sampling with loss-based selection.

Each of ``trials`` candidates draws a Gaussian direction per layer (or for the whole
model), removes its component in the span of the clean gradient (for a batch: the span of
the batch gradient and the per-example gradients), rescales it to the clean norm, and
the candidate whose step ``theta - eta * G_t`` gives the lowest loss on the private batch
(in eval mode) is shared. Unlike the public code, the raw gradient is never sent: the
lowest-loss candidate is kept even when no candidate lowers the loss.

``active_rounds=N`` follows the paper's schedule (CENSOR "only in the first epochs"): rounds
``0 .. N-1`` are defended and later rounds share the clean gradient. The round comes from the
client simulation (``round=`` keyword); a call without one counts as an early round.

Cost: the ``trials`` draws come from parallel random streams seeded by the generator
(:mod:`defenses.streams`: fixed in number, so the numbers do not depend on the machine)
and are projected by the stream that drew them, in one scratch buffer kept between calls;
the candidates are scored in float64 (the loss changes between candidates are of order
``eta^2``, far below float32's resolution) by the same streams, on float64 copies of the
model made once per call (once per :meth:`Censor.many`); only the chosen candidate is rebuilt with autograd when the
inputs require grad. :meth:`Censor.many` computes the clean gradient and its span once for
all draws of a batch. Measured: ``docs/performance.md``.
"""
from __future__ import annotations

import copy
import queue
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from audit.core.types import Defense, clean_gradients, default_loss_fn, trainable_names

from defenses.common import (
    check_range, eval_mode, flatten, per_example_gradients, preserved_buffers, resolve_generator, stack_draws,
)
from defenses.registry import DEFENSES
from defenses.streams import Workspaces, fill_normal


def orthonormal_basis(vectors: Tensor) -> Tensor:
    """Orthonormal columns spanning the rows of ``vectors`` (``(k, n)`` -> ``(n, k)``), float64."""
    if vectors.shape[0] == 1:
        v = vectors[0].double()
        return (v / v.norm()).unsqueeze(1)
    q, _ = torch.linalg.qr(vectors.double().T, mode="reduced")
    return q


def orthogonal_candidates(directions: Tensor, basis: Tensor, target_norm: Tensor) -> Tensor:
    """Project the rows of ``directions`` ``(T, n)`` onto the complement of ``basis``
    ``(n, k)`` (twice, for orthogonality to the working precision) and rescale each row to
    ``target_norm``; in ``directions``' dtype, in place when nothing requires grad."""
    return _project(directions, basis, target_norm)[0]


def _project(directions: Tensor, basis: Tensor, target_norm: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """:func:`orthogonal_candidates` plus what undoes it: ``directions = out / scale +
    coeff @ basis.T`` (``coeff`` ``(T, k)``, ``scale`` ``(T, 1)``)."""
    q = basis.to(directions.dtype)
    inplace = not (directions.requires_grad or q.requires_grad or target_norm.requires_grad)
    out, total = directions, None
    for _ in range(2):
        coeff = out @ q
        total = coeff if total is None else total + coeff
        out = out.addmm_(coeff, q.T, alpha=-1) if inplace else torch.addmm(out, coeff, q.T, alpha=-1)
    scale = target_norm.to(out.dtype) / out.norm(dim=1, keepdim=True)
    return (out.mul_(scale) if inplace else out * scale), total, scale


@DEFENSES.register("censor", "Orthogonal-subspace sampling: best of `trials` (20) random orthogonal updates, eta=1e-4")
class Censor(Defense):
    """Shares a random update orthogonal to the clean gradient with the same norm per layer
    (``layerwise=true``, the paper's default) or for the whole model."""

    name = "censor"
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
    stochastic = True
    differences = (
        "The raw gradient is never shared: the lowest-loss candidate is sent even when none lowers "
        "the loss (the authors' code then falls back to the clean gradient).",
        "Defends every round unless active_rounds is set; the paper applies CENSOR only in the first "
        "epochs (active_rounds=N defends rounds 0..N-1, later rounds share the clean gradient).",
        "Evaluated here in plain FedSGD on small models, where exactly orthogonal updates train close "
        "to chance; the paper reports FedAvg utility on ResNet-18.",
        "For a batch, the span of the per-example gradients is projected out (the paper's text); the "
        "public code projects out only the batch gradient.",
    )

    def __init__(self, trials: int = 20, eta: float = 1e-4, layerwise: bool = True,
                 active_rounds: Optional[int] = None):
        self.trials = check_range(self.name, "trials", trials, 1, None, integer=True)
        self.eta = check_range(self.name, "eta", eta, 0, None, low_open=True)
        self.layerwise = bool(layerwise)
        self.active_rounds = None if active_rounds is None else check_range(
            self.name, "active_rounds", active_rounds, 1, None, integer=True)

    def active(self, round: Optional[int]) -> bool:
        """Whether CENSOR defends ``round`` (None: unknown, treated as an early round)."""
        return self.active_rounds is None or round is None or int(round) < self.active_rounds

    # ------------------------------------------------------------------ sampling
    def _spans(self, model, inputs, labels, loss_fn, grads) -> List[List[Tensor]]:
        """Per parameter: the vectors to project out (batch gradient, then per-example ones)."""
        spans = [[g] for g in grads]
        if inputs.shape[0] > 1:
            # batch gradient + all but one per-example gradient span the per-example span
            # whenever the batch gradient is their mean, and keep a full-rank basis
            for example in per_example_gradients(model, inputs[:-1], labels[:-1], loss_fn):
                for span, g in zip(spans, example):
                    span.append(g)
        return spans

    def _groups(self, count: int) -> List[List[int]]:
        return [[i] for i in range(count)] if self.layerwise else [list(range(count))]

    def _bases(self, grads: Sequence[Tensor], spans: List[List[Tensor]]) -> List[Tuple[Tensor, Optional[Tensor]]]:
        """Per group: the clean norm and the orthonormal basis to project out (None: zero gradient)."""
        out = []
        for group in self._groups(len(grads)):
            norm = flatten([grads[i] for i in group]).norm()
            if float(norm.detach()) == 0.0:  # nothing to hide; zero keeps the norm and orthogonality
                out.append((norm, None))
                continue
            span = torch.stack([flatten([spans[i][k] for i in group]) for k in range(len(spans[group[0]]))])
            out.append((norm, orthonormal_basis(span)))
        return out

    def candidates(self, grads: Sequence[Tensor], spans: List[List[Tensor]], generator) -> List[Tensor]:
        """``trials`` orthogonal candidates, one ``(T, *shape)`` tensor per parameter."""
        gen = resolve_generator(generator, grads[0].device)
        flat = torch.empty(self.trials * sum(g.numel() for g in grads), device=gen.device, dtype=grads[0].dtype)
        return self._draw(grads, self._bases(grads, spans), gen, self._workspace(grads, flat))[0]

    def _workspace(self, grads: Sequence[Tensor], flat: Tensor) -> List[Tensor]:
        """One ``(T, n_group)`` view of ``flat`` per group, reused by every draw."""
        out, start = [], 0
        for group in self._groups(len(grads)):
            n = sum(grads[i].numel() for i in group)
            out.append(flat[start:start + self.trials * n].view(self.trials, n))
            start += self.trials * n
        return out

    def _draw(self, grads, bases, gen, workspace, score: Optional[Callable] = None
              ) -> Tuple[List[Tensor], List[Tuple], Optional[Tensor]]:
        """Draw (:func:`~defenses.streams.fill_normal`: :data:`~defenses.streams.STREAMS`
        streams seeded from ``gen``, each filling its rows of every group in order) and project
        ``trials`` candidates: one ``(T, *shape)`` view per parameter, per group the
        ``(coeff, scale)`` that give back the raw draws (see :func:`_project`), and
        ``score(candidates)`` of the rows (None without ``score``). Where the draws sit on the
        gradients' device, the stream that drew rows projects them in place and, for a
        ``score`` that runs on any thread, scores them."""
        device = grads[0].device
        projected: Dict[int, List[Tuple]] = {}  # first row of a stream -> per group (coeff, scale)
        scored: Dict[int, Tensor] = {}  # first row of a stream -> its rows' losses

        def views(lo: int, hi: int) -> List[Tensor]:
            out: List[Tensor] = [None] * len(grads)  # type: ignore[list-item]
            for group, buf in zip(self._groups(len(grads)), workspace):
                start = 0
                for i in group:
                    size = grads[i].numel()
                    out[i] = buf[lo:hi, start:start + size].view(hi - lo, *grads[i].shape)
                    start += size
            return out

        def project(lo: int, hi: int) -> None:
            undo_rows = []
            for (norm, basis), buf in zip(bases, workspace):
                if basis is None:
                    buf[lo:hi].zero_()
                    undo_rows.append((None, None))
                else:
                    undo_rows.append(_project(buf[lo:hi], basis.detach(), norm.detach())[1:])
            projected[lo] = undo_rows
            if score is not None and getattr(score, "any_thread", False):
                scored[lo] = score(views(lo, hi))

        if workspace[0].device != device:
            fill_normal(workspace, gen)
            workspace = [buf.to(device) for buf in workspace]
            project(0, self.trials)
        else:
            fill_normal(workspace, gen, then=project)
        starts = sorted(projected)
        undo = [(None, None) if basis is None else
                (torch.cat([projected[lo][j][0] for lo in starts]), torch.cat([projected[lo][j][1] for lo in starts]))
                for j, (_, basis) in enumerate(bases)]
        cands = views(0, self.trials)
        losses = None
        if score is not None:
            losses = torch.cat([scored[lo] for lo in starts]) if scored else score(cands)
        return cands, undo, losses

    # ------------------------------------------------------------------ selection
    def candidate_losses(self, model: nn.Module, inputs, labels, loss_fn, cands: List[Tensor]) -> Tensor:
        """Loss of ``theta - eta * G_t`` for every candidate (eval mode, float64, no grad)."""
        return _Scorer(model, self.eta)(cands, inputs, labels, loss_fn)

    def _chosen(self, grads, bases, chosen: List[Tensor], undo: List[Tuple]) -> List[Tensor]:
        """The chosen candidates ``(D, *shape)`` as they are, and where the clean gradient
        requires grad, with the gradient of projecting their raw draws (the randomness fixed)."""
        if not any(g.requires_grad for g in grads):
            return chosen
        out = list(chosen)
        for j, (group, (norm, basis)) in enumerate(zip(self._groups(len(grads)), bases)):
            if basis is None:
                continue
            coeff, scale = torch.cat([u[j][0] for u in undo]), torch.cat([u[j][1] for u in undo])
            picked = flatten_rows([chosen[i] for i in group])
            raw = torch.addmm(picked / scale, coeff, basis.detach().to(picked.dtype).T)
            rebuilt = orthogonal_candidates(raw, basis, norm)
            start = 0
            for i in group:
                size = grads[i].numel()
                part = rebuilt[:, start:start + size].reshape(chosen[i].shape)
                out[i] = chosen[i] + (part - part.detach())
                start += size
        return out

    def _select(self, model, inputs, labels, loss_fn, grads, generator, draws: int,
                scorer: Optional["_Scorer"] = None) -> List[Tensor]:
        """``draws`` CENSOR outputs for one batch whose clean gradient is ``grads``, stacked
        ``(draws, *shape)``; the generator is consumed as by ``draws`` calls in a row."""
        gen = resolve_generator(generator, grads[0].device)
        bases = self._bases(grads, self._spans(model, inputs, labels, loss_fn, grads))
        scorer = scorer or _Scorer(model, self.eta)
        flat = _WORKSPACES.take(self.trials * sum(g.numel() for g in grads), gen.device, grads[0].dtype)
        try:
            workspace = self._workspace(grads, flat)
            chosen, undo = [], []
            score = scorer.bind(inputs, labels, loss_fn)
            for _ in range(draws):
                cands, how, losses = self._draw(grads, bases, gen, workspace, score)
                best = int(torch.argmin(losses))
                chosen.append([c[best].clone() for c in cands])
                undo.append([(None, None) if c is None else (c[best:best + 1].clone(), s[best:best + 1].clone())
                             for c, s in how])
        finally:
            _WORKSPACES.give(flat)
        return self._chosen(grads, bases, [torch.stack(column) for column in zip(*chosen)], undo)

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None, round=None):
        grads = clean_gradients(model, inputs, labels, loss_fn)
        if not self.active(round):
            return grads
        return [g[0] for g in self._select(model, inputs, labels, loss_fn, grads, generator, 1)]

    def many(self, model, inputs, labels, *, draws=1, loss_fn=default_loss_fn, generator=None, round=None):
        """``draws`` outputs for each batch of ``inputs`` ``(N, B, ...)``, ``(N, draws, *shape)``
        per parameter: the clean gradient and its span once per batch, not once per draw."""
        out, scorer = [], _Scorer(model, self.eta)  # the parameters' float64 copy made once
        for x, y in zip(inputs, labels):
            with preserved_buffers(model):
                grads = clean_gradients(model, x, y, loss_fn)
                if self.active(round):
                    out.append(self._select(model, x, y, loss_fn, grads, generator, draws, scorer))
                else:
                    out.append([g.unsqueeze(0).expand(draws, *g.shape) for g in grads])
        return stack_draws(out)


class _Scorer:
    """``(cands, inputs, labels, loss_fn) -> losses``: the loss of ``theta - eta * G_t`` for
    every candidate, one float64 forward each in eval mode. The forwards run on float64 twins
    of the model (copies without hooks, made once per call or :meth:`Censor.many`, one per
    thread that scores at once) whose parameters are rewritten in place, so several threads
    score at once; a model that cannot be copied is scored through ``functional_call`` on
    the calling thread. The model's buffers are read at each call (a train-mode client's
    clean gradient has just updated its BatchNorm statistics)."""

    def __init__(self, model: nn.Module, eta: float):
        self.model, self.eta = model, eta
        self.names = trainable_names(model)
        self._free: "queue.SimpleQueue[_Twin]" = queue.SimpleQueue()
        try:
            self._free.put(_Twin(model, self.names))
            self.any_thread = True
        except Exception:  # e.g. a model holding something deepcopy cannot copy
            self.any_thread = False
            self._functional = _Twin.functional(model, self.names)

    def bind(self, inputs: Tensor, labels: Tensor, loss_fn) -> Callable[[List[Tensor]], Tensor]:
        """``cands -> losses`` for this batch (``any_thread`` tells whether it may run off the caller's thread)."""
        x = inputs.detach().double()
        buffers = {n: b.detach() for n, b in self.model.named_buffers()}

        def score(cands: List[Tensor]) -> Tensor:
            if not self.any_thread:
                with eval_mode(self.model):
                    return self._functional(cands, x, labels, loss_fn, buffers, self.eta)
            try:
                twin = self._free.get_nowait()
            except queue.Empty:
                twin = _Twin(self.model, self.names)
            try:
                return twin(cands, x, labels, loss_fn, buffers, self.eta)
            finally:
                self._free.put(twin)

        score.any_thread = self.any_thread  # type: ignore[attr-defined]
        return score

    def __call__(self, cands: List[Tensor], inputs: Tensor, labels: Tensor, loss_fn) -> Tensor:
        return self.bind(inputs, labels, loss_fn)(cands)


class _Twin:
    """A float64 eval-mode copy of a model without its hooks: ``base`` holds the trainable
    parameters, ``params`` (the copy's own) receive ``base - eta * candidate``."""

    def __init__(self, model: nn.Module, names: List[str]):
        no_hooks = {id(v): type(v)() for m in model.modules() for k, v in vars(m).items()
                    if k.endswith("hooks") and isinstance(v, dict)}
        self.net = copy.deepcopy(model, no_hooks).to(torch.float64).eval().requires_grad_(False)
        named = dict(self.net.named_parameters())
        self.params = [named[n] for n in names]
        self.base = [p.detach().clone() for p in self.params]
        self.buffers = dict(self.net.named_buffers())

    def __call__(self, cands, x, labels, loss_fn, buffers: Dict[str, Tensor], eta: float) -> Tensor:
        losses = []
        with torch.no_grad():
            for n, b in buffers.items():
                self.buffers[n].copy_(b)
            for t in range(cands[0].shape[0]):
                for base, p, c in zip(self.base, self.params, cands):  # p - eta * c in float64
                    torch.add(base, c[t], alpha=-eta, out=p)
                losses.append(loss_fn(self.net(x), labels))
        return torch.stack(losses)

    @staticmethod
    def functional(model: nn.Module, names: List[str]) -> Callable:
        """The same scoring through ``functional_call`` on ``model`` itself (one thread only)."""
        # a copy even when the model is float64 already: these tensors are written in place
        moved = {n: p.detach().to(torch.float64, copy=True) for n, p in model.named_parameters()}
        base = {n: moved[n].clone() for n in names}

        def run(cands, x, labels, loss_fn, buffers: Dict[str, Tensor], eta: float) -> Tensor:
            floats = {n: b.double() if b.is_floating_point() else b for n, b in buffers.items()}
            losses = []
            with torch.no_grad():
                for t in range(cands[0].shape[0]):
                    for n, c in zip(names, cands):
                        torch.add(base[n], c[t], alpha=-eta, out=moved[n])
                    losses.append(loss_fn(functional_call(model, (moved, floats), (x,)), labels))
            return torch.stack(losses)

        return run


_WORKSPACES = Workspaces()  # the candidates' buffer, kept between calls


def flatten_rows(tensors: Sequence[Tensor]) -> Tensor:
    """``(D, *shape_i)`` tensors -> ``(D, sum numel_i)``."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1)
