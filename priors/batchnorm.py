"""DeepInversion's BatchNorm-statistics prior (used by GradInversion)."""
from __future__ import annotations

from audit.core.reasons import Reason
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
            raise NotApplicable(Reason("prior-needs-running-statistics", prior="bn"))
        return sum((m - rm).norm() + (v - rv).norm() for (m, v), (rm, rv) in zip(stats, running))


@PRIORS.register("bn", "BatchNorm statistics (DeepInversion): batch mean/var of BN inputs vs running stats")
def bn() -> Prior:
    return BatchNormStatistics()


class UploadedBatchNormStatistics(Prior):
    """The private batch's BatchNorm statistics that a client's uploaded buffers reveal
    (:mod:`audit.core.buffers`), matched by the dummy batch's: per layer, the replica's
    per-step input statistics mixed with the upload's step weights, compared in units of the
    revealed standard deviation,

        mean_c ((mu - mu*)^2 + (sd - sd*)^2) / var*,

    averaged over layers (so one weight fits any depth and width). Needs
    ``context.features["bn_steps"]`` (recorded by the simulator at every local step) and
    ``context.revealed`` (the observation's :class:`~audit.core.buffers.RevealedStatistics`)."""

    name = "bn-upload"
    requires = frozenset({"bn_steps"})

    def __call__(self, x, context: PriorContext):
        steps, revealed = context.features.get("bn_steps"), getattr(context, "revealed", None)
        if not steps or revealed is None or any(len(s) != len(revealed.means) for s in steps):
            raise NotApplicable(Reason("bn-upload-needs-buffers"))
        total = 0.0
        for layer, (target_mean, target_var) in enumerate(zip(revealed.means, revealed.variances)):
            weights = revealed.weights[layer]
            mean = sum(w * step[layer][0] for w, step in zip(weights, steps))
            var = sum(w * step[layer][1] for w, step in zip(weights, steps))
            scale = target_var.clamp_min(1e-6)
            spread = (var.clamp_min(0) + 1e-8).sqrt() - (target_var + 1e-8).sqrt()
            total = total + (((mean - target_mean) ** 2 + spread ** 2) / scale).mean()
        return total / len(revealed.means)
