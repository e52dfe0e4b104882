"""Learning to invert: a network trained to map the *defended* gradient to the input.

Works for any defense callable (it never differentiates through it): auxiliary images
(declared in ``observation.extra["aux_images"]`` or the default data set's *train* split)
go through one client round each with the observation's model and defense; a fixed seeded
sparse projection (:mod:`adaptive.inverter.sketch`) turns every shared gradient into a few
thousand features, and an MLP (:mod:`adaptive.inverter.net`) learns features -> images.
The trained inverter is cached on disk (:mod:`adaptive.inverter.cache`) per model
architecture + parameters (the training step), defense and settings, so the CLI and every
image of an audit step reuse one training run.

Cost: inverting an observation takes no gradient evaluation of the model; the one-off
training (``pairs`` defended gradients x local steps, then ``train_steps`` steps of the MLP)
is set-up shared by every image of a step, like a generative attack's generator, so it is
reported in the trace (``setup_gradient_evaluations``) and not charged to the per-image
``budget`` (:data:`audit.core.types.BUDGET_DEFINITION`). ``train_steps=0`` gives the
untrained network (a baseline).
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from attacks.optimization import Progress, validate_observation
from attacks.labels import infer_labels
from attacks.presets import ATTACKS
from audit.core.errors import ConfigError, NotApplicable
from audit.core.reasons import Reason
from audit.core.types import Observation, Reconstruction

from adaptive.inverter.cache import (cache_key, cache_path, defense_fingerprint, load_entry,
                             model_fingerprint, save_entry)
from adaptive.inverter.data import auxiliary_data, auxiliary_fingerprint
from adaptive.inverter.pairs import defended_features, pair_indices
from adaptive.inverter.net import InverterNet, init_inverter, train_inverter
from adaptive.inverter.sketch import GradientSketch, flatten_gradients


@dataclass(frozen=True)
class InverterSettings:
    """Everything that shapes a trained inverter (all of it is part of the cache key)."""

    sketch_dim: int = 2048  # features: the gradient is projected to this many dimensions
    sketch_hashes: int = 2  # buckets per gradient entry in the sparse sign projection
    sketch_seed: int = 0
    hidden: int = 512  # MLP width
    depth: int = 2  # hidden layers
    pairs: int = 1024  # (defended gradient, auxiliary batch) training pairs
    batch_size: int = 64  # pairs per inverter training step
    lr: float = 1e-3
    train_seed: int = 0  # pairs, defense randomness, network init and mini-batches
    aux_dataset: str = "embedded"  # default auxiliary data (its train split)
    aux_limit: Optional[int] = 4096  # at most this many auxiliary images (a seeded random subset)

    def __post_init__(self):
        for name in ("sketch_dim", "sketch_hashes", "hidden", "depth", "pairs", "batch_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"learned-inverter: {name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"learned-inverter: lr must be > 0, got {self.lr}")
        if self.aux_limit is not None and self.aux_limit < 1:
            raise ConfigError(f"learned-inverter: aux_limit must be >= 1 or None, got {self.aux_limit}")


@dataclass
class TrainedInverter:
    """A trained (or loaded) inverter with its projection and what it was trained on."""

    net: InverterNet
    sketch: GradientSketch
    info: Dict[str, Any]

    @torch.no_grad()
    def invert(self, gradients) -> torch.Tensor:
        """Images ``(B, C, H, W)`` in [0, 1] from one shared gradient (per-parameter tensors)."""
        features = self.sketch(flatten_gradients([g.detach().float() for g in gradients])).unsqueeze(0)
        return self.net(features)[0]


class LearnedInverter:
    """The ``learned-inverter`` attack (see the module docstring).

    ``cache_dir`` overrides ``$GIA_AUDIT_CACHE`` / ``~/.cache/gia-audit``; ``cache=False``
    always trains. ``progress`` shows tqdm bars for the pair generation and the training
    (unless :meth:`reconstruct` gets a progress callback, as the optimisation attacks do).
    ``iterations`` is the default number of training steps (the budget).
    """

    name = "learned-inverter"

    def __init__(self, *, train_steps: int = 200, cache: bool = True, cache_dir: Optional[str] = None,
                 progress: bool = True, **settings: Any):
        unknown = set(settings) - set(InverterSettings.__dataclass_fields__)
        if unknown:
            raise ConfigError(f"learned-inverter has no setting {', '.join(sorted(unknown))}; valid: "
                              f"train_steps, cache, cache_dir, progress, "
                              f"{', '.join(InverterSettings.__dataclass_fields__)}")
        if train_steps < 0:
            raise ConfigError(f"learned-inverter: train_steps must be >= 0, got {train_steps}")
        self.settings = InverterSettings(**settings)
        self.iterations, self.cache, self.cache_dir, self.progress = int(train_steps), bool(cache), cache_dir, progress

    # ------------------------------------------------------------------ training (cached)
    def fit(self, observation: Observation, steps: Optional[int] = None,
            progress: Optional[Progress] = None) -> TrainedInverter:
        """The inverter for this observation's model, defense and metadata: from the cache
        when it was trained before, else trained now (and cached). ``progress(done, total,
        loss)`` is called after each training step."""
        steps = self.iterations if steps is None else int(steps)
        if steps < 0:
            raise ConfigError(f"learned-inverter: budget (training steps) must be >= 0, got {steps}")
        s = self.settings
        images, labels, source = auxiliary_data(observation, s.aux_dataset, s.aux_limit, s.train_seed)
        key_parts = self._key_parts(observation, images, labels, steps)
        key = cache_key(key_parts)
        path = cache_path(key, self.cache_dir)
        input_dim = observation.gradient_entries
        sketch = GradientSketch(input_dim, s.sketch_dim, s.sketch_hashes, s.sketch_seed)
        out_shape = (observation.batch_size, *observation.input_shape)
        net = init_inverter(sketch.out_dim, out_shape, s.hidden, s.depth, s.train_seed, observation.device)
        entry = load_entry(path) if self.cache else None
        if entry is not None:
            net.load_state_dict(entry["state"])
            net.eval()
            return TrainedInverter(net, sketch, {**entry["info"], "cache": "loaded", "cache_path": str(path)})
        info = self._train(net, sketch, observation, images, labels, steps, progress)
        info.update(aux=source, key=key, steps=steps, settings=asdict(s), defense=key_parts["defense"])
        if self.cache:
            save_entry(path, {"state": {k: v.detach().cpu() for k, v in net.state_dict().items()}, "info": info})
            info.update(cache="saved", cache_path=str(path))
        else:
            info["cache"] = "off"
        return TrainedInverter(net, sketch, info)

    def _key_parts(self, observation: Observation, images, labels, steps: int) -> Dict[str, Any]:
        obs = observation
        return {
            "model": model_fingerprint(obs.model),
            "defense": defense_fingerprint(obs.defense),
            "client": {"input_shape": list(obs.input_shape), "num_classes": obs.num_classes,
                       "batch_size": obs.batch_size, "local_steps": obs.local_steps, "local_lr": obs.local_lr,
                       "local_batch_size": obs.local_batch_size, "client_mode": obs.client_mode,
                       "optimizer": obs.optimizer.describe(),
                       "loss_fn": getattr(obs.loss_fn, "__qualname__", repr(obs.loss_fn))},
            "aux": auxiliary_fingerprint(obs, images, labels),
            "settings": asdict(self.settings),
            "train_steps": steps,
        }

    def _train(self, net: InverterNet, sketch: GradientSketch, observation: Observation, images, labels,
               steps: int, progress: Optional[Progress]) -> Dict[str, Any]:
        s = self.settings
        bars = self.progress and progress is None
        cpu_gen = torch.Generator().manual_seed(s.train_seed)
        defense_gen = torch.Generator(device=observation.device).manual_seed(s.train_seed)
        index = pair_indices(len(images), s.pairs, observation.batch_size, cpu_gen)
        info: Dict[str, Any] = {}
        features = defended_features(observation, images, labels, index, sketch, defense_gen,
                                                    bars, info)
        targets = images[index.to(images.device)]  # (P, B, C, H, W)
        net.fit_scaler(features)
        losses = train_inverter(net, features, targets, steps, batch_size=s.batch_size, lr=s.lr,
                                generator=cpu_gen, progress=bars, callback=progress)
        return {**info, "pairs": len(index), "aux_images": len(images),
                "final_train_mse": losses[-1] if losses else None,
                "train_loss_first_last": [losses[0], losses[-1]] if losses else []}

    # ------------------------------------------------------------------ the attack
    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Progress] = None) -> Reconstruction:
        """Invert the shared gradient with the (cached) inverter trained for ``train_steps``.

        ``budget`` (gradient evaluations per image) is not consumed: inversion costs none,
        training is set-up (see the module docstring). ``seed`` does not change the result: the
        inverter is deterministic given its settings (``train_seed``), which is what lets every
        image of a step share it.
        """
        validate_observation(observation)
        inverter = self.fit(observation, None, progress)
        images = inverter.invert(observation.gradients).clamp(0, 1)
        labels, label_note = _labels(observation, images)
        trace = {"attack": self.name, "inverter": inverter.info, "labels": label_note, "gradient_evaluations": 0,
                 "setup_gradient_evaluations": self.settings.pairs * max(1, int(observation.local_steps)),
                 "threat_model_extras": {"auxiliary_data": inverter.info.get("aux")}}
        return Reconstruction(images, labels, trace)


def _labels(observation: Observation, images: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """Shared / inferred labels; where the defense leaves nothing to infer them from, the
    audited model's prediction on the reconstruction."""
    try:
        note = Reason("labels-inferred").to_dict()
        return infer_labels(observation, seed=0).labels, {"method": "inferred", "note": note}
    except NotApplicable as err:
        with torch.no_grad():  # on a copy in eval mode: BatchNorm buffers stay untouched
            pred = copy.deepcopy(observation.model).eval()(images).argmax(1)
        return pred, {"method": "predicted", "note": Reason("labels-predicted").to_dict(), "why": err.reason.to_dict()}


def applies(traits) -> Tuple[bool, Reason]:
    """Whether the planner should offer ``learned-inverter`` for a probed defense
    (:class:`adaptive.planner.traits.DefenseTraits`), and why (a code, with what the defense does
    to the gradient). It works for any defense; it is worth its training cost where gradient
    matching has little to hold on to."""
    if traits.identity:
        return False, Reason("inverter-no-perturbation")
    causes = [cause for flag, cause in (
        (traits.sign_only, "sign-only"),
        (traits.quantized and not traits.sign_only, "quantized"),
        (traits.sparse, "sparse"),
        (traits.low_rank, "low-rank"),
        (not traits.differentiable, "not-differentiable"),
        (traits.stochastic, "stochastic"),
        (traits.architectural, "architectural"),
    ) if flag]
    return True, Reason("inverter-learns", causes=causes, sparsity=traits.sparsity)


ATTACKS.add("learned-inverter", LearnedInverter,
            "learning to invert: an MLP trained on (defended gradient, image) pairs of auxiliary data; cached")
