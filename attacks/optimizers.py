"""Optimisers that treat the leading dimension of every variable as independent restarts.

An optimiser is built by :data:`OPTIMIZERS` with its settings, then driven by the engine:
``opt.start(variables, iterations)`` once, ``opt.step(variables, closure, iteration)`` per
iteration, where ``closure(variables) -> (loss (R,), grads)`` evaluates every restart at
once. ``step`` updates the variables in place and returns the per-restart loss at the point
it evaluated. Adam is element-wise (restarts cannot interact); L-BFGS keeps a history and
a line search per restart. Learning-rate schedules: :data:`SCHEDULES`.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.errors import ConfigError
from audit.core.registry import Registry

OPTIMIZERS = Registry("optimizer")
SCHEDULES = Registry("lr schedule")

Closure = Callable[[List[Tensor]], Tuple[Tensor, List[Tensor]]]


@SCHEDULES.register("constant", "constant learning rate")
def constant(progress: float) -> float:
    return 1.0


@SCHEDULES.register("step", "x0.1 at 3/8, 5/8 and 7/8 of the iterations (Inverting Gradients)")
def step_decay(progress: float) -> float:
    return 0.1 ** sum(progress >= m for m in (3 / 8, 5 / 8, 7 / 8))


@SCHEDULES.register("cosine", "cosine annealing to 0")
def cosine(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * progress))


@SCHEDULES.register("exp", "exponential decay to 1/100 at the end")
def exponential(progress: float) -> float:
    return 0.01 ** progress


def _per_restart_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> Tensor:
    return sum((x * y).flatten(1).sum(1) for x, y in zip(a, b))


def _expand(v: Tensor, like: Tensor) -> Tensor:
    return v.view(-1, *([1] * (like.dim() - 1)))


class Adam:
    """Adam per element (so per restart), optional signed gradients (Inverting Gradients)
    and a learning-rate schedule."""

    name = "adam"

    def __init__(self, lr: float = 0.1, schedule: str = "step", signed: bool = False,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if not lr > 0:
            raise ConfigError(f"adam lr must be > 0, got {lr}")
        self.lr, self.signed, self.betas, self.eps = float(lr), bool(signed), betas, eps
        self.schedule_name = schedule
        self.schedule = SCHEDULES.get(schedule)

    def start(self, variables: List[Tensor], iterations: int) -> None:
        self.iterations = max(1, iterations)
        self.m = [torch.zeros_like(v) for v in variables]
        self.v = [torch.zeros_like(v) for v in variables]
        self.evaluations = 0

    def step(self, variables: List[Tensor], closure: Closure, iteration: int) -> Tensor:
        loss, grads = closure(variables)
        self.evaluations += 1
        b1, b2 = self.betas
        t = iteration + 1
        lr = self.lr * self.schedule(iteration / self.iterations)
        with torch.no_grad():
            for var, g, m, v in zip(variables, grads, self.m, self.v):
                g = torch.nan_to_num(g.sign() if self.signed else g)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v / (1 - b2 ** t)).sqrt_().add_(self.eps)
                var.addcdiv_(m, denom, value=-lr / (1 - b1 ** t))
        return loss

    def settings(self) -> dict:
        return {"optimizer": "adam", "lr": self.lr, "schedule": self.schedule_name, "signed": self.signed}


class LBFGS:
    """L-BFGS with one history and one backtracking (Armijo) line search per restart.

    The first step of each restart is scaled by ``min(1, 1 / |g|_1)`` as in torch's L-BFGS.
    A restart whose line search fails keeps its point for that iteration. Each trial point
    costs one batched evaluation (counted in ``evaluations``).
    """

    name = "lbfgs"

    def __init__(self, lr: float = 1.0, history: int = 100, backtracks: int = 6, schedule: str = "constant"):
        if not lr > 0:
            raise ConfigError(f"lbfgs lr must be > 0, got {lr}")
        if history < 1:
            raise ConfigError(f"lbfgs history must be >= 1, got {history}")
        self.lr, self.history, self.backtracks = float(lr), int(history), int(backtracks)
        self.schedule_name = schedule
        self.schedule = SCHEDULES.get(schedule)

    def start(self, variables, iterations):
        self.iterations = max(1, iterations)
        self.pairs: List[Tuple[List[Tensor], List[Tensor], Tensor]] = []
        self.current: Optional[Tuple[Tensor, List[Tensor]]] = None
        self.evaluations = 0

    def _evaluate(self, closure, variables):
        self.evaluations += 1
        loss, grads = closure(variables)
        return loss.detach(), [g.detach() for g in grads]

    def _direction(self, grads: List[Tensor]) -> List[Tensor]:
        q = [-g for g in grads]
        alphas = []
        for s, y, rho in reversed(self.pairs):
            a = rho * _per_restart_dot(s, q)
            q = [qi - _expand(a, qi) * yi for qi, yi in zip(q, y)]
            alphas.append(a)
        if self.pairs:
            s, y, _ = self.pairs[-1]
            yy = _per_restart_dot(y, y)
            gamma = torch.where(yy > 0, _per_restart_dot(s, y) / yy.clamp_min(1e-30), torch.ones_like(yy))
            q = [qi * _expand(gamma, qi) for qi in q]
        for (s, y, rho), a in zip(self.pairs, reversed(alphas)):
            beta = rho * _per_restart_dot(y, q)
            q = [qi + _expand(a - beta, qi) * si for qi, si in zip(q, s)]
        return q

    def step(self, variables, closure, iteration):
        moved = self.current is not None and any(  # e.g. projected onto a box after the last step
            not torch.equal(v, p) for v, p in zip(variables, self.point))
        if self.current is None or moved:
            self.current = self._evaluate(closure, variables)
        loss, grads = self.current
        direction = self._direction(grads)
        slope = _per_restart_dot(grads, direction)
        if not self.pairs:
            gnorm = sum(g.abs().flatten(1).sum(1) for g in grads)
            t = self.lr * torch.clamp(1.0 / gnorm.clamp_min(1e-30), max=1.0)
        else:
            t = torch.full_like(loss, self.lr)
        t = t * self.schedule(iteration / self.iterations)
        bad = slope >= 0  # not a descent direction: fall back to steepest descent
        if bad.any():
            direction = [torch.where(_expand(bad, d), -g, d) for d, g in zip(direction, grads)]
            slope = _per_restart_dot(grads, direction)
        base = [v.detach().clone() for v in variables]
        accepted = torch.zeros_like(loss, dtype=torch.bool)
        new_loss, new_grads = loss, grads
        for _ in range(self.backtracks + 1):
            trial = [b + _expand(t, b) * d for b, d in zip(base, direction)]
            for v, tr, b in zip(variables, trial, base):
                v.copy_(torch.where(_expand(accepted, b), v, tr))
            tl, tg = self._evaluate(closure, variables)
            ok = torch.isfinite(tl) & (tl <= loss + 1e-4 * t * slope)
            newly = ok & ~accepted
            new_loss = torch.where(newly, tl, new_loss)
            new_grads = [torch.where(_expand(newly, g), g_new, g) for g, g_new in zip(new_grads, tg)]
            accepted |= ok
            if accepted.all():
                break
            t = torch.where(accepted, t, t / 2)
        for v, b in zip(variables, base):  # failed restarts stay where they were
            v.copy_(torch.where(_expand(accepted, b), v, b))
        s = [v.detach() - b for v, b in zip(variables, base)]
        y = [gn - g for gn, g in zip(new_grads, grads)]
        sy = _per_restart_dot(s, y)
        rho = torch.where(sy > 1e-10, 1.0 / sy.clamp_min(1e-10), torch.zeros_like(sy))
        self.pairs = (self.pairs + [(s, y, rho)])[-self.history:]
        self.current = (new_loss, new_grads)
        self.point = [v.detach().clone() for v in variables]
        return new_loss

    def settings(self) -> dict:
        return {"optimizer": "lbfgs", "lr": self.lr, "history": self.history,
                "backtracks": self.backtracks, "schedule": self.schedule_name}


OPTIMIZERS.add("adam", Adam, "Adam per restart; lr, schedule (step/cosine/exp/constant), signed gradients")
OPTIMIZERS.add("lbfgs", LBFGS, "L-BFGS per restart with Armijo backtracking (DLG); lr, history")
