"""Gradient inversion attacks: one composable optimisation attack, analytic inversion and
label inference.

* :data:`ATTACKS` -- named attacks, ``ATTACKS.build("ig", restarts=4, tv=1e-3)``;
* :class:`OptimizationAttack` -- objective + priors + init + box + optimiser + restarts;
* :class:`GradientSimulator` -- dummy data -> shared gradient, the adaptive-attack hook;
* :func:`infer_labels` -- iDLG (batch 1) and class counts (batch);
* :func:`observe` -- a client round on a private batch -> :class:`~audit.core.types.Observation`.
"""
from audit.client.observe import observe

from attacks.analytic import AnalyticInversion, invert_linear_input
from attacks.optimization import OptimizationAttack, validate_observation
from attacks.labels import LABEL_METHODS, LabelInference, infer_labels
from attacks.objectives import OBJECTIVES, Objective, build_objective
from attacks.optimizers import OPTIMIZERS, SCHEDULES
from attacks.presets import ATTACKS, KNOBS, compose, register_preset
from attacks.search_space import BOXES, INITS
from attacks.simulator import SIMULATORS, ClientReplica, DefenseSimulator, GradientSimulator, SimContext, client_update

__all__ = [
    "ATTACKS", "KNOBS", "compose", "register_preset", "OptimizationAttack", "validate_observation",
    "AnalyticInversion", "invert_linear_input", "LABEL_METHODS", "LabelInference", "infer_labels",
    "OBJECTIVES", "Objective", "build_objective", "OPTIMIZERS", "SCHEDULES", "BOXES", "INITS",
    "SIMULATORS", "ClientReplica", "DefenseSimulator", "GradientSimulator", "SimContext", "client_update",
    "observe",
]

from attacks import generative  # noqa: E402,F401  (GGL, GIAS, GIFD and the "generator" box)
from attacks import portfolio  # noqa: E402,F401  (the portfolio attack)
from attacks import spear, spear_features  # noqa: E402,F401  (SPEAR; ig with its exact features)
from attacks import conv_span  # noqa: E402,F401  (the batch from the convolutions' row spaces)
from attacks import conv_span_ig  # noqa: E402,F401  (ig started from the conv-span batch)
# the adaptive attacks (adaptive/) register themselves in ATTACKS when `adaptive` is imported
