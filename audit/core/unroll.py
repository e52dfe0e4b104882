"""The client's local-step unroll, shared by the client simulation (what a client really
sends) and the attacker's replica (what it would send for dummy data): one code path, so the
attacker replays exactly what the client ran, optimiser state included."""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

from torch import Tensor

from audit.core.errors import ConfigError
from audit.core.local_training import LocalOptimizer, optimizer_step


def local_batches(batch_size: int, local_batch_size: Optional[int], steps: int) -> List[slice]:
    """The rows each FedAvg local step uses: consecutive chunks of ``local_batch_size`` in
    order, cycling over the batch (full batch every step when ``local_batch_size`` is None)."""
    if steps < 1:
        raise ConfigError(f"local_steps must be >= 1, got {steps}")
    if local_batch_size is None or local_batch_size >= batch_size:
        return [slice(0, batch_size)] * steps
    if local_batch_size < 1:
        raise ConfigError(f"local_batch_size must be >= 1, got {local_batch_size}")
    starts = list(range(0, batch_size, local_batch_size))
    return [slice(s, min(s + local_batch_size, batch_size)) for s in (starts[k % len(starts)] for k in range(steps))]


def steps_for_epochs(epochs: int, batch_size: int, local_batch_size: Optional[int]) -> int:
    """Local steps of ``epochs`` passes over a private batch of ``batch_size`` images in
    mini-batches of ``local_batch_size`` (the last one smaller when it does not divide)."""
    if epochs < 1:
        raise ConfigError(f"local_epochs must be >= 1, got {epochs}")
    per_epoch = 1 if local_batch_size is None else math.ceil(batch_size / max(1, min(local_batch_size, batch_size)))
    return int(epochs) * per_epoch


def client_update(
    step_grads: Callable[[Dict[str, Tensor], Tensor, Tensor, int], Dict[str, Tensor]],
    params: Dict[str, Tensor], x: Tensor, y: Tensor, *,
    steps: int = 1, lr: float = 0.0, batch_size: Optional[int] = None,
    optimizer: Optional[LocalOptimizer] = None,
) -> List[Tensor]:
    """Unroll ``steps`` local steps of ``optimizer`` (plain SGD when None); return the update in
    gradient units, ``(theta_0 - theta_K) / lr`` (the sum of the steps' directions, so one
    plain step is the gradient itself and ``lr`` may be 0 then).

    ``step_grads(params, xb, yb, k)`` gives the gradient of step ``k``; mini-batches follow
    :func:`local_batches`. Differentiable when ``step_grads`` is, through the optimiser's state.
    """
    optimizer = optimizer or LocalOptimizer()
    if steps > 1 and lr <= 0:
        raise ConfigError(f"{steps} local steps need a positive local learning rate, got {lr}")
    total: Optional[Dict[str, Tensor]] = None
    state: Dict[str, Dict[str, Tensor]] = {}
    for k, rows in enumerate(local_batches(x.shape[0], batch_size, steps)):
        g = step_grads(params, x[rows], y[rows], k)
        if not optimizer.plain:
            g, state = optimizer_step(optimizer, params, g, state, k + 1)
        total = g if total is None else {n: total[n] + g[n] for n in total}
        if k < steps - 1:
            params = {n: params[n] - lr * g[n] for n in params}
    return list(total.values())
