"""The composable optimisation attack: objective + priors + initialisation + box +
optimiser + restarts, all restarts run as one batched computation.

Per restart ``r`` the attack minimises::

    objective(simulator(image(z_r), labels_r), observation.gradients) + sum_k w_k prior_k(image(z_r))

Batched execution: the per-restart function (simulator with ``torch.func.grad`` inside,
objective, priors) is ``torch.func.vmap``-ed over the restart dimension and the gradient
w.r.t. all restarts' variables is one ``torch.autograd`` backward pass. Sequential
execution loops over restarts with ``torch.autograd`` only; it is chosen automatically
when the simulator says it cannot be vmapped or when the first batched evaluation fails
(the reason is logged in ``trace["execution"]``). The best restart is the one with the
lowest final attack loss (objective + priors): the ground truth is never looked at.

BatchNorm: the observation declares ``client_mode``; the simulator runs a private copy of
the model in that mode (train: batch statistics, running buffers dropped on the copy),
so the observation's model is never mutated.
"""
from __future__ import annotations

import contextlib
import copy
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from audit.core.reasons import Reason, path_failed
from audit.core.errors import ConfigError, GiaError, NotApplicable
from audit.core.types import Observation, Reconstruction, iterations_for, parameter_names, trainable_parameters
from priors import PRIORS, Prior, PriorContext, classifier_head, requiring, weighted_total
from priors.features import FIXED_POINT_TOLERANCE, observed_reading

from attacks import capture as capturing
from attacks import stacking
from attacks.kernel_cache import compiled as kernel_compiled
from attacks.labels import LABEL_STRATEGIES, LabelPlan, plan_labels
from attacks.feature_rule import AutoFeatures, dummy_softmax_weight, observed_features_off
from attacks.objectives import GradientDistance, Objective, build_objective
from attacks.optimizers import OPTIMIZERS
from attacks.search_space import BOXES, INITS, Box
from attacks.local_surrogate import replica_note
from attacks.side_information import check_weight, revealed_for_member, side_information
from attacks.simulator import GradientSimulator, SimContext
from attacks.budget_rule import LONG, long_share
from attacks.tv_rule import ObservedWeight

Progress = Callable[[int, int, float], None]
EXECUTIONS = ("auto", "batched", "sequential")


def validate_observation(observation: Observation) -> None:
    """Raise a :class:`ConfigError` naming the fix when an observation is inconsistent."""
    params = trainable_parameters(observation.model)
    grads = observation.gradients
    if len(grads) != len(params):
        raise ConfigError(f"observation has {len(grads)} gradient tensors for {len(params)} trainable "
                          "parameters of its model; share one tensor per parameter")
    for i, (g, p) in enumerate(zip(grads, params)):
        if tuple(g.shape) != tuple(p.shape):
            raise ConfigError(f"observation gradient {i} has shape {tuple(g.shape)}, parameter {tuple(p.shape)}")
        if g.device != p.device:
            raise ConfigError(f"observation gradient {i} is on {g.device}, the model on {p.device}; "
                              "move both to one device")
    if len(observation.input_shape) != 3 or observation.batch_size < 1:
        raise ConfigError(f"observation input_shape must be (C, H, W) and batch_size >= 1, got "
                          f"{observation.input_shape}, {observation.batch_size}")
    if observation.labels is not None and tuple(observation.labels.shape) != (observation.batch_size,):
        raise ConfigError(f"observation labels must have shape ({observation.batch_size},)")


@contextlib.contextmanager
def seeded_rng(device: torch.device, seed: int):
    """Seed torch's global RNG for the block (vmap randomness) without leaking the state."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(seed))
        yield


def ungroupable(observations: Sequence[Observation]) -> Optional[Reason]:
    """Why these observations cannot share one batched run (None when they can): they must
    come from the same model (same parameters and buffers) with the same metadata."""
    first = observations[0]
    same = ("input_shape", "num_classes", "batch_size", "local_steps", "local_lr", "local_batch_size",
            "client_mode", "loss_fn", "defense", "labels_shared", "optimizer", "shares")
    for o in observations[1:]:
        for name in same:
            if getattr(o, name) != getattr(first, name):
                return Reason("observations-differ", field=name)
        if o.model is not first.model:
            a, b = first.model.state_dict(), o.model.state_dict()
            if a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a):
                return Reason("observations-different-models")
    return None


def not_grouped(why: Reason) -> Dict[str, Any]:
    """A trace's ``grouped`` entry for a run made alone, with why (a code the report words)."""
    return Reason("not-grouped", why=why.to_dict()).to_dict()


def _build_prior(spec) -> Prior:
    if isinstance(spec, str):
        return PRIORS.build(spec)
    if callable(spec):
        return spec
    raise ConfigError(f"a prior must be one of {PRIORS.names()} or a callable prior(x, context)")


@contextlib.contextmanager
def flushed_denormals():
    """Flush subnormal floats to zero on the CPU for the block, restoring the previous mode."""
    probe = torch.tensor([1e-40])
    was_on = bool((probe * 1.0) == 0)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was_on)


