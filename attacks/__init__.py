"""Gradient inversion attacks: one composable optimisation engine, analytic inversion and
label inference.

* :data:`ATTACKS` -- named attacks, ``ATTACKS.build("ig", restarts=4, tv=1e-3)``;
* :class:`OptimizationAttack` -- objective + priors + init + box + optimiser + restarts;
* :class:`GradientSimulator` -- dummy data -> shared gradient, the adaptive-attack hook;
* :func:`infer_labels` -- iDLG (batch 1) and class counts (batch);
* :func:`observe` -- a client round on a private batch -> :class:`~audit.types.Observation`.
"""
from audit.observe import observe

from .analytic import AnalyticInversion, invert_linear_input
from .engine import OptimizationAttack, validate_observation
from .labels import LABEL_METHODS, LabelInference, infer_labels
from .objectives import OBJECTIVES, Objective, build_objective
from .optimizers import OPTIMIZERS, SCHEDULES
from .presets import ATTACKS, KNOBS, compose, register_preset
from .search_space import BOXES, INITS
from .simulator import SIMULATORS, ClientReplica, DefenseSimulator, GradientSimulator, SimContext, client_update

__all__ = [
    "ATTACKS", "KNOBS", "compose", "register_preset", "OptimizationAttack", "validate_observation",
    "AnalyticInversion", "invert_linear_input", "LABEL_METHODS", "LabelInference", "infer_labels",
    "OBJECTIVES", "Objective", "build_objective", "OPTIMIZERS", "SCHEDULES", "BOXES", "INITS",
    "SIMULATORS", "ClientReplica", "DefenseSimulator", "GradientSimulator", "SimContext", "client_update",
    "observe",
]

# attacks implemented in adaptive/ on top of this engine register themselves in ATTACKS on import
import adaptive.bayes_optimal  # noqa: E402,F401
import adaptive.learned_inverter  # noqa: E402,F401
import adaptive.catalog  # noqa: E402,F401  (through-defense, mask-replay, layer-drop, ...)
from . import generative  # noqa: E402,F401  (GGL, GIAS, GIFD and the "generator" box)
