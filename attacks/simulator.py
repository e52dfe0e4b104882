"""The shared-gradient simulator: dummy data -> what the client would have shared.

This is THE extension point of adaptive attacks. The default :class:`GradientSimulator`
returns the clean gradient of the observation's model (FedAvg: it unrolls ``local_steps``
differentiable local updates and returns the accumulated update in the units of
``observation.gradients``), then applies its ``transforms`` one after another. An adaptive
attack either

* appends a transform ``t(grads, context) -> grads`` (mask replay, layer dropping, a
  differentiable re-implementation of the defense, ...), or
* subclasses :class:`GradientSimulator` and overrides :meth:`client_gradients`
  (e.g. :class:`DefenseSimulator` runs the defense callable itself).

Two execution paths share this code. ``functional=True`` differentiates with
``torch.func.grad`` and is called under ``torch.func.vmap`` over the restart dimension
(batched restarts); ``functional=False`` uses ``torch.autograd.grad(create_graph=True)``
for one restart at a time (the sequential fallback for code that cannot be vmapped).
A simulator or transform that cannot run under vmap sets ``vmappable = False``.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, replace_all_batch_norm_modules_

from audit.core.defense_call import invoke_defense, invoke_defense_many
from audit.core.reasons import Reason
from audit.core.errors import ConfigError, NotApplicable
from audit.core.registry import Registry
from audit.core.types import Observation
from audit.core.unroll import client_update  # the replica unrolls like the client (attacks.local_surrogate)
from attacks.local_surrogate import replica_optimizer

SIMULATORS = Registry("simulator")

GradTransform = Callable[[List[Tensor], "SimContext"], Sequence[Tensor]]
_NORM_TYPES = (nn.modules.batchnorm._BatchNorm,)


@dataclass
class SimContext:
    """What a transform may use: the observation, a seeded generator, the iteration.
    ``capture_features``: record BatchNorm input statistics (set when a prior needs them);
    ``capture_softmax``: record the first local step's softmax (the features term's reading)."""

    observation: Observation
    generator: Optional[torch.Generator] = None
    iteration: int = 0
    capture_features: bool = True
    capture_softmax: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)
    #: the tensors of the observation being matched that the transforms read
    #: (:meth:`GradientSimulator.observed_data`); per member under vmap
    observed: List[Tensor] = field(default_factory=list)


class ClientReplica:
    """A private copy of the observation's model set up as the client ran it.

    ``mode`` is ``observation.client_mode``: in ``"train"`` mode BatchNorm uses batch
    statistics and (on the copy only) its running statistics are dropped, because
    vmap cannot update them in place; in ``"eval"`` mode the copied buffers are used as is.
    The observation's model is never mutated. Forward pre-hooks on every BatchNorm layer
    record the mean / variance of its input (for the BN-statistics prior).
    """

    def __init__(self, observation: Observation):
        mode = observation.client_mode
        if mode not in ("train", "eval"):
            raise ConfigError(f"observation.client_mode must be 'train' or 'eval', got {mode!r}")
        self.observation = observation
        self.loss_fn = observation.loss_fn
        #: the client's optimiser as the replica unrolls it (:mod:`attacks.local_surrogate`)
        self.optimizer = replica_optimizer(observation.optimizer)
        self.bn_running = _running_stats(observation.model)
        model = copy.deepcopy(observation.model)
        model.train(mode == "train")
        if mode == "train":
            replace_all_batch_norm_modules_(model)
        self.model = model
        named = dict(model.named_parameters())
        self.names = [n for n, p in named.items() if p.requires_grad]
        self.params: Dict[str, Tensor] = {n: named[n].detach() for n in self.names}
        self.frozen: Dict[str, Tensor] = {
            **{n: p.detach() for n, p in named.items() if not p.requires_grad},
            **dict(model.named_buffers()),
        }
        self._eager_params: Optional[Dict[str, Tensor]] = None
        self._capture: Optional[List[Tuple[Tensor, Tensor]]] = None
        #: values per channel behind each recorded statistic (the unbiased variance needs it)
        self.capture_counts: List[int] = []
        self.norm_layers = [m for m in model.modules() if isinstance(m, _NORM_TYPES)]
        for m in self.norm_layers:
            m.register_forward_pre_hook(self._record_input_stats)

    # -- parameters for the two execution paths
    @property
    def eager_params(self) -> Dict[str, Tensor]:
        """Leaf copies of the parameters that require grad (for torch.autograd)."""
        if self._eager_params is None:
            self._eager_params = {n: p.clone().requires_grad_(True) for n, p in self.params.items()}
        return self._eager_params

    def channels_last(self) -> None:
        """Lay the 4-D (convolution) parameters out channels-last for the functional path
        (the values are unchanged; compiled CPU graphs convolve faster in that layout)."""
        self.params = {n: p.contiguous(memory_format=torch.channels_last) if p.dim() == 4 else p
                       for n, p in self.params.items()}

    def forward(self, params: Dict[str, Tensor], x: Tensor) -> Tensor:
        return functional_call(self.model, (params, self.frozen), (x,), strict=False)

    # -- feature capture
    def _record_input_stats(self, module, inputs):
        if self._capture is not None:
            x = inputs[0]
            dims = [0] + list(range(2, x.dim()))
            self._capture.append((x.mean(dims), x.var(dims, unbiased=False)))
            self.capture_counts.append(x.numel() // x.shape[1])

    @contextlib.contextmanager
    def capturing(self, enabled: bool = True) -> Iterator[List[Tuple[Tensor, Tensor]]]:
        """Collect ``(mean, var)`` of every BatchNorm input during the block."""
        saved, out = self._capture, []
        self._capture = out if enabled else None
        if enabled:
            self.capture_counts = []
        try:
            yield out
        finally:
            self._capture = saved


def _running_stats(model: nn.Module) -> Optional[List[Tuple[Tensor, Tensor]]]:
    stats = []
    for m in model.modules():
        if isinstance(m, _NORM_TYPES):
            if m.running_mean is None or m.running_var is None:
                return None
            stats.append((m.running_mean.detach().clone(), m.running_var.detach().clone()))
    return stats or None


def param_grads(
    replica: ClientReplica, params: Dict[str, Tensor], x: Tensor, y: Tensor, *,
    functional: bool, capture: bool = False, create_graph: bool = True, softmax: Optional[List[Tensor]] = None,
) -> Tuple[Dict[str, Tensor], List[Tuple[Tensor, Tensor]]]:
    """Gradient of the client's loss w.r.t. ``params`` at ``(x, y)`` (+ captured BN input stats).

    ``functional`` selects ``torch.func.grad`` (vmappable) or ``torch.autograd.grad``; a list
    ``softmax`` receives the model's softmax at ``x``, detached.
    """

    def loss_of(p):
        with replica.capturing(capture) as feats:
            out = replica.forward(p, x)
            loss = replica.loss_fn(out, y)
        return loss, (list(feats), torch.softmax(out.detach(), -1))

    if functional:
        grads, (feats, probs) = torch.func.grad(loss_of, has_aux=True)(params)
    else:
        loss, (feats, probs) = loss_of(params)
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=create_graph, allow_unused=True)
        grads = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), grads)}
    if softmax is not None:
        softmax.append(probs)
    return grads, feats


def unbiased(stats: List[Tuple[Tensor, Tensor]], counts: Sequence[int]) -> List[Tuple[Tensor, Tensor]]:
    """``(mean, biased var)`` per layer -> ``(mean, unbiased var)``, as BatchNorm's running
    variance records it (``counts``: values per channel of each layer's input)."""
    return [(m, v * (n / max(1, n - 1))) for (m, v), n in zip(stats, counts)]


class GradientSimulator:
    """Dummy ``(x, y)`` -> the gradients the client would have shared (see module docstring).

    ``transforms`` are applied in order to the clean (FedAvg-accumulated) gradient; each is
    ``t(grads: list[Tensor], context: SimContext) -> list[Tensor]`` and should be pure torch
    so it runs under vmap (otherwise give it ``vmappable = False``).
    """

    vmappable = True

    def __init__(self, transforms: Sequence[GradTransform] = (), step_transforms: Sequence[GradTransform] = ()):
        self.transforms = list(transforms)
        # applied to every local step's gradient before it is accumulated (a defense the client
        # applies per step, e.g. replayed by adaptive attacks under FedAvg)
        self.step_transforms = list(step_transforms)

    @property
    def batchable(self) -> bool:
        """True when the whole chain can run under ``torch.func.vmap``."""
        return self.vmappable and all(getattr(t, "vmappable", True)
                                      for t in self.transforms + self.step_transforms)

    def prepare(self, observation: Observation) -> ClientReplica:
        return ClientReplica(observation)

    def client_gradients(self, replica: ClientReplica, x: Tensor, y: Tensor, *, functional: bool,
                         context: SimContext) -> Tuple[List[Tensor], Dict[str, Any]]:
        """The clean shared update (unrolled through the client's optimiser) and the features:
        ``bn``, the BatchNorm input statistics of the first step; ``bn_steps``, every step's
        mean and unbiased variance (what the uploaded buffers mix)."""
        obs = replica.observation
        feats: Dict[str, Any] = {"bn_steps": []}
        params = replica.params if functional else replica.eager_params

        def step(p, xb, yb, k):
            probs = [] if k == 0 and context.capture_softmax else None
            g, bn = param_grads(replica, p, xb, yb, functional=functional, capture=context.capture_features,
                                softmax=probs)
            if k == 0:
                feats["bn"] = bn
                if probs:
                    feats["softmax"] = probs[0]
            feats["bn_steps"].append(unbiased(bn, replica.capture_counts))
            for transform in self.step_transforms:
                g = dict(zip(g, transform(list(g.values()), context)))
            return g

        grads = client_update(step, params, x, y, steps=obs.local_steps, lr=obs.local_lr,
                              batch_size=obs.local_batch_size, optimizer=replica.optimizer)
        return grads, feats

    def __call__(self, replica: ClientReplica, x: Tensor, y: Tensor, *, functional: bool,
                 context: SimContext) -> Tuple[List[Tensor], Dict[str, Any]]:
        grads, feats = self.client_gradients(replica, x, y, functional=functional, context=context)
        observed, offset = context.observed, 0
        for transform in self.transforms:
            count = len(getattr(transform, "observed_slots", ()))
            if count:  # the transform reads its own slice of the observation's tensors
                transform_context = copy.copy(context)
                transform_context.observed = observed[offset:offset + count]
                offset += count
                grads = list(transform(grads, transform_context))
            else:
                grads = list(transform(grads, context))
        return grads, feats

    def observed_data(self, observation: Observation) -> List[Tensor]:
        """Tensors the transforms read from each observation (``transform.observed(observation)``,
        one per entry of its ``observed_slots``). The run hands them to the transform through
        ``context.observed`` with the observation's target, so a grouped run (one vmap over
        observations) gives every member its own, e.g. the subspaces of its own gradient."""
        out: List[Tensor] = []
        for transform in self.transforms:
            slots = getattr(transform, "observed_slots", ())
            if slots:
                data = list(transform.observed(observation))
                if len(data) != len(slots):
                    raise ConfigError(f"{getattr(transform, '__name__', transform)}: observed() gave {len(data)} "
                                      f"tensors for its {len(slots)} observed_slots")
                out += data
        return out

    def gradient_evaluations(self, observation: Observation) -> int:
        """Model gradients one call costs (one per local step; the budget's unit)."""
        return max(1, int(observation.local_steps))

    def describe(self) -> str:
        names = [getattr(t, "__name__", type(t).__name__) for t in self.transforms]
        names = [f"per step {getattr(t, '__name__', type(t).__name__)}" for t in self.step_transforms] + names
        return type(self).__name__ + (f"[{' -> '.join(names)}]" if names else "")


class DefenseSimulator(GradientSimulator):
    """Runs the observation's defense callable on the dummy data (white-box, adaptive).

    The defense computes its gradient with ``torch.autograd`` itself, so this path is never
    vmapped (sequential restarts); its randomness comes from ``context.generator``, and a
    defense that takes the FL round gets the observation's (``round=observation.step``).
    Single local step only.
    """

    vmappable = False

    @staticmethod
    def _check(obs: Observation) -> None:
        if obs.defense is None:
            raise NotApplicable(Reason("simulator-needs-defense"))
        if not obs.one_step:
            raise NotApplicable(Reason("simulator-one-step", steps=obs.local_steps,
                                       optimizer=obs.optimizer.describe()))

    def client_gradients(self, replica, x, y, *, functional, context):
        obs = replica.observation
        self._check(obs)
        with replica.capturing(context.capture_features) as bn:
            grads = invoke_defense(obs.defense, replica.model, x, y, loss_fn=replica.loss_fn,
                                   generator=context.generator, round=obs.step)
        return list(grads), {"bn": list(bn), "bn_steps": [unbiased(bn, replica.capture_counts)]}

    def many_members(self, replica: ClientReplica, xs: Tensor, ys: Tensor, context: SimContext,
                     draws: int = 0) -> Tuple[List[Tensor], Dict[str, Tensor]]:
        """The defended gradients of every member's dummy batch ``xs[m]`` (labels ``ys[m]``) from one
        batched defense call (``Defense.many``), per parameter ``(M, *shape)``, or ``(M, draws,
        *shape)`` with ``draws`` >= 1 (EOT), differentiable w.r.t. ``xs``; and per-member
        features (``{name: (M, ...)}``, none here)."""
        obs = replica.observation
        self._check(obs)
        stacked = invoke_defense_many(obs.defense, replica.model, xs, ys, draws=max(1, draws),
                                      loss_fn=replica.loss_fn, generator=context.generator, round=obs.step)
        return (list(stacked) if draws else [g[:, 0] for g in stacked]), {}

    def cannot_stack(self, observation: Observation) -> Optional[Reason]:
        """Why the members cannot share one defense call (None when they can)."""
        return Reason("transforms-each-member") if self.transforms else None

    def batched_draws(self, replica: ClientReplica, xs: Tensor, y: Tensor, draws: int,
                      context: SimContext) -> Optional[List[Tensor]]:
        """``draws`` defended gradients of each dummy batch ``xs[i]``, per parameter ``(len(xs),
        draws, *shape)``, from one batched defense call (``Defense.many``); the generator is
        consumed as by the calls one after another. None where the calls must run one by one:
        a prior needs the BatchNorm statistics of each call's own forward passes."""
        obs = replica.observation
        self._check(obs)
        if context.capture_features and replica.norm_layers:
            return None
        labels = y.unsqueeze(0).expand(len(xs), *y.shape)
        return invoke_defense_many(obs.defense, replica.model, xs, labels, draws=draws, loss_fn=replica.loss_fn,
                                   generator=context.generator, round=obs.step)


SIMULATORS.add("clean", GradientSimulator, "clean gradient of the observation's model (FedAvg unrolled)")
SIMULATORS.add("defense", DefenseSimulator, "the dummy data goes through the observation's defense callable")
