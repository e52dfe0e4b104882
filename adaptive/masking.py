"""Attacks that change which parts of the gradient are matched.

* ``mask-replay`` -- the pruning mask is read from the exact zeros of the observed gradient
  and applied to the dummy gradient (magnitude pruning, Soteria's masked layer, DGP).
* ``layer-drop`` -- the layers a defense perturbs get weight 0 in the objective (Soteria).
  ``layers="auto"``: with white-box access the defense is run on the observation's model
  with a random batch and the layers it changes are dropped; without it every weight
  tensor is tried in turn and the run with the lowest final matching loss is kept.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

from attacks.objectives import OBSERVED
from attacks.optimization import Progress
from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.core.types import Observation, Reconstruction, trainable_names

from adaptive.adapted import Adaptation, AdaptedAttack, register
from adaptive.planner.probe import changed_parameters


class MaskReplay(AdaptedAttack):
    """Match only where the observed gradient is non-zero (the mask the defense applied)."""

    name = "mask-replay"
    owns = ("masks",)

    def adapt(self, observation: Observation) -> Adaptation:
        masks = [(g != 0) if bool((g == 0).any()) else None for g in observation.gradients]
        if all(m is None for m in masks):
            return Adaptation(skip=Reason("mask-no-zeros"))
        names = trainable_names(observation.model)
        kept = {n: round(float(m.float().mean()), 4) for n, m in zip(names, masks) if m is not None}
        # the objective reads each observation's mask from its own target (masks=observed), so
        # every observation gets the same knobs and a step's images run as one group
        return Adaptation({"masks": OBSERVED}, {"kept_fraction": kept})


class LayerDrop(AdaptedAttack):
    """Drop the defended layers from the objective (per-layer weight 0)."""

    name = "layer-drop"
    owns = ("weights",)

    def __init__(self, layers: Union[str, Sequence[Union[int, str]]] = "auto", base: str = "ig", **knobs):
        super().__init__(base, **knobs)
        if isinstance(layers, str) and layers not in ("auto", "search"):
            layers = [layers]
        self.layers = layers

    def _indices(self, observation: Observation) -> Optional[List[int]]:
        """The tensors to drop; None means "search over every weight tensor"."""
        names = trainable_names(observation.model)
        if self.layers == "search" or (self.layers == "auto" and observation.defense is None):
            return None
        if self.layers == "auto":
            return changed_parameters(observation.defense, observation.model, observation.input_shape,
                                      observation.num_classes, batch_size=observation.batch_size,
                                      loss_fn=observation.loss_fn)
        out = []
        for layer in self.layers:
            if isinstance(layer, int) and 0 <= layer < len(names):
                out.append(layer)
            elif layer in names:
                out.append(names.index(layer))
            else:
                raise ConfigError(f"layer-drop: {layer!r} is not a trainable tensor of the model; "
                                  f"valid: {', '.join(names)} (or their indices)")
        return out

    @staticmethod
    def _weights(n: int, drop: Sequence[int]) -> List[Optional[float]]:
        return [0.0 if i in drop else None for i in range(n)]

    def adapt(self, observation: Observation) -> Adaptation:
        names = trainable_names(observation.model)
        drop = self._indices(observation)
        if drop is None:
            return Adaptation(notes={"mode": "search"})
        if not drop:
            return Adaptation(skip=Reason("drop-no-layer-changed"))
        if len(drop) == len(names):
            return Adaptation(skip=Reason("drop-every-layer-changed"))
        return Adaptation({"weights": self._weights(len(names), drop)},
                          {"dropped": [names[i] for i in drop],
                           "detected": "given" if isinstance(self.layers, (list, tuple)) else
                           "probed the known defense on the observation's model"})

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Progress] = None) -> Reconstruction:
        return self.reconstruct_many([observation], budget, [seed], progress)[0]

    def reconstruct_many(self, observations: Sequence[Observation], budget: Optional[int] = None,
                         seeds: Optional[Sequence[int]] = None, progress: Optional[Progress] = None,
                         max_members: int = 64) -> List[Reconstruction]:
        """Detected or given layers: one batched run. Search: one batched run over the
        observations per candidate tensor; each keeps its lowest final matching loss."""
        seeds = list(seeds) if seeds is not None else [0] * len(observations)
        adaptations = [self.adapt(o) for o in observations]
        if any(a.notes.get("mode") != "search" for a in adaptations):
            return self.adapted_many(observations, adaptations, budget, seeds, progress, max_members)
        first = observations[0]
        names = trainable_names(first.model)
        candidates = [i for i, g in enumerate(first.gradients) if g.dim() >= 2]
        best: List[Optional[Tuple[str, Reconstruction]]] = [None] * len(observations)
        losses: List[Dict[str, float]] = [{} for _ in observations]
        for i in candidates:
            attack = self.compose(first, Adaptation({"weights": self._weights(len(names), [i])}))
            for k, rec in enumerate(attack.reconstruct_many(observations, budget, seeds, progress,
                                                            max_members=max_members)):
                losses[k][names[i]] = float(rec.trace["final_terms"]["match"])
                if best[k] is None or losses[k][names[i]] < losses[k][best[k][0]]:
                    best[k] = (names[i], rec)
        out = []
        for (name, rec), tried in zip(best, losses):
            rec.trace["adaptive"] = {"attack": self.name, "base": self.base, "mode": "search",
                                     "dropped": [name], "match_loss_per_candidate": tried,
                                     "selection": Reason("lowest-matching-loss").to_dict()}
            out.append(rec)
        return out


register(MaskReplay, "prune-mask replay: match only where the observed gradient is non-zero")
register(LayerDrop, "drop the defended layers from the objective (detected, given, or searched)")
