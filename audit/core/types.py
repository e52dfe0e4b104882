"""The public contracts of gia-audit (docs/reference.md, "The contracts", explains them for users).

* **Images are in [0, 1]**, shape ``(B, C, H, W)``. Normalisation lives *inside* the model
  (the model registry prepends a :class:`~audit.core.models.Normalize` layer, and so does
  :mod:`audit.core.model_source` for a user model that expects normalised inputs).
* **A defended-gradient function** is any callable
  ``defense(model, inputs, labels, *, loss_fn, generator) -> list[Tensor]`` returning one
  tensor per trainable parameter (same order and shapes as
  ``[p for p in model.parameters() if p.requires_grad]``). When ``inputs.requires_grad``
  the returned tensors should stay differentiable w.r.t. ``inputs`` (built-in defenses
  do), so adaptive attacks can pass their dummy data *through* the defense.
* **An attack** has ``reconstruct(observation, budget, seed) -> Reconstruction`` and never
  sees the private batch. ``budget`` is counted in **gradient evaluations** of the audited
  model (see :data:`BUDGET_UNIT`); each attack maps it to its own iterations.
* **What an adaptive attack may know of a defense** is a small declared protocol on
  :class:`Defense`, never a built-in class or attribute: ``stochastic``, ``log_prob``,
  ``wrap_model``, ``transform_inputs``, ``transform`` (gradient-only defenses),
  ``latent_bottlenecks(model)`` (architectural bottlenecks, :class:`LatentBottleneck`) and
  ``channel_weights()`` (weighted low-rank defenses). Any user defense can declare them.
* **Batched calls (optional)**: ``defense.many(model, inputs, labels, *, draws, loss_fn,
  generator[, round])`` with ``inputs`` ``(N, B, ...)`` returns per parameter ``(N, draws,
  *shape)``: what ``N x draws`` calls would share, batch by batch and draw by draw from one
  generator, each on the model as it is (its buffers are left unchanged). EOT, Monte Carlo
  and the learned inverter's training pairs use it; :meth:`Defense.many` falls back to those
  calls, and a plain callable may declare its own ``many``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.client_training import SHARES, ClientTraining
from audit.core.local_training import LocalOptimizer
from audit.core.trace import Trace
from audit.core.reasons import Reason

LossFn = Callable[[Tensor, Tensor], Tensor]


def default_loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy, the loss every client uses unless told otherwise."""
    return nn.functional.cross_entropy(logits, labels)


