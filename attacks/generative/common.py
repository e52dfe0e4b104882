"""Pieces shared by the generative-prior attacks (GGL, GIAS, GIFD).

* the attacker's generator comes from :func:`generators.resolve_generator` (given, loaded
  from a checkpoint / ``module:attr`` factory, or the default DCGAN trained on the embedded
  *train* split) and is conditioned by :func:`generators.condition_labels`;
* :func:`select_simulator` -- what turns a dummy image into a shared gradient: by default
  the observation's defense itself (white-box, adaptive), else the clean gradient;
* :class:`GenerativeSetup` -- everything one ``reconstruct`` call needs (labels, the labels
  the generator is conditioned on, the scorer), built once from the observation;
* :class:`Scorer` -- dummy images ``(R, B, C, H, W)`` -> per-restart attack loss, batched
  over restarts with ``torch.func.vmap`` when the simulator allows it;
* :func:`latent_kl`, :func:`adam_search` -- GGL's latent prior and the Adam loop of GIAS / GIFD.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.errors import ConfigError, GiaError
from audit.core.reasons import Reason, path_failed
from audit.core.types import Observation, Reconstruction
from generators import CONDITIONS, ImageGenerator, condition_labels, generate, generator_info, resolve_generator
from generators.resolve import GeneratorSpec
from priors import PRIORS, PriorContext, requiring, weighted_total

from attacks.optimization import seeded_rng, validate_observation
from attacks.labels import LABEL_STRATEGIES, plan_labels
from attacks.objectives import build_objective
from attacks.simulator import SIMULATORS, DefenseSimulator, GradientSimulator, SimContext

Progress = Callable[[int, int, float], None]  # (done, total, best loss so far)


def latent_kl(z: Tensor) -> Tensor:
    """GGL's latent prior: KL(N(mean z, var z) || N(0, 1)) of each latent, summed over the
    batch; ``z`` is ``(..., B, L)``, the result ``(...)``."""
    mean, var = z.mean(-1), z.var(-1, unbiased=False)
    return (-0.5 * (1 + torch.log(var + 1e-10) - mean.pow(2) - var)).sum(-1)


# --------------------------------------------------------------------------- the matching loss
def select_simulator(spec: Any, observation: Observation) -> Tuple[GradientSimulator, str]:
    """``auto``: the observation's defense runs on the dummy data (adaptive) when there is one
    and a single local step, else the clean gradient (FedAvg unrolled); or a
    :data:`~attacks.simulator.SIMULATORS` name / object."""
    if isinstance(spec, GradientSimulator):
        return spec, "given"
    if spec != "auto":
        return SIMULATORS.build(spec), f"requested {spec!r}"
    if observation.defense is None:
        return GradientSimulator(), "no defense: clean gradient"
    if not observation.one_step:
        return GradientSimulator(), (f"clean gradient: the defense simulator runs one step, the observation "
                                     f"has {observation.local_steps} local steps")
    return DefenseSimulator(), "the dummy gradient goes through the observation's defense"


class Scorer:
    """``images (R, B, C, H, W) -> (total (R,), terms {name: (R,)})`` where total is the
    gradient-matching objective plus the weighted image priors of each restart."""

    def __init__(self, observation: Observation, objective, priors: Sequence[Tuple[str, Any, float]],
                 simulator: GradientSimulator, labels: Tensor, rng: torch.Generator):
        self.obs = observation
        self.objective = objective.bind(observation)
        self.priors = list(priors)
        self.simulator = simulator
        self.replica = simulator.prepare(observation)
        self.labels = labels
        self.target = [g.detach() for g in observation.gradients]
        self.context = SimContext(observation, generator=rng, capture_features=bool(requiring(self.priors, "bn_stats")))
        self.batched = simulator.batchable
        self.execution = Reason("run-batched-candidates") if self.batched else \
            Reason("run-sequential", why=Reason("not-vmappable", simulator=simulator.describe()).to_dict())
        self.evaluations = 0

    def terms(self, x: Tensor, functional: bool) -> Dict[str, Tensor]:
        grads, feats = self.simulator(self.replica, x, self.labels, functional=functional, context=self.context)
        out = {"match": self.objective(grads, self.target)}
        ctx = PriorContext(0, feats, self.replica.bn_running, None, self.obs)
        for key, prior, _ in self.priors:
            out[key] = prior(x, ctx)
        return out

    def __call__(self, images: Tensor) -> Tuple[Tensor, Dict[str, Tensor]]:
        self.evaluations += images.shape[0]
        with torch.enable_grad():  # the simulated client differentiates its loss, also under no_grad
            terms = self._terms(images)
        return weighted_total(terms, self.priors), terms

    def _terms(self, images: Tensor) -> Dict[str, Tensor]:
        if self.batched:
            try:
                return torch.func.vmap(lambda x: self.terms(x, True), randomness="different")(images)
            except GiaError:
                raise
            except Exception as err:  # not vmappable after all: sequential from now on
                self.batched = False
                self.execution = Reason("run-sequential", why=path_failed("vmap", err))
        per = [self.terms(x, False) for x in images]
        return {k: torch.stack([torch.as_tensor(t[k], device=images.device) for t in per]) for k in per[0]}


def build_priors(weights: Dict[str, float]) -> List[Tuple[str, Any, float]]:
    """``[(name, prior, weight)]`` for the non-zero weights, priors from :data:`priors.PRIORS`."""
    return [(name, PRIORS.build(name), float(w)) for name, w in weights.items() if w]


@dataclass
class GenerativeSetup:
    """The per-run state every generative attack builds first (see :meth:`build`)."""

    observation: Observation
    generator: ImageGenerator
    rng: torch.Generator
    labels: Tensor
    cond: Optional[Tensor]
    scorer: Scorer
    info: Dict[str, Any] = field(default_factory=dict)
    progress: Optional[Progress] = None
    budget: int = 0
    done: int = 0

    def tick(self, steps: int, loss: float) -> None:
        """Report ``steps`` more units of work (iterations / evaluations) to ``progress``."""
        self.done += steps
        if self.progress is not None:
            self.progress(min(self.done, self.budget), self.budget, loss)

    @classmethod
    def build(cls, attack: "GenerativeAttack", observation: Observation, seed: int,
              progress: Optional[Progress] = None) -> "GenerativeSetup":
        """The run's state; with a ``progress`` callback (the audit's, or the CLI's) the default
        generator is trained, if not cached yet, without a bar of its own."""
        validate_observation(observation)
        device = observation.device
        gen = resolve_generator(attack.generator, attack.generator_factory, observation.input_shape, device,
                                progress=progress is None)
        rng = torch.Generator(device=device).manual_seed(int(seed))
        plan = plan_labels(attack.labels, observation, seed)
        cond, cond_note = condition_labels(gen, plan.fixed, observation.num_classes, attack.condition, rng)
        simulator, sim_note = select_simulator(attack.simulator, observation)
        objective = build_objective(attack.objective)
        scorer = Scorer(observation, objective, build_priors(attack.prior_weights), simulator, plan.fixed, rng)
        info = {"generator": generator_info(gen), "labels": plan.info, "conditioning": cond_note,
                "simulator": f"{simulator.describe()} ({sim_note})", "objective": repr(scorer.objective)}
        return cls(observation, gen, rng, plan.fixed, cond, scorer, info)

    def sample_latents(self, restarts: int) -> Tensor:
        return torch.randn(restarts, self.observation.batch_size, self.generator.latent_dim,
                           generator=self.rng, device=self.observation.device)

    def result(self, images: Tensor, trace: Dict[str, Any], start: float) -> Reconstruction:
        trace = {**trace, **self.info, "execution": self.scorer.execution.to_dict(),
                 "evaluations": self.scorer.evaluations, "time_s": time.perf_counter() - start,
                 "selection": Reason("lowest-attack-loss").to_dict()}
        return Reconstruction(images.detach().clamp(0, 1), self.labels.clone(), trace)


class GenerativeAttack:
    """Settings shared by GGL, GIAS and GIFD (subclasses add their own and ``run``)."""

    name = "generative"

    def __init__(self, *, generator: GeneratorSpec = None, generator_factory: Optional[str] = None,
                 objective: str = "l2", labels: str = "infer", condition: str = "auto",
                 simulator: Any = "auto", tv: float = 0.0):
        if labels not in LABEL_STRATEGIES or labels == "optimize":
            valid = [s for s in LABEL_STRATEGIES if s != "optimize"]
            raise ConfigError(f"{self.name}: labels must be one of {valid} (generative attacks condition on "
                              f"fixed labels), got {labels!r}")
        if condition not in CONDITIONS:
            raise ConfigError(f"{self.name}: condition must be one of {CONDITIONS}, got {condition!r}")
        self.generator, self.generator_factory = generator, generator_factory
        self.objective, self.labels, self.condition = objective, labels, condition
        self.simulator = simulator
        self.prior_weights = {"tv": float(tv)}

    def settings(self) -> Dict[str, Any]:
        """The attack's settings, for traces and reports."""
        return {k: (v if isinstance(v, (int, float, str, bool, type(None), tuple, list)) else type(v).__name__)
                for k, v in vars(self).items() if not k.startswith("_")}

    def candidates_per_step(self) -> float:
        """Candidate images scored per unit of the attack's own work (its ``budget`` setting:
        evaluations for GGL, Adam steps for GIAS / GIFD); each costs the simulator's gradients."""
        return 1.0

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Progress] = None) -> Reconstruction:
        """Reconstruct the private batch. ``budget``: gradient evaluations of the model (see
        :data:`audit.core.types.BUDGET_DEFINITION`), mapped to the attack's own steps; None runs
        its own ``budget`` setting. ``progress(done, total, loss)`` is called as the work goes on."""
        if budget is not None and (isinstance(budget, bool) or int(budget) < 1):
            raise ConfigError(f"{self.name}: budget must be >= 1 gradient evaluations, got {budget}")
        start = time.perf_counter()
        with seeded_rng(observation.device, seed):
            setup = GenerativeSetup.build(self, observation, seed, progress)
            cost = self.candidates_per_step() * setup.scorer.simulator.gradient_evaluations(observation)
            steps = self.budget if budget is None else max(1, int(int(budget) // cost))
            setup.progress, setup.budget = progress, steps
            images, trace = self.run(setup, steps)
        return setup.result(images, {"attack": self.name, "settings": self.settings(), "budget": steps,
                                     "gradient_evaluations": int(round(steps * cost)), **trace}, start)

    def run(self, setup: GenerativeSetup, budget: int) -> Tuple[Tensor, Dict[str, Any]]:
        raise TypeError(f"{type(self).__name__} must implement run(setup, budget)")


# --------------------------------------------------------------------------- gradient-based search
def adam_search(variables: List[Tensor], loss_fn: Callable[[List[Tensor]], Tensor], iterations: int,
                lrs: Sequence[float], project: Optional[Callable[[List[Tensor]], None]] = None,
                on_step: Optional[Callable[[int, float], None]] = None,
                ) -> Tuple[List[Tensor], Tensor, List[List[float]]]:
    """Minimise ``loss_fn(variables) -> (R,)`` (independent restarts) with Adam, one learning
    rate per variable; ``project`` is applied in place after each step; ``on_step(1, best
    loss)`` after each step. Returns the best iterate of every restart, its loss, and the
    loss history (restart-major)."""
    leaves = [v.detach().clone().requires_grad_(True) for v in variables]
    opt = torch.optim.Adam([{"params": [v], "lr": lr} for v, lr in zip(leaves, lrs)])
    best = [v.detach().clone() for v in leaves]
    best_loss = None
    history = []
    for _ in range(iterations):
        loss = loss_fn(leaves)
        finite = torch.nan_to_num(loss.detach(), nan=float("inf"))
        improved = finite < best_loss if best_loss is not None else torch.ones_like(finite, dtype=torch.bool)
        best_loss = finite if best_loss is None else torch.minimum(best_loss, finite)
        for b, v in zip(best, leaves):
            b.copy_(torch.where(improved.view(-1, *[1] * (v.dim() - 1)), v.detach(), b))
        history.append(finite.tolist())
        opt.zero_grad(set_to_none=True)
        loss.sum().backward()
        opt.step()
        if project is not None:
            with torch.no_grad():
                project(leaves)
        if on_step is not None:
            on_step(1, float(best_loss.min()))
    final = torch.nan_to_num(loss_fn(leaves).detach(), nan=float("inf")) if iterations else None
    if final is not None:
        improved = final < best_loss
        best_loss = torch.minimum(best_loss, final)
        for b, v in zip(best, leaves):
            b.copy_(torch.where(improved.view(-1, *[1] * (v.dim() - 1)), v.detach(), b))
    if best_loss is None:
        best_loss = torch.nan_to_num(loss_fn(leaves).detach(), nan=float("inf"))
    return best, best_loss, [list(h) for h in zip(*history)]


def search_latents(setup: GenerativeSetup, steps: int, restarts: int, lr: float, kl: float = 0.0,
                   keep_all: bool = False) -> Tuple[Tensor, Dict[str, Any]]:
    """Adam over ``restarts`` batched latents (loss: attack loss + ``kl`` * KL(z)); returns the
    best restart ``(1, B, L)`` (every restart ``(R, B, L)`` with ``keep_all``) and a trace."""
    gen, cond = setup.generator, setup.cond

    def loss_fn(variables):
        loss, _ = setup.scorer(generate(gen, variables[0], cond))
        return loss + kl * latent_kl(variables[0]) if kl else loss

    best, best_loss, history = adam_search([setup.sample_latents(restarts)], loss_fn, steps, [lr],
                                           on_step=setup.tick)
    chosen = int(torch.argmin(best_loss))
    z = best[0] if keep_all else best[0][chosen:chosen + 1]
    return z, {"iterations": steps, "restarts": restarts, "chosen_restart": chosen,
               "final_losses": best_loss.tolist(), "loss_history": history}
