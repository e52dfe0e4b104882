"""DeepInversion's BatchNorm-statistics prior (used by GradInversion)."""
from __future__ import annotations

from audit.core.errors import NotApplicable

from priors.base import PRIORS, Prior, PriorContext


class BatchNormStatistics(Prior):
    """``sum_l |mu_l(x) - mu_l^run|_2 + |var_l(x) - var_l^run|_2`` over BatchNorm layers: the
    dummy batch's per-channel input statistics should match the model's running statistics.
    Needs ``context.features["bn"]`` (recorded by the simulator) and ``context.bn_running``."""

    name = "bn"
    requires = frozenset({"bn_stats"})

    def __call__(self, x, context: PriorContext):
        stats, running = context.features.get("bn"), context.bn_running
        if not stats or running is None or len(stats) != len(running):
            raise NotApplicable("the bn prior needs BatchNorm layers with running statistics in the "
                                "observation's model; set its weight to 0 for this model")
        return sum((m - rm).norm() + (v - rv).norm() for (m, v), (rm, rv) in zip(stats, running))


@PRIORS.register("bn", "BatchNorm statistics (DeepInversion): batch mean/var of BN inputs vs running stats")
def bn() -> Prior:
    return BatchNormStatistics()
