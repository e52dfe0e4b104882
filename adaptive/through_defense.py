"""Through-the-defense matching: the dummy gradient goes through the defense before it is
compared with the observation. Deterministic defense: replay. Stochastic defense: EOT,
``samples`` draws of the defense's randomness per evaluation, averaged in the loss.

Works for any differentiable defended-gradient callable. A gradient-only defense (clean
gradient then ``transform``; noise, pruning, quantisation, SVDefense, user
``@gradient_transform`` functions) is applied to every local step's gradient, so FedAvg
observations are replayed too, and for one local step the dummy's clean gradient is
computed once per evaluation and only the cheap ``transform`` is sampled ``samples``
times. Any other callable runs on the dummy data once for all ``samples`` draws
(``Defense.many``: the clean gradient and whatever else the draws share is paid once; a
plain callable is called ``samples`` times), one local step.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from attacks.objectives import OBJECTIVES, StackedMean
from attacks.simulator import ClientReplica, DefenseSimulator, GradientSimulator, SimContext
from audit.core.errors import ConfigError
from audit.core.randomness import VMAP_DRAWS
from audit.core.reasons import Reason
from audit.core.types import Defense, Observation, is_gradient_only

from adaptive.adapted import Adaptation, AdaptedAttack, register
from adaptive.planner.rules import EOT_SAMPLES


class DefenseTransform:
    """Simulator transform ``grads -> defense.transform(grads)`` (white-box replay)."""

    def __init__(self, defense: Defense):
        self.defense = defense
        self.vmappable = not getattr(defense, "stochastic", True)
        self.__name__ = f"{getattr(defense, 'name', 'defense')}.transform"

    def __call__(self, grads: List[Tensor], context: SimContext) -> List[Tensor]:
        return list(self.defense.transform(list(grads), generator=context.generator,
                                           model=context.observation.model))


def defended_client(defense: Any) -> GradientSimulator:
    """A simulator of the defended client: a gradient-only defense transforms every local
    step's gradient (FedAvg included); any other callable runs on the replica (one step)."""
    if is_gradient_only(defense):
        return GradientSimulator(step_transforms=[DefenseTransform(defense)])
    return DefenseSimulator()


class EOTSimulator(GradientSimulator):
    """``samples`` defended gradients of the same dummy batch, stacked ``(samples, *shape)``
    per parameter (:class:`~attacks.objectives.StackedMean` averages the objective over them). A gradient-only
    defense on a single-step observation reuses one clean gradient for all samples.

    ``in_program``: the defense draws its randomness inside the batched program
    (``Defense.vmap_draws``; :mod:`audit.core.randomness`), so every member of a group (images
    x restarts x draws) runs as one ``vmap``; otherwise members run one after another."""

    vmappable = False

    def __init__(self, samples: int, in_program: bool = False):
        super().__init__()
        if samples < 1:
            raise ConfigError(f"EOT needs samples >= 1, got {samples}")
        self.samples = int(samples)
        self.vmappable = bool(in_program)

    @staticmethod
    def draws_in_program(observation: Observation) -> bool:
        """Whether the observation's defense can draw inside one batched program."""
        defense = observation.defense
        return (is_gradient_only(defense) and observation.one_step
                and bool(getattr(defense, "vmap_draws", False)))

    def client_gradients(self, replica: ClientReplica, x: Tensor, y: Tensor, *, functional: bool,
                         context: SimContext) -> Tuple[List[Tensor], Dict[str, Any]]:
        obs = replica.observation
        if is_gradient_only(obs.defense) and obs.one_step:
            clean, feats = super().client_gradients(replica, x, y, functional=functional, context=context)
            if functional and self.vmappable:
                draws = [list(obs.defense.transform(list(clean), generator=VMAP_DRAWS, model=obs.model))
                         for _ in range(self.samples)]
                return [torch.stack(layer) for layer in zip(*draws)], feats
            transform = DefenseTransform(obs.defense)
            draws = [transform(clean, context) for _ in range(self.samples)]
        else:
            client = defended_client(obs.defense)
            batched = getattr(client, "batched_draws", None)
            stacked = None if batched is None else batched(replica, x.unsqueeze(0), y, self.samples, context)
            if stacked is not None:
                return [g[0] for g in stacked], {}
            draws, feats = [], {}
            for _ in range(self.samples):
                grads, feats = client(replica, x, y, functional=functional, context=context)
                draws.append(grads)
        return [torch.stack(layer) for layer in zip(*draws)], feats

    def many_members(self, replica: ClientReplica, xs: Tensor, ys: Tensor,
                     context: SimContext) -> Tuple[List[Tensor], Dict[str, Tensor]]:
        """``samples`` defended gradients of every member's dummy batch from one batched call of
        the defense callable, per parameter ``(M, samples, *shape)``."""
        return DefenseSimulator().many_members(replica, xs, ys, context, draws=self.samples)

    def cannot_stack(self, observation: Observation) -> Optional[Reason]:
        if is_gradient_only(observation.defense):
            return Reason("draws-from-generator")  # no Defense.vmap_draws: its draws run member by member
        return None

    def gradient_evaluations(self, observation: Observation) -> int:
        if is_gradient_only(observation.defense) and observation.one_step:
            return 1  # one clean gradient, the transform sampled on it
        return self.samples * super().gradient_evaluations(observation)

    def describe(self) -> str:
        return f"EOTSimulator(samples={self.samples}{', draws in program' if self.vmappable else ''})"


