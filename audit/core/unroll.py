"""The client's local-step unroll, shared by the client simulation (what a client really
sends) and the attacker's replica (what it would send for dummy data): one code path, so the
attacker replays exactly what the client ran."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

from torch import Tensor

from audit.core.errors import ConfigError


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


def client_update(
    step_grads: Callable[[Dict[str, Tensor], Tensor, Tensor, int], Dict[str, Tensor]],
    params: Dict[str, Tensor], x: Tensor, y: Tensor, *,
    steps: int = 1, lr: float = 0.0, batch_size: Optional[int] = None,
) -> List[Tensor]:
    """Unroll ``steps`` local SGD steps; return the accumulated gradient ``(theta_0 - theta_K) / lr``.

    ``step_grads(params, xb, yb, k)`` gives the gradient of step ``k``; mini-batches follow
    :func:`local_batches`. Differentiable when ``step_grads`` is.
    """
    if steps > 1 and lr <= 0:
        raise ConfigError(f"{steps} local steps need a positive local learning rate, got {lr}")
    total: Optional[Dict[str, Tensor]] = None
    for k, rows in enumerate(local_batches(x.shape[0], batch_size, steps)):
        g = step_grads(params, x[rows], y[rows], k)
        total = g if total is None else {n: total[n] + g[n] for n in total}
        if k < steps - 1:
            params = {n: params[n] - lr * g[n] for n in params}
    return list(total.values())
