"""The approximate Bayes-optimal adversary (Bayes paper, Eq. 3 and Algorithm 1).

It maximises ``(1/k) sum_i [log p(g | x_i) + beta log p(x_i)]`` with ``x_i`` uniform in the
delta-ball around the current reconstruction, with Adam. Built entirely from the attack
optimisation attack's pieces: an :class:`~attacks.optimization.OptimizationAttack` whose

* objective is the defense's likelihood: ``defense.log_prob`` when the defense declares
  it (exact; soft-prune's mixture, additive noise), otherwise a Monte Carlo kernel
  estimate over ``mc_draws`` runs of the defense on the dummy data
  (:mod:`adaptive.bayes.likelihood`), or any named objective given explicitly;
* prior ``log p(x)`` is TV by default (or any prior; exact ones in :mod:`adaptive.bayes.priors`);
* simulator is the :class:`~adaptive.bayes.simulator.BallSimulator` around the clean
  (or, for the Monte Carlo likelihood, the defended) gradient when ``k > 1``,
  ``delta > 0`` or several defense draws are needed; with ``k = 1, delta = 0`` and an
  exact likelihood it is the plain optimisation attack (the Bayes paper's released setting).

The likelihood is chosen per observation (``likelihood="auto"``), so one attack object
serves every defense; the choice is recorded in ``trace["likelihood"]``.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from attacks.optimization import OptimizationAttack, Progress, not_grouped, ungroupable
from attacks.objectives import OBJECTIVES, L2Distance, Objective, ScaledDistance, StackedMean, build_objective
from attacks.optimizers import OPTIMIZERS
from attacks.presets import ATTACKS
from attacks.simulator import DefenseSimulator, GradientSimulator
from audit.core.reasons import Reason
from audit.core.errors import ConfigError, NotApplicable
from audit.core.types import Observation, Reconstruction
from priors import PRIORS

from adaptive.bayes.likelihood import MonteCarloLikelihood
from adaptive.bayes.priors import BallAveragedPrior
from adaptive.bayes.scale import draw_information, fisher_information
from adaptive.bayes.simulator import BallSimulator

LIKELIHOODS = ("auto", "defense", "monte-carlo")
#: the seed of the random batch the prior weight is probed on (:meth:`BayesOptimalAttack.prior_scale`)
PROBE_SEED = 0


class BayesOptimalAttack:
    """``reconstruct(observation, budget, seed)`` with the likelihood picked for the observation.

    ``likelihood``: ``auto`` (``defense.log_prob`` if declared, else Monte Carlo; L2 without
    a defense), ``defense``, ``monte-carlo``, or an objective name / object (``gaussian`` with
    ``sigma``, ``laplacian`` with ``b``, ``l2`` ...). ``prior``: a :data:`priors.PRIORS` name,
    a prior object / callable, or ``None`` (uniform); ``beta`` its weight, or (``beta=None``)
    ``prior_weight`` in units of the likelihood's Fisher information (see
    :mod:`adaptive.bayes.scale`; for Gaussian noise the TV weight of ``bayes-l2``). The optimiser
    defaults match the ``bayes-l2`` preset (Adam 0.1, exponential decay, 200 iterations,
    U(0, 1) init, [0, 1] box) so the two compare at the same budget.
    """

    name = "bayes-optimal"

    def __init__(
        self,
        *,
        likelihood: Union[str, Objective, Callable] = "auto",
        sigma: Optional[float] = None,
        b: Optional[float] = None,
        k: int = 1,
        delta: float = 0.0,
        mc_draws: int = 4,
        bandwidth_floor: float = 0.05,
        prior: Any = "tv",
        beta: Optional[float] = None,
        prior_weight: float = 1.0,
        init: str = "uniform",
        box: str = "clamp",
        lr: float = 0.1,
        schedule: str = "exp",
        iterations: int = 200,
        restarts: int = 1,
        labels: str = "infer",
        execution: str = "auto",
    ):
        if isinstance(likelihood, str) and likelihood not in LIKELIHOODS and likelihood not in OBJECTIVES:
            raise ConfigError(f"bayes-optimal: unknown likelihood {likelihood!r}; valid: "
                              f"{', '.join(LIKELIHOODS + tuple(OBJECTIVES.names()))}")
        if k < 1 or delta < 0:
            raise ConfigError(f"bayes-optimal: k must be >= 1 and delta >= 0, got k={k}, delta={delta}")
        if mc_draws < 2:
            raise ConfigError(f"bayes-optimal: mc_draws must be >= 2 (the kernel bandwidth is their "
                              f"spread), got {mc_draws}")
        if (beta is not None and beta < 0) or prior_weight < 0:
            raise ConfigError(f"bayes-optimal: beta and prior_weight must be >= 0, got {beta}, {prior_weight}")
        self.likelihood, self.sigma, self.b = likelihood, sigma, b
        self.k, self.delta, self.mc_draws, self.bandwidth_floor = int(k), float(delta), int(mc_draws), bandwidth_floor
        self.prior, self.prior_weight = prior, float(prior_weight)
        self.beta = None if beta is None else float(beta)
        self.init, self.box, self.lr, self.schedule = init, box, float(lr), schedule
        self.iterations, self.restarts, self.labels, self.execution = int(iterations), int(restarts), labels, execution
        self.optimizer = OPTIMIZERS.build("adam", lr=self.lr, schedule=schedule)
        MonteCarloLikelihood(bandwidth_floor)  # validates the floor now, not at the first observation

    # ------------------------------------------------------------------ composition
    def resolve_likelihood(self, observation: Observation
                           ) -> Tuple[str, Dict[str, Any], Objective, GradientSimulator, int]:
        """``(kind, description, objective, inner simulator, draws per ball point)`` for this
        observation; ``kind`` is ``defense``, ``monte-carlo`` or the objective's name."""
        choice = self.likelihood
        defense = observation.defense
        if choice == "auto":
            if defense is None:
                choice = "l2"
            elif getattr(defense, "log_prob", None) is not None and observation.one_step:
                choice = "defense"
            else:
                choice = "monte-carlo"
        if choice == "monte-carlo":
            if defense is None:
                raise NotApplicable(Reason("bayes-monte-carlo-needs-defense"))
            return ("monte-carlo",
                    Reason("likelihood-monte-carlo", draws=self.mc_draws, defense=defense.name).to_dict(),
                    MonteCarloLikelihood(self.bandwidth_floor), DefenseSimulator(), self.mc_draws)
        if choice == "defense":
            return ("defense", Reason("likelihood-exact", defense=getattr(defense, "name", "defense")).to_dict(),
                    build_objective("defense"), GradientSimulator(), 1)
        objective = self._named_objective(choice)
        return str(choice), Reason("likelihood-given", objective=repr(objective)).to_dict(), objective, \
            GradientSimulator(), 1

    def _named_objective(self, choice) -> Objective:
        if not isinstance(choice, str):
            return build_objective(choice)
        settings = {k: v for k, v in (("sigma", self.sigma), ("b", self.b)) if v is not None}
        return build_objective(choice, **settings)

    def prior_scale(self, observation: Observation, kind: str, objective: Objective,
                    seed: int = PROBE_SEED) -> Tuple[float, Dict[str, Any]]:
        """``(beta, how it was set)``: the given ``beta``, else ``prior_weight`` times half the
        likelihood's per-coordinate Fisher information (:mod:`adaptive.bayes.scale`), probed on a
        random batch drawn from ``seed``: a property of the defense at the model, the same for
        every private image, so a step's images share one attack."""
        if self.beta is not None:
            return self.beta, Reason("beta-given").to_dict()
        if kind == "defense":
            info = fisher_information(observation, seed)
        elif kind == "monte-carlo":
            info = draw_information(observation, seed, self.bandwidth_floor)
        elif isinstance(objective, ScaledDistance):  # gaussian(sigma): 0.5/sigma^2, laplacian(b): 1/b
            info = 2 * objective.scale if isinstance(objective.distance, L2Distance) else objective.scale ** 2
        else:
            return self.prior_weight, Reason("beta-no-likelihood", weight=self.prior_weight).to_dict()
        beta = self.prior_weight * info / 2
        return beta, Reason("beta-fisher", weight=self.prior_weight, information=float(info)).to_dict()

    def _prior(self):
        if self.prior is None or self.prior == "uniform":
            return None
        prior = PRIORS.build(self.prior) if isinstance(self.prior, str) else self.prior
        if not callable(prior):
            raise ConfigError(f"bayes-optimal: prior must be one of {PRIORS.names()}, a callable "
                              f"prior(x, context) or None, got {type(prior).__name__}")
        return prior

    def compose(self, observation: Observation) -> Tuple[OptimizationAttack, Dict[str, Any]]:
        """The optimisation attack that runs this adversary on ``observation`` (and on every
        observation of the same model and defense), and what it chose (likelihood, prior weight)."""
        kind, description, objective, inner, draws = self.resolve_likelihood(observation)
        prior = self._prior()
        beta, beta_source = (0.0, Reason("beta-no-prior").to_dict()) if prior is None else \
            self.prior_scale(observation, kind, objective)
        simulator: GradientSimulator = inner
        if self.k > 1 or self.delta > 0 or draws > 1:
            simulator = BallSimulator(inner, k=self.k, delta=self.delta, draws=draws)
            if not isinstance(objective, MonteCarloLikelihood):
                objective = StackedMean(objective, "ball-mean", dims=2)
            prior = BallAveragedPrior(prior) if prior is not None else None
        chosen = {"likelihood": description, "beta": beta, "beta_source": beta_source}
        attack = OptimizationAttack(
            objective, [] if prior is None else [(prior, beta)], init=self.init, box=self.box,
            optimizer=self.optimizer, iterations=self.iterations, restarts=self.restarts,
            label_strategy=self.labels, simulator=simulator, execution=self.execution, name=self.name,
            settings={**chosen, "k": self.k, "delta": self.delta},
        )
        return attack, chosen

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Progress] = None) -> Reconstruction:
        """Run the adversary; ``budget`` overrides the number of Adam iterations."""
        attack, chosen = self.compose(observation)
        rec = attack.reconstruct(observation, budget, seed, progress)
        rec.trace.update(chosen)
        return rec

    def reconstruct_many(self, observations: Sequence[Observation], budget: Optional[int] = None,
                         seeds: Optional[Sequence[int]] = None, progress: Optional[Progress] = None,
                         max_members: int = 64) -> List[Reconstruction]:
        """:meth:`reconstruct` for observations of one model as one grouped run (the likelihood
        and prior weight are the defense's, the same for each; see :meth:`prior_scale`)."""
        observations = list(observations)
        why = ungroupable(observations) if len(observations) > 1 else None
        if why:
            out = [self.reconstruct(o, budget, s, progress)
                   for o, s in zip(observations, seeds or [0] * len(observations))]
            for rec in out:
                rec.trace["grouped"] = not_grouped(why)
            return out
        attack, chosen = self.compose(observations[0])
        out = attack.reconstruct_many(observations, budget, seeds, progress, max_members=max_members)
        for rec in out:
            rec.trace.update(chosen)
        return out

    def describe(self) -> Dict[str, Any]:
        return {"likelihood": repr(self.likelihood), "k": self.k, "delta": self.delta, "mc_draws": self.mc_draws,
                "prior": repr(self.prior), "beta": self.beta, "prior_weight": self.prior_weight,
                "lr": self.lr, "schedule": self.schedule,
                "iterations": self.iterations, "restarts": self.restarts, "init": self.init, "box": self.box}


def applies(traits) -> Tuple[bool, Reason]:
    """Whether the planner should offer ``bayes-optimal`` for a probed defense
    (:class:`adaptive.planner.traits.DefenseTraits`), and why (a code)."""
    if traits.has_log_prob:
        return True, Reason("bayes-exact-likelihood")
    if traits.architectural:
        return False, Reason("bayes-architectural")
    if not traits.stochastic:
        return False, Reason("bayes-deterministic")
    if not traits.differentiable:
        return False, Reason("bayes-not-differentiable")
    return True, Reason("bayes-monte-carlo")


ATTACKS.add("bayes-optimal", BayesOptimalAttack,
            "Bayes-optimal adversary: defense log-likelihood (exact or Monte Carlo) + TV prior over a delta-ball")