def _applicability(observation: Observation) -> Optional[Reason]:
    if observation.defense is None:
        return Reason("needs-white-box-defense")
    if not observation.one_step and not is_gradient_only(observation.defense):
        return Reason("defense-gradient-one-step", defense=observation.defense.name, steps=observation.local_steps)
    return None


class ThroughDefense(AdaptedAttack):
    """Replay (``samples=1``, deterministic defenses) or EOT over the defense's randomness.
    ``samples="auto"``: 1 for a deterministic defense, :attr:`EOT_SAMPLES` otherwise."""

    name = "through-defense"
    owns = ("simulator",)
    EOT_SAMPLES = EOT_SAMPLES  # the planner's number (adaptive.planner.rules)

    def __init__(self, samples="auto", base: str = "ig", **knobs):
        super().__init__(base, **knobs)
        if samples != "auto" and (not isinstance(samples, int) or samples < 1):
            raise ConfigError(f"through-defense: samples must be 'auto' or an integer >= 1, got {samples!r}")
        self.samples = samples

    def adapt(self, observation: Observation) -> Adaptation:
        why_not = _applicability(observation)
        if why_not:
            return Adaptation(skip=why_not)
        defense = observation.defense
        samples = self.samples
        if samples == "auto":
            samples = self.EOT_SAMPLES if getattr(defense, "stochastic", True) else 1
        gradient_only = is_gradient_only(defense)
        notes = {"defense": getattr(defense, "name", "defense"), "samples": samples,
                 "mode": "replay" if samples == 1 else f"EOT over {samples} draws per evaluation",
                 "path": "defense.transform applied to each local step's gradient" if gradient_only
                 else "defense callable run on the dummy data"}
        if gradient_only and samples > 1 and observation.one_step:
            notes["path"] = "clean gradient once, defense.transform sampled"
        if samples == 1:
            return Adaptation({"simulator": defended_client(defense)}, notes)
        objective = self.settings["objective"]
        if isinstance(objective, str):
            args = {k: self.settings[k] for k in ("sigma", "b", "weights", "masks") if self.settings[k] is not None}
            objective = OBJECTIVES.build(objective, **args)
        in_program = EOTSimulator.draws_in_program(observation)
        notes["draws"] = ("in the batched program (one vmap over images x restarts x draws)" if in_program else
                          "one member after another: the defense draws from a generator outside the program")
        knobs = {"simulator": EOTSimulator(samples, in_program), "objective": StackedMean(objective, "eot-mean"),
                 "sigma": None, "b": None, "weights": None, "masks": None}
        return Adaptation(knobs, notes)


register(ThroughDefense, "match through the defense: replay (deterministic) or EOT over its randomness (stochastic)")
