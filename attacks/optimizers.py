"""Optimisers that treat the leading dimension of every variable as independent restarts.

An optimiser is built by :data:`OPTIMIZERS` with its settings, then driven by the optimisation run:
``opt.start(variables, iterations)`` once, ``opt.step(variables, closure, iteration)`` per
iteration, where ``closure(variables) -> (loss (R,), grads)`` evaluates every restart at
once. ``step`` updates the variables in place and returns the per-restart loss at the point
it evaluated. Adam is element-wise (restarts cannot interact); L-BFGS keeps a history and
a line search per restart. Learning-rate schedules: :data:`SCHEDULES`.

Capture (``attacks.capture``): an optimiser whose ``uncapturable`` is ``None`` (otherwise the
:class:`~audit.core.reasons.Reason` it cannot be captured for) also offers
``update(variables, loss, grads, lr, iteration)`` (in place, no host synchronisation), ``state()`` (its
per-restart tensors) and ``lr_at(iteration)``, so its step runs inside a captured iteration.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.errors import ConfigError
from audit.core.reasons import Reason
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
    #: a step moves every restart whose gradient is non-zero: a point that never moved had none
    moves_on_gradient = True
    uncapturable: Optional[Reason] = None  # elementwise: its update runs inside a captured iteration

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
        self.t = torch.zeros(variables[0].shape[0], device=variables[0].device)  # steps since (re)start
        self.factor = torch.ones(variables[0].shape[0], device=variables[0].device)
        self.evaluations = 0

    def lr_at(self, iteration: int) -> float:
        """The scheduled learning rate of ``iteration`` (before the per-restart factor)."""
        return self.lr * self.schedule(iteration / self.iterations)

    def step(self, variables: List[Tensor], closure: Closure, iteration: int) -> Tensor:
        loss, grads = closure(variables)
        self.evaluations += 1
        self.update(variables, loss, grads, self.lr_at(iteration), iteration)
        return loss

    def update(self, variables: List[Tensor], loss: Tensor, grads: Sequence[Tensor], lr, iteration) -> None:
        """One Adam step in place, with no host synchronisation (capture-safe): ``lr`` is the
        scheduled rate, ``iteration`` the step, each a number or a 0-dim tensor (inputs of a
        captured program); ``loss`` is not used."""
        b1, b2 = self.betas
        self.t += 1
        lr = lr * self.factor
        with torch.no_grad():
            for var, g, m, v in zip(variables, grads, self.m, self.v):
                g = torch.nan_to_num(g.sign() if self.signed else g)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v / _expand(1 - b2 ** self.t, v)).sqrt_().add_(self.eps)
                var.sub_(_expand(lr / (1 - b1 ** self.t), var) * m / denom)

    def state(self) -> Dict[str, Tensor]:
        """The per-restart tensors (leading dimension: restarts) that :meth:`update` reads and
        writes in place."""
        return {**{f"m{i}": m for i, m in enumerate(self.m)}, **{f"v{i}": v for i, v in enumerate(self.v)},
                "t": self.t, "factor": self.factor}

    def select(self, index: Tensor) -> None:
        """Keep only the restarts at ``index`` (the optimisation run dropping the worse restarts)."""
        self.m, self.v = [m[index] for m in self.m], [v[index] for v in self.v]
        self.t, self.factor = self.t[index], self.factor[index]

    def recover(self, restarts: Tensor) -> str:
        """Restarts (boolean mask) that stalled or diverged: step x0.1, moments reset."""
        self.recover_(restarts)
        return self.recovery_message(self.recovery_note()[restarts])

    def recover_(self, restarts: Tensor) -> None:
        """:meth:`recover` in place with no host synchronisation (capture-safe)."""
        torch.where(restarts, self.factor * 0.1, self.factor, out=self.factor)
        for m, v in zip(self.m, self.v):
            m.masked_fill_(_expand(restarts, m), 0)
            v.masked_fill_(_expand(restarts, v), 0)
        self.t.masked_fill_(restarts, 0)

    def recovery_note(self) -> Tensor:
        """Per restart, the number a recovery message reports (the step factor)."""
        return self.factor

    @staticmethod
    def recovery_message(notes: Tensor) -> str:
        """What a recovery of the restarts with these :meth:`recovery_note` values did."""
        return f"adam step x0.1 (now {float(notes.min()):.3g} x lr), moments reset"

    def settings(self) -> dict:
        return {"optimizer": "adam", "lr": self.lr, "schedule": self.schedule_name, "signed": self.signed}


class LBFGS:
    """L-BFGS with one history and one backtracking (Armijo) line search per restart.

    The inverse-Hessian product uses the compact representation (Byrd, Nocedal & Schnabel
    1994; Nocedal & Wright eq. 7.24) on the restart's flattened variables, a handful of
    batched matrix products per step instead of a Python two-loop over the history (the
    two-loop cost more than the DLG evaluation itself). The first step of each restart
    (and the first after a reset) is scaled by ``min(1, 1 / |g|_1)`` as in torch's L-BFGS.
    Curvature pairs with ``s.y <= 0`` are not stored (a zero pair for that restart). A
    restart whose line search fails keeps its point, loses its history and continues next
    iteration from the step the search ended at (so a failing restart never repeats the same
    failed search: the DLG stall); each such reset is recorded in ``events``. Each trial
    point costs one batched evaluation (counted in ``evaluations``).
    """

    name = "lbfgs"
    moves_on_gradient = False  # a step its line search refuses stays put
    uncapturable = Reason("lbfgs-host-search")  # its line search accepts or halves each step on the host

    def __init__(self, lr: float = 1.0, history: int = 100, backtracks: int = 6, schedule: str = "constant",
                 nonmonotone: int = 1):
        if not lr > 0:
            raise ConfigError(f"lbfgs lr must be > 0, got {lr}")
        if nonmonotone < 1:
            raise ConfigError(f"lbfgs nonmonotone must be >= 1 (1: plain Armijo), got {nonmonotone}")
        self.nonmonotone = int(nonmonotone)
        if history < 1:
            raise ConfigError(f"lbfgs history must be >= 1, got {history}")
        self.lr, self.history, self.backtracks = float(lr), int(history), int(backtracks)
        self.schedule_name = schedule
        self.schedule = SCHEDULES.get(schedule)

    def start(self, variables, iterations):
        self.iterations = max(1, iterations)
        self.current: Optional[Tuple[Tensor, List[Tensor]]] = None
        self.evaluations = 0
        restarts = variables[0].shape[0]
        device, dtype = variables[0].device, variables[0].dtype
        width = sum(v[0].numel() for v in variables)
        # a ring buffer of `history` slots: pair number c lives in slot c % history (writing
        # a pair copies one row instead of re-concatenating the whole history each step)
        self.S = torch.zeros(restarts, self.history, width, device=device, dtype=dtype)  # steps
        self.Y = torch.zeros_like(self.S)                                   # gradient changes
        self.SY = torch.zeros(restarts, self.history, self.history, device=device, dtype=torch.float64)  # s_i . y_j
        self.YY = torch.zeros_like(self.SY)                                 # y_i . y_j, slot order
        self.count = 0  # pairs written (zero pairs included), all restarts together
        self.gamma = torch.ones(restarts, device=device, dtype=torch.float64)  # H0 = gamma I
        self.stored = torch.zeros(restarts, dtype=torch.long, device=device)  # valid pairs
        self.shrink = torch.ones(restarts, device=device)  # step factor after failed searches
        self.recent: Optional[Tensor] = None  # (R, nonmonotone) last accepted losses
        self.events: List[dict] = []

    def _evaluate(self, closure, variables):
        self.evaluations += 1
        loss, grads = closure(variables)
        return loss.detach(), [g.detach() for g in grads]

    @staticmethod
    def _flat(tensors: Sequence[Tensor]) -> Tensor:
        return torch.cat([t.reshape(t.shape[0], -1) for t in tensors], 1)

    @staticmethod
    def _split(flat: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
        out, at = [], 0
        for t in like:
            n = t[0].numel()
            out.append(flat[:, at:at + n].reshape(t.shape))
            at += n
        return out

    def _order(self) -> Tuple[int, Optional[Tensor]]:
        """Slots in use and, once the ring has wrapped, the slots oldest first (None: in order)."""
        if self.count <= self.history:
            return self.count, None
        return self.history, (self.count + torch.arange(self.history, device=self.S.device)) % self.history

    def _direction(self, grads: List[Tensor]) -> List[Tensor]:
        """``-H g`` per restart, H the compact L-BFGS inverse Hessian of the stored pairs."""
        g = self._flat(grads)
        gamma = self.gamma.to(g.dtype)[:, None]
        if self.count == 0:
            return self._split(-gamma * g, grads)
        m, order = self._order()
        S, Y = self.S[:, :m], self.Y[:, :m]
        a = torch.bmm(S, g[:, :, None]).double()                           # S^T g (slot order)
        b = torch.bmm(Y, g[:, :, None]).double()                           # Y^T g
        SY, YY = self.SY[:, :m, :m], self.YY[:, :m, :m]
        if order is not None:  # the compact form needs the pairs oldest first
            a, b, SY, YY = a[:, order], b[:, order], SY[:, order][:, :, order], YY[:, order][:, :, order]
        diag = torch.diagonal(SY, dim1=1, dim2=2)
        valid = diag > 0  # a zero pair (not stored for this restart) is decoupled by a unit diagonal
        upper = torch.triu(SY, 1) + torch.diag_embed(torch.where(valid, diag, torch.ones_like(diag)))
        u = torch.linalg.solve_triangular(upper, a, upper=True)           # R^-1 S^T g
        gam = self.gamma[:, None, None]
        t = torch.diag_embed(torch.where(valid, diag, torch.zeros_like(diag))) @ u + gam * (YY @ u) - gam * b
        p1 = torch.linalg.solve_triangular(upper.transpose(1, 2), t, upper=False)
        if order is not None:  # back to slot order
            back = torch.argsort(order)
            u, p1 = u[:, back], p1[:, back]
        hg = gamma * g + (torch.bmm(S.transpose(1, 2), p1.to(g.dtype))
                          - gamma[:, :, None] * torch.bmm(Y.transpose(1, 2), u.to(g.dtype))).squeeze(-1)
        return self._split(-hg, grads)

    def _store(self, s: Tensor, y: Tensor, useful: Tensor) -> None:
        """Write the pair (zero for restarts where it is not ``useful``) over the oldest slot."""
        keep = useful.to(s.dtype)[:, None]
        k = self.count % self.history
        self.S[:, k] = s * keep
        self.Y[:, k] = y * keep
        self.count += 1
        m = min(self.count, self.history)
        S, Y = self.S[:, :m], self.Y[:, :m]
        row_sy = torch.bmm(self.S[:, k:k + 1], Y.transpose(1, 2)).double()[:, 0]   # s_new . y_j
        col_sy = torch.bmm(S, self.Y[:, k, :, None]).double()[:, :, 0]            # s_i . y_new
        row_yy = torch.bmm(self.Y[:, k:k + 1], Y.transpose(1, 2)).double()[:, 0]  # y_new . y_j
        self.SY[:, k, :m], self.SY[:, :m, k] = row_sy, col_sy
        self.YY[:, k, :m], self.YY[:, :m, k] = row_yy, row_yy
        sy_new, yy_new = col_sy[:, k], row_yy[:, k]
        self.gamma = torch.where(useful & (yy_new > 0), sy_new / yy_new.clamp_min(1e-300), self.gamma)

    def reset(self, restarts: Tensor) -> None:
        """Forget the curvature history of the restarts in the boolean mask ``restarts``."""
        keep = (~restarts).to(self.S.dtype)[:, None, None]
        self.S.mul_(keep)
        self.Y.mul_(keep)
        self.SY.mul_(keep.double())
        self.YY.mul_(keep.double())
        self.gamma = torch.where(restarts, torch.ones_like(self.gamma), self.gamma)
        self.stored = torch.where(restarts, torch.zeros_like(self.stored), self.stored)

    def step(self, variables, closure, iteration):
        moved = self.current is not None and any(  # e.g. projected onto a box after the last step
            not torch.equal(v, p) for v, p in zip(variables, self.point))
        if self.current is None or moved:
            self.current = self._evaluate(closure, variables)
        loss, grads = self.current
        direction = self._direction(grads)
        slope = _per_restart_dot(grads, direction)
        gnorm = sum(g.abs().flatten(1).sum(1) for g in grads)
        first = self.lr * torch.clamp(1.0 / gnorm.clamp_min(1e-30), max=1.0)
        t = torch.where(self.stored == 0, first, torch.full_like(loss, self.lr)) * self.shrink
        t = t * self.schedule(iteration / self.iterations)
        bad = slope >= 0  # not a descent direction: fall back to steepest descent
        if bad.any():
            direction = [torch.where(_expand(bad, d), -g, d) for d, g in zip(direction, grads)]
            slope = _per_restart_dot(grads, direction)
        base = [v.detach().clone() for v in variables]
        accepted = torch.zeros_like(loss, dtype=torch.bool)
        new_loss, new_grads = loss, grads
        if self.recent is None:
            self.recent = loss[:, None].repeat(1, self.nonmonotone)
        # Armijo against the largest of the last `nonmonotone` accepted losses (Grippo et al.
        # 1986): with 1 the plain monotone search; larger windows let L-BFGS take its full steps
        reference = torch.where(torch.isfinite(self.recent), self.recent, loss[:, None]).max(1).values
        for _ in range(self.backtracks + 1):
            trial = [b + _expand(t, b) * d for b, d in zip(base, direction)]
            for v, tr, b in zip(variables, trial, base):
                v.copy_(torch.where(_expand(accepted, b), v, tr))
            tl, tg = self._evaluate(closure, variables)
            ok = torch.isfinite(tl) & (tl <= reference + 1e-4 * t * slope) & ~accepted
            new_loss = torch.where(ok, tl, new_loss)
            new_grads = [torch.where(_expand(ok, g), g_new, g) for g, g_new in zip(new_grads, tg)]
            accepted |= ok
            if accepted.all():
                break
            t = torch.where(accepted, t, t / 2)
        for v, b in zip(variables, base):  # failed restarts stay where they were
            v.copy_(torch.where(_expand(accepted, b), v, b))
        s = self._flat([v.detach() - b for v, b in zip(variables, base)])
        y = self._flat([gn - g for gn, g in zip(new_grads, grads)])
        sy = (s * y).sum(1)
        useful = accepted & (sy > 1e-10)  # curvature condition: otherwise the pair would mislead
        self._store(s, y, useful)
        self.stored = torch.clamp(self.stored + useful.long(), max=self.history)
        failed = ~accepted
        if failed.any():
            # a failed search: drop the (misleading) history and start the next search from the
            # step this one ended at, so the restart does not retry the same failed step
            self.reset(failed)
            self.shrink = torch.where(failed, self.shrink * 0.5 ** (self.backtracks + 1), self.shrink)
            self.events.append({"iteration": int(iteration), "restarts": failed.nonzero().flatten().tolist(),
                                "event": "line search failed: history reset, step shrunk to "
                                         f"{float(self.shrink[failed].min()):.3g} x"})
        # a restart that keeps succeeding recovers its step size
        self.shrink = torch.where(accepted, torch.clamp(self.shrink * 2, max=1.0), self.shrink)
        self.current = (new_loss, new_grads)
        self.point = [v.detach().clone() for v in variables]
        self.recent = torch.cat([self.recent[:, 1:], new_loss[:, None]], 1)
        return new_loss

    def select(self, index: Tensor) -> None:
        """Keep only the restarts at ``index`` (history, step state and the current point)."""
        self.S, self.Y, self.SY, self.YY = self.S[index], self.Y[index], self.SY[index], self.YY[index]
        self.gamma, self.stored, self.shrink = self.gamma[index], self.stored[index], self.shrink[index]
        self.recent = None if self.recent is None else self.recent[index]
        if self.current is not None:
            self.current = (self.current[0][index], [g[index] for g in self.current[1]])
            self.point = [p[index] for p in self.point]

    def recover(self, restarts: Tensor) -> str:
        """Restarts (boolean mask) that stalled or diverged: history reset, step x0.1."""
        self.reset(restarts)
        self.shrink = torch.where(restarts, self.shrink * 0.1, self.shrink)
        self.current = None  # the watchdog may have moved them back to their best point
        if self.recent is not None:  # their window restarts from their next loss
            self.recent = torch.where(restarts[:, None], torch.full_like(self.recent, float("nan")), self.recent)
        return f"lbfgs history reset, step x0.1 (now {float(self.shrink[restarts].min()):.3g} x)"

    def settings(self) -> dict:
        return {"optimizer": "lbfgs", "lr": self.lr, "history": self.history,
                "backtracks": self.backtracks, "schedule": self.schedule_name, "nonmonotone": self.nonmonotone}


class Watchdog:
    """Wraps an optimiser so that no restart stalls silently.

    Per restart it keeps the best loss and point. A non-finite loss sends the restart back
    to its best point; a restart whose loss has not gone below its first value after
    ``patience`` steps, or has not improved for ``patience`` steps while still at its very
    first value, is treated the same way. Either way the inner optimiser's ``recover(mask)``
    changes what it does (smaller step, fresh history / moments) and the event is recorded
    in ``events``. :meth:`progress` tells, per restart, whether the loss ever went below its
    first value by a relative ``tolerance`` (the optimisation run reports "failed to optimise" if not).
    """

    def __init__(self, inner, patience: int = 8, tolerance: float = 1e-4, max_recoveries: int = 4):
        if patience < 1:
            raise ConfigError(f"watchdog patience must be >= 1, got {patience}")
        self.inner, self.patience, self.tolerance = inner, int(patience), float(tolerance)
        self.max_recoveries = int(max_recoveries)
        self.name = getattr(inner, "name", type(inner).__name__)

    @property
    def uncapturable(self) -> Optional[Reason]:
        return getattr(self.inner, "uncapturable", Reason("optimizer-not-capture-safe", optimizer=self.name))

    def start(self, variables: List[Tensor], iterations: int) -> None:
        self.inner.start(variables, iterations)
        r = variables[0].shape[0]
        device = variables[0].device
        # the first finite loss (inf until there is one) and the best, per restart
        self.first = torch.full((r,), float("inf"), device=device)
        self.best = torch.full((r,), float("inf"), device=device)
        self.best_point = [v.detach().clone() for v in variables]
        self.since = torch.zeros(r, dtype=torch.long, device=device)
        self.recoveries = torch.zeros(r, dtype=torch.long, device=device)
        self.moved = torch.zeros(r, dtype=torch.bool, device=device)  # did a step ever change the point?
        self.events: List[dict] = []
        # the captured path's log of recoveries: per restart and recovery, the iteration
        # (-1: none), whether the loss was non-finite, and the inner optimiser's note; a last
        # column takes the writes of the restarts not recovering (so no read-modify-write)
        shape = (r, self.max_recoveries + 1)
        self.log_at = torch.full(shape, -1, dtype=torch.long, device=device)
        self.log_nonfinite = torch.zeros(shape, dtype=torch.bool, device=device)
        self.log_note = torch.zeros(shape, device=device)

    @property
    def evaluations(self) -> int:
        return self.inner.evaluations

    def lr_at(self, iteration: int) -> float:
        return self.inner.lr_at(iteration)

    def step(self, variables: List[Tensor], closure: Closure, iteration: int) -> Tensor:
        before = [v.detach().clone() for v in variables]
        loss = self.inner.step(variables, closure, iteration).detach()
        # the loss was evaluated at the point before an Adam step, after an L-BFGS step
        stalled, nonfinite = self._judge(loss, variables if getattr(self.inner, "name", "") == "lbfgs" else before)
        for v, b in zip(variables, before):
            self.moved.logical_or_((v.detach() != b).reshape(v.shape[0], -1).any(1))
        if stalled.any() and hasattr(self.inner, "recover"):
            self._back_to_best(variables, stalled)
            what = self.inner.recover(stalled)
            self.events.append({"iteration": int(iteration), "restarts": stalled.nonzero().flatten().tolist(),
                                "event": f"{self._why(~nonfinite[stalled])}: {what}"})
        return loss

    def update(self, variables: List[Tensor], loss: Tensor, grads: Sequence[Tensor], lr, iteration: Tensor) -> None:
        """:meth:`step` given the evaluated ``loss`` and ``grads``, in place and with no host
        synchronisation (capture-safe): every restart's recovery is applied by mask and
        logged at ``iteration`` (a 0-dim tensor) for :meth:`flush_log`. Written for few
        kernels (it runs in every captured iteration): a restart "moved" where its gradient
        was non-zero, which is when an Adam step moves it."""
        stalled, nonfinite = self._judge(loss.detach(), variables)  # evaluated here, before the step
        for g in grads:
            self.moved.logical_or_((g != 0).reshape(g.shape[0], -1).any(1))
        self.inner.update(variables, loss, grads, lr, iteration)
        column = torch.where(stalled, self.recoveries, self.max_recoveries)[:, None]
        self.log_at.scatter_(1, column, iteration.to(self.log_at.dtype).expand(column.shape))
        self.log_nonfinite.scatter_(1, column, nonfinite[:, None])
        self.inner.recover_(stalled)
        self.log_note.scatter_(1, column, self.inner.recovery_note()[:, None])
        self._back_to_best(variables, stalled)

    def _judge(self, loss: Tensor, at: List[Tensor]) -> Tuple[Tensor, Tensor]:
        """Take ``loss``, evaluated at the point ``at``: update the best loss and point; the
        restarts to recover now, and which losses are not finite."""
        inf = float("inf")
        loss = loss.nan_to_num(nan=inf, posinf=inf, neginf=inf)  # a non-finite loss never improves
        nonfinite = loss == inf
        improved = loss < self.best
        with torch.no_grad():
            for point, v in zip(self.best_point, at):
                torch.where(_expand(improved, point), v.detach(), point, out=point)
        torch.where(improved, loss, self.best, out=self.best)
        torch.where(self.first == inf, loss, self.first, out=self.first)
        self.since.add_(1).masked_fill_(improved, 0)
        stalled = nonfinite | ((self.since >= self.patience) > self._progressed())
        return stalled & (self.recoveries < self.max_recoveries), nonfinite

    def _progressed(self) -> Tensor:
        """Per restart: is its best loss below its first by the relative ``tolerance``?"""
        return self.best < torch.add(self.first, self.first.abs(), alpha=-self.tolerance)

    def _back_to_best(self, variables: List[Tensor], stalled: Tensor) -> None:
        """Send the ``stalled`` restarts back to their best point (or the start)."""
        with torch.no_grad():
            for v, point in zip(variables, self.best_point):
                torch.where(_expand(stalled, v), point, v, out=v)
        self.recoveries.add_(stalled)
        self.since.masked_fill_(stalled, 0)

    def _why(self, finite: Tensor) -> str:
        return "non-finite loss" if not bool(finite.all()) else f"no decrease in {self.patience} steps"

    def state(self) -> Dict[str, Tensor]:
        """The per-restart tensors :meth:`update` reads and writes, the inner optimiser's included."""
        return {**{f"inner.{k}": v for k, v in self.inner.state().items()},
                **{f"best_point{i}": p for i, p in enumerate(self.best_point)},
                "first": self.first, "best": self.best, "since": self.since, "recoveries": self.recoveries,
                "moved": self.moved,
                "log_at": self.log_at, "log_nonfinite": self.log_nonfinite, "log_note": self.log_note}

    def flush_log(self) -> None:
        """Turn the logged recoveries into ``events`` (one per iteration, as :meth:`step`
        records them) and clear the log."""
        at, nonfinite, note = (log[:, :self.max_recoveries].cpu()
                               for log in (self.log_at, self.log_nonfinite, self.log_note))
        for iteration in sorted(set(at[at >= 0].tolist())):
            hit = at == iteration
            restarts = hit.any(1)
            self.events.append({
                "iteration": int(iteration), "restarts": restarts.nonzero().flatten().tolist(),
                "event": f"{self._why(~nonfinite[hit])}: {self.inner.recovery_message(note[hit])}"})
        self.log_at.fill_(-1)
        self.log_nonfinite.fill_(False)
        self.log_note.zero_()

    def select(self, index: Tensor) -> None:
        """Keep only the restarts at ``index``, here and in the inner optimiser."""
        self.inner.select(index)
        self.first, self.best, self.since = self.first[index], self.best[index], self.since[index]
        self.recoveries, self.moved = self.recoveries[index], self.moved[index]
        self.best_point = [p[index] for p in self.best_point]
        self.log_at, self.log_nonfinite = self.log_at[index], self.log_nonfinite[index]
        self.log_note = self.log_note[index]

    def progress(self) -> Tensor:
        """Per restart: did the loss ever go below its first value (relative ``tolerance``)?"""
        return torch.isfinite(self.best) & self._progressed()

    def flat(self) -> Tensor:
        """Per restart: is its loss flat, not merely hard? True where no step ever moved its
        point under an optimiser that moves on any non-zero gradient (Adam): the gradient was
        zero throughout. An optimiser that may refuse steps (L-BFGS) never tells."""
        if not getattr(self.inner, "moves_on_gradient", False):
            return torch.zeros_like(self.moved)
        return ~self.moved

    def all_events(self) -> List[dict]:
        """The watchdog's interventions and the inner optimiser's own (e.g. failed line searches)."""
        return sorted(self.events + list(getattr(self.inner, "events", [])), key=lambda e: e["iteration"])

    def settings(self) -> dict:
        return {**self.inner.settings(), "watchdog_patience": self.patience}


OPTIMIZERS.add("adam", Adam, "Adam per restart; lr, schedule (step/cosine/exp/constant), signed gradients")
OPTIMIZERS.add("lbfgs", LBFGS, "L-BFGS per restart with Armijo backtracking (DLG); lr, history")
