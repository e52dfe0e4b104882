"""The client's local optimiser, as a record and as a functional, differentiable step.

A deployed FedAvg client trains with SGD (momentum, Nesterov, weight decay) or Adam / AdamW
and uploads its new weights. :class:`LocalOptimizer` describes that optimiser (parsed from
``"sgd:momentum=0.9,nesterov=1"`` on the command line); :data:`OPTIMIZER_RULES` holds one
functional rule per name, used by the shared unroll (:mod:`audit.core.unroll`) on the
client and in the attacker's replica, so an attack differentiates through the optimiser's
state exactly as the client ran it. Each rule follows ``torch.optim``'s update to float
tolerance (tests/test_local_training.py checks it against ``torch.optim``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Dict, Tuple

import torch
from torch import Tensor

from audit.core.errors import ConfigError
from audit.core.registry import Registry

State = Dict[str, Dict[str, Tensor]]


@dataclass(frozen=True)
class LocalOptimizer:
    """The client's local optimiser: ``name`` (``sgd`` / ``adam`` / ``adamw``) and its settings,
    with ``torch.optim``'s meaning and defaults (``betas`` and ``eps`` for Adam / AdamW;
    ``momentum``, ``dampening`` and ``nesterov`` for SGD; ``weight_decay`` for all, which
    AdamW applies decoupled). The learning rate is the training's, not the optimiser's.

    ``relative_eps`` is the attacker's smoothing, never a client's setting (``parse`` refuses
    it): Adam's ``eps`` grows by ``relative_eps`` times each tensor's gradient RMS (detached),
    which turns the near-sign update ``m / (sqrt(v) + eps)`` into a soft sign, smooth in the
    image; 0 is the exact rule."""

    name: str = "sgd"
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    relative_eps: float = 0.0

    def __post_init__(self):
        if self.name not in OPTIMIZER_RULES:
            raise ConfigError(f"unknown local optimizer {self.name!r}; valid: {', '.join(OPTIMIZER_RULES.names())}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"local optimizer momentum must be in [0, 1), got {self.momentum}")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"local optimizer {key} must be in [0, 1), got {getattr(self, key)}")
        if self.weight_decay < 0 or self.eps <= 0 or not 0.0 <= self.dampening <= 1.0:
            raise ConfigError("local optimizer needs weight_decay >= 0, eps > 0 and dampening in [0, 1]; got "
                              f"{self.weight_decay}, {self.eps}, {self.dampening}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ConfigError("nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)")
        if self.relative_eps < 0 or (self.relative_eps and self.name == "sgd"):
            raise ConfigError(f"relative_eps smooths Adam / AdamW and must be >= 0, got {self.relative_eps} "
                              f"for {self.name}")
        if self.name != "sgd" and (self.momentum or self.nesterov or self.dampening):
            raise ConfigError(f"{self.name} takes beta1 / beta2 / eps, not momentum / nesterov / dampening")

    @property
    def plain(self) -> bool:
        """True for SGD without momentum or weight decay (each step moves by the gradient)."""
        return self.name == "sgd" and not self.momentum and not self.weight_decay

    def describe(self) -> str:
        """``sgd`` / ``sgd(momentum=0.9, weight_decay=0.0005)`` / ``adam(beta1=0.9, ...)``: the
        settings that differ from the defaults, for reports."""
        default = LocalOptimizer(self.name)
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if f.name != "name"
                   and getattr(self, f.name) != getattr(default, f.name)]
        return self.name + (f"({', '.join(changed)})" if changed else "")

    @classmethod
    def parse(cls, spec: Any) -> "LocalOptimizer":
        """``None`` / a :class:`LocalOptimizer` / ``"adam"`` / ``"sgd:momentum=0.9,nesterov=1"`` /
        ``{"name": "sgd", "momentum": 0.9}``."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, dict):
            return cls._build(dict(spec))
        if not isinstance(spec, str):
            raise ConfigError(f"local optimizer must be a name such as 'sgd:momentum=0.9', got {spec!r}")
        name, _, rest = spec.strip().partition(":")
        settings: Dict[str, Any] = {"name": name.strip().lower()}
        for pair in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = pair.partition("=")
            if not eq:
                raise ConfigError(f"local optimizer setting {pair!r} is not key=value "
                                  "(e.g. 'sgd:momentum=0.9,weight_decay=5e-4')")
            settings[key.strip()] = value.strip()
        return cls._build(settings)

    @classmethod
    def _build(cls, settings: Dict[str, Any]) -> "LocalOptimizer":
        known = {f.name: f.type for f in fields(cls) if f.name not in ATTACKER_SIDE}
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise ConfigError(f"unknown local optimizer setting(s) {', '.join(unknown)}; valid: "
                              f"{', '.join(k for k in known if k != 'name')}")
        out: Dict[str, Any] = {}
        for key, value in settings.items():
            if key == "name":
                out[key] = str(value).lower()
            elif key == "nesterov":
                out[key] = _boolean(value)
            else:
                try:
                    out[key] = float(value)
                except (TypeError, ValueError):
                    raise ConfigError(f"local optimizer setting {key}={value!r} must be a number") from None
        return cls(**out)

    def with_(self, **changes: Any) -> "LocalOptimizer":
        return replace(self, **changes)


