"""GradInversion's group-consistency prior."""
from __future__ import annotations

from audit.core.errors import ConfigError

from priors.base import PRIORS, Prior, PriorContext


class GroupConsistency(Prior):
    """``mean((x - group_mean)^2)`` from iteration ``start`` on, where ``group_mean`` is the
    (detached) mean of all restarts' current images; zero before ``start`` or with one
    restart. Registration of the restarts before averaging is not done (pixel-aligned mean)."""

    name = "group"
    requires = frozenset({"group_mean"})

    def __init__(self, start: int = 0):
        if start < 0:
            raise ConfigError(f"group start must be >= 0, got {start}")
        self.start = int(start)

    def __call__(self, x, context: PriorContext):
        if context.iteration < self.start or context.group_mean is None:
            return (x * 0).sum()
        return (x - context.group_mean).pow(2).mean()


@PRIORS.register("group", "group consistency (GradInversion): distance to the mean of restarts, from `start`")
def group(start: int = 0) -> Prior:
    return GroupConsistency(start)