class OptimizationAttack:
    """An optimisation-based gradient inversion attack (see the module docstring).

    ``priors`` is a list of ``(prior, weight)`` (prior: a :data:`priors.PRIORS` name or a
    callable ``prior(x, context)``); ``init`` / ``box`` / ``optimizer`` are registry names
    or objects; ``label_strategy`` is ``infer`` / ``shared`` / ``optimize`` / a label method;
    ``execution`` is ``auto`` / ``batched`` / ``sequential``; ``capture`` is ``auto`` / ``on`` /
    ``off`` / a route of :data:`attacks.capture.ROUTES` (the whole iteration as one program).
    """

    def __init__(
        self,
        objective: Union[str, Objective, Callable] = "cosine",
        priors: Sequence[Tuple[Any, float]] = (),
        *,
        init: Union[str, Callable] = "uniform",
        box: Union[str, Box] = "clamp",
        optimizer: Any = "adam",
        iterations: int = 1000,
        restarts: int = 1,
        label_strategy: str = "infer",
        simulator: Optional[GradientSimulator] = None,
        execution: str = "auto",
        name: str = "optimization",
        settings: Optional[Dict[str, Any]] = None,
        keep_best_after: float = 0.0,
        per_restart: Union[int, str] = 0,
        compile: bool = False,
        capture: str = "auto",
        bn_upload: Union[str, float] = "auto",
    ):
        if not (per_restart == "unknowns" or (isinstance(per_restart, int) and per_restart >= 0)):
            raise ConfigError(f"per_restart must be 'unknowns' or an int >= 0 (0: off), got {per_restart!r}")
        if restarts < 1 or iterations < 0:
            raise ConfigError(f"restarts must be >= 1 and iterations >= 0, got {restarts}, {iterations}")
        if not 0.0 <= keep_best_after < 1.0:
            raise ConfigError(f"keep_best_after must be in [0, 1) (a fraction of the budget), got {keep_best_after}")
        if execution not in EXECUTIONS:
            raise ConfigError(f"execution must be one of {EXECUTIONS}, got {execution!r}")
        if isinstance(capture, bool):  # the command line reads on / off as booleans
            capture = "on" if capture else "off"
        if capture not in capturing.SETTINGS and capture not in capturing.ROUTES:
            raise ConfigError(f"capture must be one of {capturing.SETTINGS} or a route "
                              f"({', '.join(capturing.ROUTES.names())}), got {capture!r}")
        if label_strategy not in LABEL_STRATEGIES:
            raise ConfigError(f"unknown label strategy {label_strategy!r}; valid: {', '.join(LABEL_STRATEGIES)}")
        self.objective = build_objective(objective)
        self.priors: List[Tuple[str, Prior, float]] = []
        for spec, weight in priors:
            prior = _build_prior(spec)
            key = getattr(prior, "name", "prior")
            while key == "match" or any(key == k for k, _, _ in self.priors):
                key += "'"
            # a weight the observation decides (tv="auto") is resolved when the attack runs
            self.priors.append((key, prior, weight if isinstance(weight, ObservedWeight) else float(weight)))
        self.init = INITS.get(init) if isinstance(init, str) else init
        self.init_name = init if isinstance(init, str) else getattr(init, "__name__", "custom")
        self.box = BOXES.build(box) if isinstance(box, str) else box
        self.optimizer = OPTIMIZERS.build(optimizer) if isinstance(optimizer, str) else optimizer
        self.iterations, self.restarts = int(iterations), int(restarts)
        self.keep_best_after = float(keep_best_after) if restarts > 1 else 0.0
        self.per_restart = per_restart
        self.compile = bool(compile)
        self.capture = capture
        self.label_strategy = label_strategy
        self.simulator = simulator if simulator is not None else GradientSimulator()
        # weight of the uploaded-BatchNorm-statistics term (attacks.side_information)
        self.bn_upload = check_weight(bn_upload)
        self.execution = execution
        self.name = name
        self.settings = dict(settings or {})

    def describe(self) -> Dict[str, Any]:
        """The attack's composition, for traces and reports."""
        return {
            "objective": repr(self.objective),
            "priors": {k: w if isinstance(w, float) else repr(w) for k, _, w in self.priors},
            "init": self.init_name, "box": self.box.name,
            **self.optimizer.settings(),
            "iterations": self.iterations, "restarts": self.restarts,
            **({"keep_best_after": self.keep_best_after} if self.keep_best_after else {}),
            **({"per_restart": self.per_restart} if self.per_restart else {}),
            **({"compile": True} if self.compile else {}),
            **({"capture": self.capture} if self.capture != "auto" else {}),
            **({"bn_upload": self.bn_upload} if self.bn_upload != "auto" else {}),
            "labels": self.label_strategy, "simulator": self.simulator.describe(),
            **self.settings,
        }

    def planned_iterations(self, budget: Optional[int], cost: int) -> int:
        """Iterations that ``budget`` gradient evaluations buy at ``cost`` per iteration; with
        ``keep_best_after`` the iterations after the restart selection cost 1/restarts as much.
        None: the attack's own ``iterations``."""
        if budget is None:
            return self.iterations
        if not budget:
            return 0
        if not self.keep_best_after:
            return iterations_for(budget, cost)
        first = iterations_for(int(budget * self.keep_best_after), cost)
        rest = int(budget) - first * cost
        return first + (iterations_for(rest, max(1, cost // self.restarts)) if rest > 0 else 0)

    def afforded(self, observation: Observation,
                 budget: Optional[int]) -> Tuple["OptimizationAttack", Optional[Dict[str, Any]]]:
        """With ``per_restart`` set (gradient evaluations one restart needs to converge;
        ``"unknowns"``: one per unknown pixel value of the private batch), the restarts the
        budget affords (at least 1, at most ``restarts``): a restart cut short before it
        converges is wasted budget (32x32 DLG needs thousands of L-BFGS steps, 16x16 hundreds).
        Returns the attack to run and, when it ran fewer restarts, why."""
        if budget is None or not self.per_restart or self.restarts == 1:
            return self, None
        per = self.per_restart
        if per == "unknowns":
            per = observation.unknowns
        per *= self.simulator.gradient_evaluations(observation)
        fits = max(1, min(self.restarts, int(budget) // max(1, per)))
        if fits == self.restarts:
            return self, None
        cut = copy.copy(self)
        cut.restarts = fits
        cut.keep_best_after = self.keep_best_after if fits > 1 else 0.0
        return cut, Reason("restarts-afforded", fits=fits, restarts=self.restarts, budget=int(budget), per=per,
                           per_restart=self.per_restart).to_dict()

    def evaluation_cost(self, observation: Observation) -> int:
        """Gradient evaluations of the model per loss evaluation: restarts x the simulator's
        cost (EOT / Monte Carlo draws, FedAvg local steps)."""
        return self.restarts * self.simulator.gradient_evaluations(observation)

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Progress] = None) -> Reconstruction:
        """Run the attack. ``budget``: gradient evaluations of the model (see
        :data:`audit.core.types.BUDGET_DEFINITION`), mapped to iterations by
        :meth:`evaluation_cost`; None runs the preset's ``iterations``."""
        validate_observation(observation)
        if budget is not None and (isinstance(budget, bool) or int(budget) < 0):
            raise ConfigError(f"budget must be >= 0 gradient evaluations, got {budget}")
        attack, why = self.afforded(observation, budget)
        cost = attack.evaluation_cost(observation)
        iterations = attack.planned_iterations(budget, cost)
        evaluations = None if budget is None else max(int(budget), cost)
        with seeded_rng(observation.device, seed):
            run = OptimizationRun(attack, observation, int(seed), show_bars=progress is None, iterations=iterations)
            rec = run.execute(iterations, progress, max_evaluations=evaluations, cost=cost)[0]
        if why:
            rec.trace["restarts_afforded"] = why
        return rec

    def reconstruct_many(self, observations: Sequence[Observation], budget: Optional[int] = None,
                         seeds: Optional[Sequence[int]] = None, progress: Optional[Progress] = None,
                         max_members: int = 64) -> List[Reconstruction]:
        """:meth:`reconstruct` for several observations of the same model (e.g. every private
        batch of one audited step) as one batched computation: each observation keeps its own
        target gradient, labels, seed and budget; chunks of at most ``max_members``
        observations x restarts. Observations that cannot be grouped (another model or
        metadata) run one at a time, with the reason in their trace (``grouped``)."""
        observations = list(observations)
        seeds = list(seeds) if seeds is not None else [0] * len(observations)
        if len(seeds) != len(observations):
            raise ConfigError(f"reconstruct_many: {len(seeds)} seeds for {len(observations)} observations")
        for o in observations:
            validate_observation(o)
        attack, cut = self.afforded(observations[0], budget) if observations else (self, None)
        if cut:  # the whole group is of one model and shape: the same cut for all
            out = attack.reconstruct_many(observations, budget, seeds, progress, max_members)
            for rec in out:
                rec.trace["restarts_afforded"] = cut
            return out
        why = ungroupable(observations) if len(observations) > 1 else Reason("single-observation")
        per_chunk = max(1, int(max_members) // self.restarts)
        if why or per_chunk == 1:
            reason = why or Reason("group-too-small", max_members=int(max_members), restarts=self.restarts)
            out = [self.reconstruct(o, budget, s, progress) for o, s in zip(observations, seeds)]
            for rec in out:
                rec.trace["grouped"] = not_grouped(reason)
            return out
        if budget is not None and (isinstance(budget, bool) or int(budget) < 0):
            raise ConfigError(f"budget must be >= 0 gradient evaluations, got {budget}")
        cost = self.evaluation_cost(observations[0])
        iterations = self.planned_iterations(budget, cost)
        evaluations = None if budget is None else max(int(budget), cost)
        out: List[Reconstruction] = []
        for start in range(0, len(observations), per_chunk):
            chunk, chunk_seeds = observations[start:start + per_chunk], seeds[start:start + per_chunk]
            with seeded_rng(chunk[0].device, chunk_seeds[0]):
                run = OptimizationRun(self, chunk, chunk_seeds, show_bars=progress is None, iterations=iterations)
                out += run.execute(iterations, progress, max_evaluations=evaluations, cost=cost)
        return out


    def evaluate(self, observation: Observation, images: Tensor, labels: Optional[Tensor] = None,
                 seed: int = 0, iteration: int = 0) -> Dict[str, Any]:
        """The attack loss at given images ``(R, B, C, H, W)`` (or one batch ``(B, C, H, W)``):
        ``{"loss": (R,), "terms": {name: (R,)}, "grad": d loss / d images}``; e.g. the loss at
        the ground truth, to tell an optimisation failure from an ambiguous objective.
        ``grad`` is taken w.r.t. the optimised variable (the images for the clamp / none
        boxes). ``labels`` replaces the attack's own label handling."""
        validate_observation(observation)
        images = images.to(observation.device)
        if images.dim() == 4:
            images = images.unsqueeze(0)
        with seeded_rng(observation.device, seed), torch.enable_grad():
            run = OptimizationRun(self, observation, int(seed), labels)
            run.iteration = run.sim_ctx.iteration = iteration
            if run.labels.shape is not None:
                raise ConfigError("evaluate() needs labels when the attack optimises them (labels='optimize')")
            loss, terms, (grad,) = run.evaluate([self.box.variable(images)])
        return {"loss": loss, "terms": terms, "grad": grad, "execution": run.execution.to_dict()}

    def evaluate_many(self, observations: Sequence[Observation], images: Sequence[Tensor],
                      labels: Sequence[Tensor], seeds: Sequence[int]) -> Tensor:
        """The attack loss of one batch ``images[i]`` (with ``labels[i]``) per observation, as
        one batched evaluation over observations of the same model: ``(N,)``. Observations
        that cannot be grouped are evaluated one at a time."""
        observations = list(observations)
        if len(observations) == 1 or ungroupable(observations):
            return torch.cat([self.evaluate(o, x, y, seed=s)["loss"]
                              for o, x, y, s in zip(observations, images, labels, seeds)])
        device = observations[0].device
        variables = torch.stack([self.box.variable(x.to(device)) for x in images])
        with seeded_rng(device, seeds[0]), torch.enable_grad():
            run = OptimizationRun(self, observations, list(seeds), list(labels), show_bars=False)
            loss, _, _ = run.evaluate([variables])
        return loss


class OptimizationRun:
    """The state of one ``reconstruct`` call, or of one grouped call over several
    observations of the same model (``reconstruct_many``): ``N`` observations x ``R``
    restarts = ``N * R`` independent members, evaluated as one batched computation (an
    outer ``vmap`` over observations, each with its own target gradient and labels, and an
    inner one over restarts)."""

    def __init__(self, attack: OptimizationAttack, observation: Union[Observation, Sequence[Observation]],
                 seed: Union[int, Sequence[int]], labels: Optional[Tensor] = None, show_bars: bool = True,
                 iterations: Optional[int] = None):
        group = list(observation) if isinstance(observation, (list, tuple)) else [observation]
        seeds = [int(s) for s in seed] if isinstance(seed, (list, tuple)) else [int(seed)]
        self.attack, self.obs, self.group, self.n = attack, group[0], group, len(group)
        self.device = self.obs.device
        self.generators = [torch.Generator(device=self.device).manual_seed(s) for s in seeds]
        self.generator = self.generators[0]
        self.simulator = attack.simulator
        # each observation's target: its gradients, then the tensors the simulator reads from
        # it (``observed_data``), so a grouped run hands every member its own
        self.layers = len(self.obs.gradients)
        # what the observations share beyond the gradient (the buffers' batch statistics)
        sides = [side_information(o, attack.bn_upload) for o in group]
        self.side = sides[0]
        if len({s.revealed is None for s in sides}) > 1:
            raise ConfigError("the grouped observations differ in what they share (buffers in some only)")
        # weights from the observation resolve with the planned iterations (attacks.budget_rule)
        # the run-length rule stands only where the attack uses the revealed statistics
        # (bn_upload=0 switches it off with the term)
        run = iterations if self.side.revealed is not None else None
        self.priors = [(k, p, w(self.obs, run) if isinstance(w, ObservedWeight) else w)
                       for k, p, w in attack.priors] + self.side.priors
        share = long_share(self.obs, run)
        if share and any(isinstance(w, ObservedWeight) for _, _, w in attack.priors):
            self.side.notes["run-length"] = Reason("run-length", share=share, long=LONG, iterations=iterations)
        if self.side.revealed is not None and requiring(attack.priors, "bn_stats"):
            # the running statistics stand in for the batch's; the upload gives the batch's own
            replaced = requiring(attack.priors, "bn_stats")
            self.priors = [p for p in self.priors if p[0] not in replaced]
            used = self.side.notes["bn-upload"]
            self.side.notes["bn-upload"] = Reason(used.code, **used.params, replaces=list(replaced))
        self.head = self._classifier_head(attack)
        observed = [list(self.simulator.observed_data(o)) for o in group]
        self.n_observed = len(observed[0])
        self.targets = [[g.detach() for g in o.gradients] + extra + side.tensors()
                        for o, extra, side in zip(group, observed, sides)]
        self.target = self.targets[0]
        self.objective = attack.objective.bind_group(group)
        self.replica = self.simulator.prepare(self.obs)
        bn_priors = requiring(self.priors, "bn_stats")
        if bn_priors and self.replica.bn_running is None:
            raise NotApplicable(Reason("prior-needs-running-statistics", prior=bn_priors[0]))
        given = labels if isinstance(labels, (list, tuple)) else None if labels is None else [labels]
        self.plans = [plan_labels(attack.label_strategy, o, s) for o, s in zip(group, seeds)] if given is None else \
            [LabelPlan(y.to(self.device).long(), None, {"method": "given", "note": Reason("labels-given").to_dict()})
             for y in given]
        self.labels = self.plans[0]
        if self.head is not None and self.labels.shape is not None:
            self._drop_features(Reason("side-unused", why=Reason("features-labels-optimised").to_dict()))
        self.n_side = len(sides[0].tensors())
        self.upload_read = False  # the upload's features read once (appended to each observation's targets)
        if self.head is not None:
            self._read_upload_features(group)
        self.sim_ctx = SimContext(self.obs, generator=self.generator,
                                  capture_features=bool(bn_priors or requiring(self.priors, "bn_steps")),
                                  capture_softmax=self.head is not None)
        self.box = attack.box
        if hasattr(self.box, "bind"):  # a box that needs the run, e.g. a generator's latent space
            # its own set-up (e.g. training a default generator) shows a bar only when the
            # caller passed no progress callback (the audit and --quiet pass one)
            self.box = self.box.bind(self.obs, self.labels, self.generator, progress=show_bars)
        self.iteration = 0
        self.needs_group_mean = bool(requiring(self.priors, "group_mean"))
        members = self.n * attack.restarts
        self.stacked = False  # members through one call of a simulator that cannot be vmapped
        self._step: Optional[Callable] = None  # the (compiled) batched loss-and-gradient function
        self._inputs: Optional[Tuple[List[Tensor], Optional[Tensor]]] = None  # step_inputs(), once made
        uncompiled = self._uncompiled_because() if attack.compile else None
        self.compiled = attack.compile and uncompiled is None  # False again if compiling fails
        if self.compiled:
            self.batched, self.execution = True, Reason("run-compiled", members=members)
        elif attack.execution == "sequential":
            self.batched, self.execution = False, Reason("run-sequential", why=Reason("requested").to_dict())
        elif not self.simulator.batchable:
            if attack.execution == "batched":
                raise ConfigError(f"simulator {self.simulator.describe()} cannot be vmapped; "
                                  "use execution='auto' or 'sequential'")
            why = stacking.unstackable(self)
            self.batched, self.stacked = False, why is None
            self.execution = (Reason("run-stacked", members=members, simulator=self.simulator.describe())
                              if why is None else
                              Reason("run-sequential", why=Reason("not-vmappable", simulator=self.simulator.describe(),
                                                                  why=why.to_dict()).to_dict()))
        elif members == 1 and attack.execution == "auto":
            self.batched, self.execution = False, Reason("run-single")
        else:
            self.batched, self.execution = True, Reason("run-batched", observations=self.n, restarts=attack.restarts)
        if uncompiled:
            self.execution = Reason("compile-unused", route=self.execution.to_dict(), why=uncompiled.to_dict())
        self.evaluations = 0
        self.restarts = attack.restarts      # restarts per observation now (1 after keep_best_after)
        self.alive = torch.arange(self.n * attack.restarts)  # each member's index at the start
        self.unit = 1                         # gradient evaluations per member per loss evaluation
        self.spent = 0                        # gradient evaluations per observation so far
        self.selection: Optional[Dict[str, Any]] = None  # the keep_best_after selection, once it happened

    def _uncompiled_because(self) -> Optional[Reason]:
        """Why ``compile=true`` cannot apply to this run (None when it can)."""
        blockers = capturing.program_blockers(self, "step")
        return blockers[0] if blockers else None

    # -- the per-image features term (priors.features)
    def _classifier_head(self, attack: OptimizationAttack) -> Optional[Tuple[int, int]]:
        """The output layer's gradient positions when a prior reads the gradient, else None
        (the term dropped, with the reason in the trace, where the model has no such layer)."""
        reading = requiring(self.priors, "grads")
        self.features_auto = False  # the weight is the rule's (lowered where the upload is not read exactly)
        if not reading:
            return None
        try:
            head = classifier_head(self.obs.model)
        except NotApplicable as err:
            self._drop_features(Reason("side-unused", why=err.reason.to_dict()))
            return None
        why = None
        if all(w == 0 for k, _, w in self.priors if k in reading):
            why = observed_features_off(self.obs)
        elif any(isinstance(w, AutoFeatures) for k, _, w in attack.priors if k in reading):
            why = self._reads_differently(attack)
            self.features_auto = True
        if why:
            self._drop_features(Reason("side-unused", why=Reason("features-read-differs", why=why.to_dict()).to_dict()))
            return None
        self.side.use("features", Reason("features-read", reading="dummy-softmax"))
        return head

    def _read_upload_features(self, group: Sequence[Observation]) -> None:
        """Read each upload's features once, with the softmax recovered from the upload itself
        (:func:`priors.features.observed_reading`), where that fixed point explains every upload
        of the group; else the run reads the upload with the dummy's softmax each evaluation."""
        weight, bias = self.head
        trainable = trainable_parameters(self.obs.model)
        readings = []
        for obs, targets, plan in zip(group, self.targets, self.plans):
            labels = plan.targets(None).to(obs.gradients[weight].device)
            features, _, residual = observed_reading(obs.gradients[weight].detach(), obs.gradients[bias].detach(),
                                                     labels, trainable[weight], trainable[bias])
            if not residual <= FIXED_POINT_TOLERANCE:
                self._read_with_dummy_softmax(Reason("softmax-misfit", residual=float(residual),
                                                     tolerance=FIXED_POINT_TOLERANCE))
                return
            readings.append(features)
        for targets, features in zip(self.targets, readings):
            targets.append(features)
        self.upload_read = True
        self.side.use("features", Reason("features-read", reading="fixed-point"))

    def _read_with_dummy_softmax(self, why: Reason) -> None:
        """The upload read with the dummy's softmax each evaluation; the rule's weight lowered to
        :func:`attacks.feature_rule.dummy_softmax_weight` (the term dropped where that is 0)."""
        if self.features_auto:
            weight, off = dummy_softmax_weight(self.obs)
            if off:
                self._drop_features(Reason("side-unused", why=Reason("features-misread", why=why.to_dict(),
                                                                     off=off.to_dict()).to_dict()))
                return
            reading = requiring(self.priors, "grads")
            self.priors = [(k, p, weight if k in reading else w) for k, p, w in self.priors]
        self.side.notes["features"] = Reason("features-read", reading="dummy-softmax", because=why.to_dict())

    def _reads_differently(self, attack: OptimizationAttack) -> Optional[Reason]:
        """Why the observed output layer cannot be read as the dummy's is, for ``features="auto"``."""
        sim = self.simulator
        if type(sim) is not GradientSimulator or sim.transforms or sim.step_transforms:
            return Reason("features-gradient-transformed", simulator=sim.describe())
        objective = attack.objective
        if not isinstance(objective, GradientDistance) or objective.masks is not None or objective.weights is not None:
            return Reason("features-objective-differs", objective=repr(objective))
        return None

    def _drop_features(self, why: Union[Reason, str]) -> None:
        dropped = requiring(self.priors, "grads")
        self.priors = [p for p in self.priors if p[0] not in dropped]
        self.side.drop("features", why)
        self.head = None

    def gradient_features(self, grads: Sequence[Tensor], target: Sequence[Tensor], labels: Tensor) -> Dict[str, Any]:
        """What a prior that reads the gradient gets in ``context.features`` (empty when none does)."""
        if self.head is None:
            return {}
        upload = target[self.layers + self.n_observed + self.n_side] if self.upload_read else None
        return {"grads": list(grads), "target": list(target[:self.layers]), "labels": labels, "head": self.head,
                "target_features": upload}

    # -- the attack loss
    def restart_terms(self, z: Tensor, y: Optional[Tensor], group_mean: Optional[Tensor], functional: bool,
                      target: Optional[List[Tensor]] = None, plan: Optional[LabelPlan] = None,
                      fixed: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """Objective and prior values of one member (runs under vmap when batched);
        ``target`` / ``fixed`` labels default to the first observation's."""
        image = self.box.image(z)
        plan = plan or self.labels
        labels = fixed if fixed is not None else plan.targets(y)
        target = self.target if target is None else target
        self.sim_ctx.observed = list(target[self.layers:self.layers + self.n_observed])
        grads, feats = self.simulator(self.replica, image, labels, functional=functional, context=self.sim_ctx)
        terms = {"match": self.objective(grads, target[:self.layers])}
        feats = {**feats, **self.gradient_features(grads, target, labels)}
        ctx = PriorContext(self.sim_ctx, feats, self.replica.bn_running, group_mean, self.obs,  # step read on use
                           revealed=self.revealed(target))
        for key, prior, _ in self.priors:
            terms[key] = prior(image, ctx)
        return terms

    def revealed(self, target: List[Tensor]):
        """This member's revealed batch statistics (its slice of the targets), or None."""
        if self.side.revealed is None:
            return None
        start = self.layers + self.n_observed
        return revealed_for_member(self.side.revealed, target[start:start + self.n_side])

    def evaluate(self, variables: List[Tensor]) -> Tuple[Tensor, Dict[str, Tensor], List[Tensor]]:
        """Per-member loss ``(N*R,)``, terms ``{name: (N*R,)}`` and gradients w.r.t. ``variables``."""
        if self.batched:
            try:
                out = self._batched(variables)
                self.evaluations += 1
                self._count()
                return out
            except GiaError:
                raise
            except Exception as err:  # not compilable / vmappable: fall back once, at the first evaluation
                if self.evaluations > 0:
                    raise
                if self.compiled:
                    self.compiled, self._step = False, self._batched_step(compiled=False)
                    first_line = (str(err).strip().splitlines() or [""])[0][:200]
                    self.execution = Reason("run-compile-failed", error=f"{type(err).__name__}: {first_line}")
                    return self.evaluate(variables)
                if self.attack.execution == "batched":
                    raise
                self.batched = False
                self.execution = Reason("run-sequential", why=path_failed("vmap", err))
        if self.stacked:
            try:
                out = stacking.evaluate(self, variables)
                self.evaluations += 1
                self._count()
                return out
            except GiaError:
                raise
            except Exception as err:  # a defense whose many() cannot take the members: one at a time
                if self.evaluations > 0:
                    raise
                self.stacked = False
                self.execution = Reason("run-sequential", why=path_failed("the stacked call", err))
        out = self._sequential(variables)
        self.evaluations += 1
        self._count()
        return out

    def _count(self) -> None:
        self.spent += self.restarts * self.unit

    def _group_mean(self, z: Tensor) -> Optional[Tensor]:
        """Per observation, the mean image over its restarts ``(N, B, C, H, W)``."""
        if not self.needs_group_mean:
            return None
        images = self.box.image(z)
        return images.reshape(self.n, -1, *images.shape[1:]).mean(1).detach()

    def _batched_step(self, compiled: bool) -> Callable:
        """``vmap(grad_and_value(per-member loss))`` over the members (an outer vmap over the
        observations when there are several), optionally through ``torch.compile``: one
        fused, exact loss-and-gradient function (no double backward through eager autograd)."""
        labelled = self.labels.shape is not None

        def loss_of(target, fixed, mean, *per_member):
            z, y = per_member[0], per_member[1] if labelled else None
            terms = self.restart_terms(z, y, mean, functional=True, target=target, fixed=fixed)
            return self.total(terms), terms

        count = 2 if labelled else 1
        step = torch.func.grad_and_value(loss_of, argnums=tuple(range(3, 3 + count)), has_aux=True)
        inner = step if self._one_vmap() else \
            torch.func.vmap(step, in_dims=(None, None, None) + (0,) * count, randomness="different")
        if self.n > 1:  # over the observations (each one member: the only vmap)
            fixed = self.labels.fixed is not None
            inner = torch.func.vmap(inner, in_dims=(0, 0 if fixed else None, 0 if self.needs_group_mean else None)
                                    + (0,) * count, randomness="different")

        def members(target, fixed, mean, *per_member):
            if self.n > 1 or per_member[0].shape[0] != 1:
                return inner(target, fixed, mean, *per_member)
            # a single member runs without vmap: faster compiled (docs/strength.md (Speed))
            grads, (loss, terms) = step(target, fixed, mean, *(v[0] for v in per_member))
            return [g[None] for g in grads], (loss[None], {k: t[None] for k, t in terms.items()})

        if not compiled:
            return members
        if self.device.type == "cpu":  # channels-last weights: faster compiled on a CPU (docs/strength.md (Speed))
            self.replica.channels_last()
        return kernel_compiled(members, dynamic=False, fullgraph=True)  # a graph break is a failure, not eager

    def _batched(self, variables):
        """The batched loss and gradient: fully functional. (Eager autograd through a vmapped
        ``torch.func.grad`` gives wrong input gradients for train-mode BatchNorm in torch 2.x;
        the fully functional composition matches finite differences.) Several observations:
        an outer vmap over them with their targets and labels."""
        if self._step is None:
            self._step = self._batched_step(compiled=self.compiled)
        targets, fixed = self.step_inputs()
        loss, terms, grads = self.batched_call(self._step, targets, fixed, self._group_mean(variables[0]),
                                               [v.detach() for v in variables])
        return loss.detach(), {k: v.detach() for k, v in terms.items()}, [g.detach() for g in grads]

    def step_inputs(self) -> Tuple[List[Tensor], Optional[Tensor]]:
        """The observations' targets stacked per layer ``(N, ...)`` and their fixed labels
        ``(N, B)`` (None when the labels are optimised), made once per run."""
        if self._inputs is None:
            self._inputs = ([torch.stack(layer) for layer in zip(*self.targets)],
                            None if self.labels.fixed is None else torch.stack([p.fixed for p in self.plans]))
        return self._inputs

    def _one_vmap(self) -> bool:
        """Several observations of one restart each: one vmap over them (a nested vmap over
        restarts of one member would add batching work to every operation)."""
        return self.n > 1 and self.attack.restarts == 1

    def batched_call(self, step: Callable, targets: List[Tensor], fixed: Optional[Tensor],
                     group_mean: Optional[Tensor], variables: List[Tensor]):
        """``step`` (from :meth:`_batched_step`) on the members' ``variables`` ``(N*R, ...)``:
        the flat per-member loss ``(N*R,)``, terms and gradients."""
        if self.n == 1:
            mean = None if group_mean is None else group_mean[0]
            grads, (loss, terms) = step([t[0] for t in targets], None if fixed is None else fixed[0], mean,
                                        *variables)
            return loss, terms, grads
        if self._one_vmap():
            grads, (loss, terms) = step(targets, fixed, group_mean, *variables)
            return loss, terms, grads
        split = [v.reshape(self.n, -1, *v.shape[1:]) for v in variables]
        grads, (loss, terms) = step(targets, fixed, group_mean, *split)
        flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
        return flat(loss), {k: flat(v) for k, v in terms.items()}, [flat(g) for g in grads]

    def _sequential(self, variables):
        """One member at a time with ``torch.autograd`` (no torch.func transforms)."""
        group_mean = self._group_mean(variables[0])
        restarts = self.restarts
        losses, all_terms, grads = [], [], [[] for _ in variables]
        for m in range(variables[0].shape[0]):
            n = m // restarts if self.n > 1 else 0  # evaluate() may pass any number of members
            leaves = [v[m].detach().clone().requires_grad_(True) for v in variables]
            terms = self.restart_terms(leaves[0], leaves[1] if len(leaves) > 1 else None,
                                       None if group_mean is None else group_mean[n], functional=False,
                                       target=self.targets[n], plan=self.plans[n])
            loss = self.total(terms)
            for store, leaf, g in zip(grads, leaves, torch.autograd.grad(loss, leaves, allow_unused=True)):
                store.append(torch.zeros_like(leaf) if g is None else g)
            losses.append(loss.detach())
            all_terms.append({k: torch.as_tensor(v).detach() for k, v in terms.items()})
        terms = {k: torch.stack([t[k] for t in all_terms]) for k in all_terms[0]}
        return torch.stack(losses), terms, [torch.stack(g) for g in grads]

    def total(self, terms: Dict[str, Tensor]) -> Tensor:
        return weighted_total(terms, self.priors)

    def closure(self, variables: List[Tensor]) -> Tuple[Tensor, List[Tensor]]:
        """Per-member loss and its gradient w.r.t. every member's variables."""
        loss, _, grads = self.evaluate(variables)
        return loss, grads

    # -- the optimisation loop
    def initial_variables(self) -> List[Tensor]:
        """Each observation's restarts drawn from its own seeded generator (so a grouped run
        starts where each one-at-a-time run starts)."""
        shape = (self.attack.restarts, self.obs.batch_size, *self.obs.input_shape)
        per_obs = []
        takes_observation = "observation" in parameter_names(self.attack.init)
        for obs, gen in zip(self.group, self.generators):
            drawn = (self.attack.init(shape, gen, self.device, observation=obs) if takes_observation
                     else self.attack.init(shape, gen, self.device))
            z = self.box.variable(drawn)
            variables = [z.detach().clone()]
            if self.labels.shape is not None:
                variables.append(torch.randn((self.attack.restarts, *self.labels.shape), generator=gen,
                                             device=self.device))
            per_obs.append(variables)
        return [torch.cat(parts) for parts in zip(*per_obs)]

    def keep_best(self, variables: List[Tensor], optimizer, loss: Tensor, iteration: int) -> None:
        """Per observation, keep only its lowest-loss restart (variables and optimiser state);
        the rest of the budget goes to it."""
        per = torch.nan_to_num(loss.detach(), nan=float("inf")).reshape(self.n, self.restarts)
        best = per.argmin(1)
        index = torch.arange(self.n, device=best.device) * self.restarts + best
        self.selection = {"iteration": int(iteration), "after_gradient_evaluations": int(self.spent),
                          "losses": per.tolist(), "kept": (self.alive[index.cpu()] % self.attack.restarts).tolist()}
        variables[:] = [v[index].clone() for v in variables]
        optimizer.select(index)
        self.alive = self.alive[index.cpu()]
        self.restarts = 1

    def _due(self, iteration: int, iterations: int, max_evaluations: Optional[int]) -> bool:
        """Whether the restart selection (``keep_best_after``) happens after this iteration."""
        fraction = self.attack.keep_best_after
        if not fraction or self.restarts == 1 or not hasattr(self.attack.optimizer, "select"):
            return False
        if max_evaluations is not None:
            return self.spent >= fraction * max_evaluations
        return iteration + 1 >= fraction * iterations

    def execute(self, iterations: int, progress: Optional[Progress], max_evaluations: Optional[int] = None,
                cost: int = 1) -> List[Reconstruction]:
        """``iterations`` optimiser steps, stopping early when the next loss evaluation would
        exceed ``max_evaluations`` gradient evaluations (line searches evaluate more than once).
        One reconstruction per observation, from its lowest-loss restart."""
        start = time.perf_counter()
        variables = self.initial_variables()
        optimizer = copy.deepcopy(self.attack.optimizer)
        optimizer.start(variables, iterations)
        self.unit = max(1, cost // self.attack.restarts)
        history: List[Tuple[Tensor, Tensor]] = []  # (members' start indices, their losses) per iteration
        steps = capturing.stepper(self, variables, optimizer, iterations)  # optimiser step + projection
        shown = float("inf")
        with flushed_denormals():  # saturated sigmoids make subnormal floats, slow on a CPU
            for it in range(iterations):
                if max_evaluations is not None and it > 0 and self.spent + self.restarts * self.unit > max_evaluations:
                    break
                self.iteration = self.sim_ctx.iteration = it
                loss = steps.step(it)
                history.append((self.alive, loss))
                if progress is not None:
                    if it % steps.read_every == 0 or it + 1 == iterations:  # a read waits for the device
                        shown = float(torch.nan_to_num(loss, nan=float("inf")).min())
                    progress(it + 1, iterations, shown)
                if self._due(it, iterations, max_evaluations):
                    steps.release()
                    self.keep_best(variables, optimizer, loss, it)
            steps.release()
        if steps.captured and self.compiled:  # the final evaluation need not compile the loss again
            self._step = self._batched_step(compiled=False)
        # the optimiser's watchdog (attacks.optimizers.Watchdog): interventions and progress
        events = optimizer.all_events() if hasattr(optimizer, "all_events") else []
        progressed = optimizer.progress() if hasattr(optimizer, "progress") and history else None
        flat = optimizer.flat() if hasattr(optimizer, "flat") and history else None
        self.iteration = self.sim_ctx.iteration = iterations
        final, terms, _ = self.evaluate(variables)
        final = torch.nan_to_num(final, nan=float("inf"))
        seconds = time.perf_counter() - start
        restarts = self.attack.restarts
        rows_of = [[] for _ in range(self.n * restarts)]  # loss history per member (by start index)
        for alive, loss in history:
            for m, value in zip(alive.tolist(), loss.tolist()):
                rows_of[m].append(value)
        selected_at = self.selection["iteration"] if self.selection else None
        start_index = self.alive.tolist()
        out = []
        for n in range(self.n):
            members = [k for k, m in enumerate(start_index) if m // restarts == n]  # current positions
            member = min(members, key=lambda k: float(final[k]))
            best = start_index[member] - n * restarts
            images = self.box.image(variables[0][member]).detach().clamp(0, 1)
            labels = self.plans[n].final(variables[1][member] if len(variables) > 1 else None)
            finals = {start_index[k] - n * restarts: float(final[k]) for k in members}
            trace = {
                "attack": self.attack.name,
                "settings": self.attack.describe(),
                "execution": self.execution.to_dict(),
                "capture": steps.describe().to_dict(),
                "iterations": len(history),
                "evaluations": self.evaluations,
                "gradient_evaluations": self.spent,
                "budget_unit": Reason("unit-optimisation").to_dict(),
                "restarts": restarts,
                "chosen_restart": best,
                "selection": Reason("lowest-final-loss").to_dict(),
                "final_losses": [finals.get(r) for r in range(restarts)],
                "final_terms": {k: float(v[member]) for k, v in terms.items()},
                "loss_history": rows_of[n * restarts:(n + 1) * restarts],
                "labels": self.plans[n].info,
                "side_information": self.side.traced(),
                "side_information_used": tuple(self.side.used),
                "prior_weights": {k: float(w) for k, _, w in self.priors},
                "client_optimizer": replica_note(self.obs.optimizer).to_dict(),
                "time_s": seconds / self.n,
            }
            if self.selection:
                sel = self.selection
                trace["restart_selection"] = {
                    "iteration": sel["iteration"], "after_gradient_evaluations": sel["after_gradient_evaluations"],
                    "losses": sel["losses"][n], "kept": sel["kept"][n],
                    "rule": Reason("keep-best-after").to_dict()}

            def original(e, r):  # events after the selection count positions among the survivors
                return start_index[r] if selected_at is not None and e["iteration"] > selected_at else r

            trace["optimizer_events"] = [
                dict(e, restarts=[original(e, r) - n * restarts for r in e["restarts"]
                                  if original(e, r) // restarts == n])
                for e in events if any(original(e, r) // restarts == n for r in e["restarts"])]
            if progressed is not None and not bool(progressed[member]):
                if self.group[n].silent:
                    trace["silent_upload"] = Reason("silent-upload").to_dict()
                else:
                    trace["failed_to_optimise"] = True
                    flat_loss = flat is not None and bool(flat[member])
                    if flat_loss:
                        trace["flat_loss"] = True
                    trace["failure"] = Reason("stalled", iterations=len(history),
                                              recoveries=len(trace["optimizer_events"]), flat=flat_loss).to_dict()
            if not history:  # budget 0: the initialisation itself, nothing was optimised
                trace["failed_to_optimise"] = True
                trace["failure"] = Reason("no-iteration").to_dict()
            if self.n > 1 and (self.batched or self.stacked):
                trace["grouped"] = Reason("grouped", members=self.n, seconds=round(seconds, 2)).to_dict()
            elif self.n > 1:
                trace["grouped"] = not_grouped(Reason("one-after-another", execution=self.execution.to_dict()))
            out.append(Reconstruction(images, labels, trace))
        return out
