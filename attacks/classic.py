"""The model's classic attack: attacks the plan adds because of the audited model itself.

The base attacks (the portfolio and ``ig``) are tuned for ReLU convolutional networks. Some
models have an attack of their own that the literature showed them weak to, and an audit that
leaves it out measures its own blind spot: DLG (L2 gradient matching with L-BFGS, labels
optimised jointly) recovers images exactly on its sigmoid LeNet, where ``ig``'s cosine and
signed Adam stall. Each rule reads the model and returns ``(attack, reason)`` pairs, the reason a
code the report words; adding one is one decorated function.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

from torch import nn

from audit.core.reasons import Reason
from audit.core.registry import Registry

CLASSIC_RULES = Registry("classic attack rule")

Rule = Callable[[nn.Module], List[Tuple[str, Reason]]]

#: activations twice differentiable everywhere: L-BFGS on the L2 gradient distance converges on them
SMOOTH = (nn.Sigmoid, nn.Tanh, nn.Softplus, nn.GELU, nn.SiLU, nn.ELU)
#: piecewise-linear activations: their second derivative is zero almost everywhere
PIECEWISE = (nn.ReLU, nn.LeakyReLU, nn.ReLU6, nn.PReLU, nn.Hardtanh)


@CLASSIC_RULES.register("smooth-activations", "DLG where every activation is smooth (DLG's sigmoid LeNet)")
def smooth_activations(model: nn.Module) -> List[Tuple[str, Reason]]:
    kinds = [m for m in model.modules() if isinstance(m, SMOOTH + PIECEWISE)]
    if not kinds or any(isinstance(m, PIECEWISE) for m in kinds):
        return []
    names = sorted({type(m).__name__ for m in kinds})
    return [("dlg", Reason("classic-smooth-activations", activations=names))]


def classic_attacks(model: nn.Module) -> List[Tuple[str, Reason]]:
    """Every rule's ``(attack, reason)`` for ``model``, each attack once, in rule order."""
    found: dict = {}
    for name in CLASSIC_RULES.names():
        for attack, reason in CLASSIC_RULES.get(name)(model):
            found.setdefault(attack, reason)
    return list(found.items())