#: fields an attacker's replica sets, never a client's description
ATTACKER_SIDE = ("relative_eps",)


def _boolean(value: Any) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"nesterov must be true or false, got {value!r}")


# --------------------------------------------------------------------------- functional rules
#: ``rule(opt, params, grads, state, t) -> (direction, state)``: the step moves each parameter
#: by ``-lr * direction``; ``t`` counts steps from 1; pure torch, differentiable and vmappable.
Rule = Callable[[LocalOptimizer, Dict[str, Tensor], Dict[str, Tensor], State, int],
                Tuple[Dict[str, Tensor], State]]
OPTIMIZER_RULES = Registry("local optimizer")


@OPTIMIZER_RULES.register("sgd", "SGD with momentum, dampening, Nesterov and (L2) weight decay, as torch.optim.SGD")
def _sgd(opt: LocalOptimizer, params, grads, state, t):
    direction, buffers = {}, {}
    for n, g in grads.items():
        if opt.weight_decay:
            g = g + opt.weight_decay * params[n]
        if opt.momentum:
            previous = state.get("momentum", {}).get(n)
            buf = g if previous is None else opt.momentum * previous + (1.0 - opt.dampening) * g
            buffers[n] = buf
            g = g + opt.momentum * buf if opt.nesterov else buf
        direction[n] = g
    return direction, ({"momentum": buffers} if opt.momentum else state)


def _adam_direction(opt: LocalOptimizer, params, grads, state, t, decoupled: bool):
    first, second, direction = {}, {}, {}
    bias1, bias2 = 1.0 - opt.beta1 ** t, 1.0 - opt.beta2 ** t
    for n, g in grads.items():
        if opt.weight_decay and not decoupled:
            g = g + opt.weight_decay * params[n]
        m0, v0 = state.get("m", {}).get(n), state.get("v", {}).get(n)
        m = (1.0 - opt.beta1) * g if m0 is None else opt.beta1 * m0 + (1.0 - opt.beta1) * g
        v = (1.0 - opt.beta2) * g * g if v0 is None else opt.beta2 * v0 + (1.0 - opt.beta2) * g * g
        first[n], second[n] = m, v
        # clamp_min: sqrt's derivative at 0 is infinite; below the clamp its gradient is 0
        eps = opt.eps + opt.relative_eps * g.detach().square().mean().sqrt() if opt.relative_eps else opt.eps
        d = (m / bias1) / ((v / bias2).clamp_min(1e-30).sqrt() + eps)
        direction[n] = d + opt.weight_decay * params[n] if (decoupled and opt.weight_decay) else d
    return direction, {"m": first, "v": second}


@OPTIMIZER_RULES.register("adam", "Adam with (L2) weight decay, as torch.optim.Adam")
def _adam(opt, params, grads, state, t):
    return _adam_direction(opt, params, grads, state, t, decoupled=False)


@OPTIMIZER_RULES.register("adamw", "AdamW (decoupled weight decay), as torch.optim.AdamW")
def _adamw(opt, params, grads, state, t):
    return _adam_direction(opt, params, grads, state, t, decoupled=True)


def optimizer_step(opt: LocalOptimizer, params: Dict[str, Tensor], grads: Dict[str, Tensor], state: State,
                   t: int) -> Tuple[Dict[str, Tensor], State]:
    """One step of ``opt``'s rule: the direction (the step is ``-lr * direction``) and the new state."""
    return OPTIMIZER_RULES.get(opt.name)(opt, params, grads, state, t)


def torch_optimizer(opt: LocalOptimizer, params, lr: float) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimiser ``opt`` describes (for clients that train in place)."""
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, dampening=opt.dampening,
                               nesterov=opt.nesterov, weight_decay=opt.weight_decay)
    kind = torch.optim.Adam if opt.name == "adam" else torch.optim.AdamW
    return kind(params, lr=lr, betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=opt.weight_decay)