def trainable_parameters(model: nn.Module) -> List[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def trainable_names(model: nn.Module) -> List[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def clean_gradients(
    model: nn.Module,
    inputs: Tensor,
    labels: Tensor,
    loss_fn: LossFn = default_loss_fn,
    create_graph: Optional[bool] = None,
) -> List[Tensor]:
    """The true gradient of ``loss_fn(model(inputs), labels)`` w.r.t. the trainable parameters.

    ``create_graph`` defaults to ``inputs.requires_grad`` so that a dummy input's gradient
    stays differentiable (needed by every gradient-matching attack).
    """
    if create_graph is None:
        create_graph = bool(inputs.requires_grad)
    params = trainable_parameters(model)
    loss = loss_fn(model(inputs), labels)
    return list(torch.autograd.grad(loss, params, create_graph=create_graph))


# --------------------------------------------------------------------------- budget
BUDGET_UNIT = "gradient evaluations"
BUDGET_DEFINITION = (
    "gradient evaluations of the audited model per attack and private batch: one evaluation is one "
    "gradient of the model's loss w.r.t. its parameters for one candidate batch (each restart, EOT or "
    "Monte Carlo draw and FedAvg local step counts once); each attack maps it to its own iterations. "
    "One-off set-up that is reused across images (training a generator prior or a learned inverter) is "
    "reported separately, not charged to the budget")


def iterations_for(budget: int, cost_per_iteration: int) -> int:
    """How many iterations costing ``cost_per_iteration`` gradient evaluations fit in ``budget``
    (at least one: an attack always runs)."""
    if cost_per_iteration < 1:
        raise ValueError(f"an iteration costs at least one gradient evaluation, got {cost_per_iteration}")
    return max(1, int(budget) // int(cost_per_iteration))


# --------------------------------------------------------------------------- defenses
@runtime_checkable
class DefendedGradientFn(Protocol):
    """``defense(model, inputs, labels, *, loss_fn, generator) -> list[Tensor]``."""

    def __call__(
        self, model: nn.Module, inputs: Tensor, labels: Tensor, *, loss_fn: LossFn,
        generator: Optional[torch.Generator],
    ) -> List[Tensor]: ...


class Defense:
    """Base class of the built-in defenses: a defended-gradient callable plus the knowledge
    an adaptive (white-box, Kerckhoffs) attacker may use.

    Subclasses override :meth:`__call__` (or :meth:`transform` for gradient-only defenses)
    and set the class attributes that apply:

    * ``stochastic`` -- the output depends on ``generator`` (EOT / Monte Carlo attacks).
    * ``vmap_draws`` -- :meth:`transform` draws all its randomness through
      ``defenses.common.randn`` / ``rand`` and runs under ``torch.func.vmap``, so an EOT
      attack can draw it inside one batched program (:mod:`audit.core.randomness`).
    * ``log_prob(shared, clean)`` -- exact log-likelihood of a shared gradient given the
      clean one (Bayes adversary); ``None`` where there is no closed form.
    * ``wrap_model(model)`` -- architectural defenses (PRECODE) change the client model.
    * ``transform_inputs(inputs, generator)`` -- data-side defenses (ATS, Refiner).
    * ``differences`` -- where this reference implementation departs from its paper or the
      authors' code, one sentence each (data only; the report of an audit prints them).
    * ``buffer_effect`` -- what it does to the BatchNorm buffers a client uploads with its
      state (:data:`audit.core.buffers.BUFFER_EFFECTS`; unset: "not declared"), with
      ``buffer_inputs(inputs, generator)`` for "transformed", ``buffer_noise_std`` for "noised",
      ``transform_state(update, buffers, before, lr=, generator=)`` for "clipped" and "clipped and
      noised" (a transform of the whole reply, as Flower's mods clip every array together).

    A defense whose ``__call__`` takes a ``round`` keyword gets the FL round index (the
    training step) from the client simulation; ``accepts_round`` says whether it does.
    """

    name: str = "defense"
    stochastic: bool = False
    vmap_draws: bool = False
    log_prob: Optional[Callable[[Sequence[Tensor], Sequence[Tensor]], Tensor]] = None
    differences: Tuple[str, ...] = ()

    @property
    def accepts_round(self) -> bool:
        """True when ``__call__`` takes a ``round`` keyword (inspected once per class)."""
        return _call_accepts_round(type(self))

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        grads = clean_gradients(model, self.transform_inputs(inputs, generator), labels, loss_fn)
        return self.transform(grads, generator=generator, model=model)

    # gradient-only hook (identity by default)
    def transform(self, grads: List[Tensor], *, generator=None, model=None) -> List[Tensor]:
        return grads

    def transform_inputs(self, inputs: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        return inputs

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def many(self, model: nn.Module, inputs: Tensor, labels: Tensor, *, draws: int = 1,
             loss_fn: LossFn = default_loss_fn, generator: Optional[torch.Generator] = None,
             round: Optional[int] = None) -> List[Tensor]:
        """``draws`` defended gradients of each batch of ``inputs`` ``(N, B, ...)``, per parameter
        ``(N, draws, *shape)`` (see the module docstring). Here: the calls themselves, with one
        clean gradient per batch for a gradient-only defense; subclasses batch their own work."""
        return calls_stacked(self, model, inputs, labels, draws=draws, loss_fn=loss_fn, generator=generator,
                             round=round)

    # declared knowledge for adaptive attacks (white-box, Kerckhoffs); defaults: nothing declared
    def latent_bottlenecks(self, model: nn.Module) -> List["LatentBottleneck"]:
        """The modules of the client model (as ``wrap_model`` returned it) that draw a random
        latent and decode it with a linear layer (PRECODE). Attacks recover each draw from its
        decoder's gradient (:class:`LatentBottleneck`). Default: none."""
        return []

    def channel_weights(self) -> Optional[str]:
        """For low-rank defenses that weight the rows (output channels) of each weight
        gradient before truncating it (SVDefense): ``"sqrt"`` (row norms) or ``"square"``
        (squared row norms). ``None``: no weighting declared."""
        return None

    def params(self) -> Dict[str, Any]:
        """The defense's settings, for the report."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{self.name}({args})"


@runtime_checkable
class LatentBottleneck(Protocol):
    """A variational bottleneck inside the client model, as declared by
    :meth:`Defense.latent_bottlenecks`: it draws ``b = mu + sigma * e`` from
    ``posterior(features)`` and feeds ``b`` to ``decoder`` (an ``nn.Linear``); while
    ``fixed_latent`` is set, that tensor replaces the draw."""

    decoder: nn.Linear
    fixed_latent: Optional[Tensor]

    def posterior(self, features: Tensor) -> Tuple[Tensor, Tensor]:
        """``(mu, sigma)`` of the latent draw for these features."""


class NoDefense(Defense):
    """Shares the clean gradient unchanged (the undefended baseline)."""

    name = "none"
    stochastic = False
    buffer_effect = "untouched"


def is_gradient_only(defense: Any) -> bool:
    """True when ``defense`` is "clean gradient, then ``transform``" (a :class:`Defense`
    keeping the base ``__call__`` and ``transform_inputs``), so its transform can be
    replayed or sampled on a gradient without recomputing it."""
    kind = type(defense)
    return (isinstance(defense, Defense) and kind.__call__ is Defense.__call__
            and kind.transform_inputs is Defense.transform_inputs)


class FunctionDefense(Defense):
    """Adapts a plain defended-gradient function to the :class:`Defense` interface."""

    def __init__(self, fn: Callable, name: Optional[str] = None, stochastic: bool = True):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        # an unknown callable is treated as possibly random until probed
        self.stochastic = getattr(fn, "stochastic", stochastic)
        self._takes_round = takes_round(fn)
        self.differences = tuple(getattr(fn, "differences", ()))
        # what it declares it does to the uploaded buffers (None: not declared)
        self.buffer_effect = getattr(fn, "buffer_effect", None)
        for key in ("buffer_inputs", "buffer_noise_std", "transform_state"):
            if hasattr(fn, key):
                setattr(self, key, getattr(fn, key))

    @property
    def accepts_round(self) -> bool:
        return self._takes_round

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None, round=None):
        if self._takes_round:
            return self.fn(model, inputs, labels, loss_fn=loss_fn, generator=generator, round=round)
        return self.fn(model, inputs, labels, loss_fn=loss_fn, generator=generator)

    def params(self) -> Dict[str, Any]:
        return {"callable": f"{getattr(self.fn, '__module__', '?')}.{self.name}"}

    def many(self, model, inputs, labels, *, draws=1, loss_fn=default_loss_fn, generator=None, round=None):
        declared = getattr(self.fn, "many", None)
        if not callable(declared):
            return calls_stacked(self, model, inputs, labels, draws=draws, loss_fn=loss_fn, generator=generator,
                                 round=round)
        extra = {"round": round} if round is not None and takes_round(declared) else {}
        return list(declared(model, inputs, labels, draws=draws, loss_fn=loss_fn, generator=generator, **extra))

    # a callable object may declare the protocol itself
    def latent_bottlenecks(self, model: nn.Module) -> List[LatentBottleneck]:
        declared = getattr(self.fn, "latent_bottlenecks", None)
        return list(declared(model)) if callable(declared) else []

    def channel_weights(self) -> Optional[str]:
        declared = getattr(self.fn, "channel_weights", None)
        return declared() if callable(declared) else None


class GradientTransformDefense(Defense):
    """A defense given as a ``grads -> grads`` transform (see :func:`gradient_transform`)."""

    def __init__(self, fn: Callable, name: Optional[str] = None, stochastic: bool = False):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "transform")
        self.stochastic = stochastic
        self._takes_generator = "generator" in parameter_names(fn)
        functools.update_wrapper(self, fn)

    def transform(self, grads, *, generator=None, model=None):
        if self._takes_generator:
            return list(self.fn(grads, generator=generator))
        return list(self.fn(grads))

    def params(self) -> Dict[str, Any]:
        return {"transform": f"{getattr(self.fn, '__module__', '?')}.{self.name}"}


def gradient_transform(fn: Optional[Callable] = None, *, stochastic: bool = False, name=None):
    """Decorator: turn ``f(grads[, generator=...]) -> grads`` into a defended-gradient function.

    >>> @gradient_transform(stochastic=True)
    ... def noisy(grads, generator=None):
    ...     return [g + 0.1 * torch.randn(g.shape, generator=generator) for g in grads]
    """

    def deco(f: Callable) -> GradientTransformDefense:
        return GradientTransformDefense(f, name=name, stochastic=stochastic)

    return deco(fn) if fn is not None else deco


def calls_stacked(defense: "Defense", model: nn.Module, inputs: Tensor, labels: Tensor, *, draws: int,
                  loss_fn: LossFn, generator: Optional[torch.Generator], round: Optional[int]) -> List[Tensor]:
    """:meth:`Defense.many` by calls: batch by batch, draw by draw, each call's buffer changes
    undone; a gradient-only defense computes each batch's clean gradient once and samples its
    ``transform`` ``draws`` times."""
    from audit.core.models import preserved_buffers

    kwargs = {"round": int(round)} if round is not None and defense.accepts_round else {}
    out = []
    for x, y in zip(inputs, labels):
        if is_gradient_only(defense):
            with preserved_buffers(model):
                clean = clean_gradients(model, x, y, loss_fn)
            runs = [defense.transform(list(clean), generator=generator, model=model) for _ in range(draws)]
        else:
            runs = []
            for _ in range(draws):
                with preserved_buffers(model):
                    runs.append(list(defense(model, x, y, loss_fn=loss_fn, generator=generator, **kwargs)))
        out.append([torch.stack(column) for column in zip(*runs)])
    return [torch.stack(column) for column in zip(*out)]


def takes_round(fn: Callable) -> bool:
    """True when ``fn`` has a parameter named ``round`` that can be passed by keyword."""
    import inspect

    try:
        param = inspect.signature(fn).parameters.get("round")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


@functools.lru_cache(maxsize=None)
def _call_accepts_round(kind: type) -> bool:
    return takes_round(kind.__call__)


def parameter_names(fn: Callable) -> List[str]:
    """The names of ``fn``'s parameters ([] when it has no inspectable signature)."""
    import inspect

    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


# --------------------------------------------------------------------------- observation
@dataclass
class Observation:
    """Everything the server sees, and nothing more.

    ``gradients`` is what the client shared: one tensor per trainable parameter of ``model``
    (``shares="gradient"``: the defended gradient; ``"update"`` / ``"state"``: the *update*
    ``(theta_0 - theta_K) / lr`` of its local training with ``optimizer``, in gradient units,
    see :mod:`audit.core.unroll`). With ``shares="state"``, ``buffers`` holds the buffers the
    client uploaded with it (BatchNorm running statistics after its local training), by
    ``state_dict`` name; ``model`` keeps the global model's. ``training`` is the client's
    training record, whole (:class:`~audit.core.client_training.ClientTraining`); the
    ``local_*``, ``optimizer``, ``shares`` and ``client_mode`` properties read it. The remaining
    fields are declared side information; :meth:`threat_model` lists them for the report.
    """

    model: nn.Module
    gradients: List[Tensor]
    input_shape: Tuple[int, int, int]
    num_classes: int
    batch_size: int = 1
    labels: Optional[Tensor] = None  # only when the protocol shares labels
    loss_fn: LossFn = default_loss_fn
    training: ClientTraining = field(default_factory=ClientTraining)  # the client's training, whole
    defense: Optional[Defense] = None  # white-box access to the mechanism (not its randomness)
    step: int = 0  # training step at which the update was captured
    data_mean: Optional[Tuple[float, ...]] = None  # informational: normalisation in the model
    data_std: Optional[Tuple[float, ...]] = None
    extra: Dict[str, Any] = field(default_factory=dict)  # declared extras (e.g. aux data)
    buffers: Optional[Dict[str, Tensor]] = None  # the uploaded buffers (shares="state" only)
    # what the defense did to them (audit.core.buffers.BUFFER_EFFECTS: untouched, noised, ...)
    buffer_effect: str = "untouched"

    def __post_init__(self):
        if not isinstance(self.training, ClientTraining):
            raise ConfigError(f"an observation's training is a ClientTraining record, got {type(self.training).__name__}")
        if (self.shares == "state") != (self.buffers is not None):
            raise ConfigError("an observation carries buffers exactly when the client shares its state "
                              f"(shares={self.shares!r}, buffers {'given' if self.buffers is not None else 'missing'})")

    @property
    def local_steps(self) -> int:
        """The client's local steps on this batch (its epochs counted in steps)."""
        return self.training.steps_for(self.batch_size)

    @property
    def local_lr(self) -> float:
        """The client's learning rate where it took several steps; 0 for one step (whose
        update is the gradient whatever the rate)."""
        return self.training.lr if self.local_steps > 1 else 0.0

    @property
    def local_batch_size(self) -> Optional[int]:
        """The client's local mini-batch size (None: its whole batch each step)."""
        return self.training.batch_size

    @property
    def optimizer(self) -> LocalOptimizer:
        return self.training.optimizer

    @property
    def shares(self) -> str:
        """What the client uploaded: gradient (FedSGD), update (weights after local training)
        or state (weights and buffers)."""
        return self.training.shares

    @property
    def client_mode(self) -> str:
        """The mode the client ran the model in: "train" (BatchNorm normalises with the batch's
        statistics, as FL clients train) or "eval" (with the buffers' running statistics)."""
        return self.training.mode

    @property
    def one_step(self) -> bool:
        """True when the shared weights are one defended gradient (one plain SGD step): the
        attacks that run the defense itself on dummy data apply only then."""
        return self.local_steps == 1 and self.optimizer.plain

    @property
    def labels_shared(self) -> bool:
        return self.labels is not None

    @property
    def silent(self) -> bool:
        """True when the upload carries nothing to match: no buffers and every shared tensor
        zero in float32 (its squared norm underflows to 0), as when the model gives the private
        label probability 1. No attack can descend on it, and no attack failed on it."""
        return self.buffers is None and all(float(g.detach().float().pow(2).sum()) == 0.0 for g in self.gradients)

    @property
    def device(self) -> torch.device:
        return self.gradients[0].device

    @property
    def unknowns(self) -> int:
        """Private input values an attack must recover: batch size x values per input."""
        return self.batch_size * math.prod(self.input_shape)

    @property
    def gradient_entries(self) -> int:
        """Values in the shared gradient (all tensors together)."""
        return sum(g.numel() for g in self.gradients)

    def threat_model(self) -> Dict[str, Any]:
        """What the attacker was given, for the report."""
        return {
            "model": "white-box (architecture, parameters and buffers at the audited step)",
            "shared": self.shared_description(),
            "shares": self.shares,
            "local_optimizer": self.optimizer.describe(),
            "local_batch_size": self.local_batch_size,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "batch_size": self.batch_size,
            "labels_shared": self.labels_shared,
            "local_steps": self.local_steps,
            "local_lr": self.local_lr,
            "defense_mechanism_known": self.defense is not None,
            "defense_randomness_known": False,
            "training_step": self.step,
            "client_mode": self.client_mode,
            "extras": sorted(self.extra),
        }

    def shared_description(self) -> str:
        """What the client uploaded, in one phrase."""
        if self.shares == "gradient":
            return "defended gradient (FedSGD)"
        how = ("full batch" if self.local_batch_size is None else f"mini-batches of {self.local_batch_size}")
        if self.local_steps > 1:
            how = f"lr {self.local_lr}, {how}"
        update = (f"defended update after {self.local_steps} local step(s) of {self.optimizer.describe()} "
                  f"({how}), weights only")
        if self.shares == "update":
            return update
        return update.replace("weights only", f"weights and {len(self.buffers)} buffer(s) (the client's state)")


# --------------------------------------------------------------------------- attacks
@dataclass
class Reconstruction:
    """An attack's output: images in [0, 1] ``(B, C, H, W)``, labels ``(B,)``, and its
    :class:`~audit.core.trace.Trace` (loss history, chosen restart, timings, ...; a plain dict
    given here becomes one). ``applicable=False`` with a ``reason`` when the attack does not
    apply to the observation: a :class:`~audit.core.reasons.Reason` (a code and its values; the
    report words it)."""

    inputs: Optional[Tensor]
    labels: Optional[Tensor]
    trace: Trace = field(default_factory=Trace)
    applicable: bool = True
    reason: Optional[Reason] = None

    def __post_init__(self):
        self.trace = Trace.from_dict(self.trace)
        if self.reason is not None:
            self.reason = Reason.of(self.reason)

    @classmethod
    def not_applicable(cls, reason: Reason, **trace: Any) -> "Reconstruction":
        """Why the attack does not apply (``reason``), with ``trace`` entries beside it."""
        return cls(None, None, dict(trace), applicable=False, reason=Reason.of(reason))


@runtime_checkable
class Attack(Protocol):
    """``attack.reconstruct(observation, budget, seed) -> Reconstruction``.

    ``budget`` is counted in gradient evaluations of the audited model
    (:data:`BUDGET_DEFINITION`); each attack maps it to its own iterations. Attacks never see
    the private data.
    """

    name: str

    def reconstruct(self, observation: Observation, budget: int, seed: int) -> Reconstruction: ...
