"""Flower's client-side update defenses, mirrored on the defended-gradient contract.

Flower's ``LocalDpMod`` and ``fixedclipping_mod`` (``flwr.clientapp.mod``) act on the client's
*update* ``u = theta_new - theta_old`` after local training: they clip it to L2 norm
``clipping_norm`` over all arrays together (``u * min(1, C / ||u||)``) and ``LocalDpMod`` then
adds ``N(0, s^2)`` to every entry with ``s = sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon``.
They need no ``flwr`` here: these classes apply the same transform to what our client shares.

The mapping: a client that takes one local SGD step with learning rate ``lr`` sends
``u = -lr * g`` (``g`` the gradient of its batch), and the server, knowing ``lr``, reads the
update as the gradient ``-u / lr``. Clipping ``u`` to ``C`` is clipping ``g`` to ``C / lr``;
noise of std ``s`` on ``u`` is noise of std ``s / lr`` on ``g`` (the sign of a centred
Gaussian does not matter). So the shared gradient is ``clip(g, C / lr) + N(0, (s / lr)^2)``:
exactly Flower's transform of the one-step update, expressed in gradient units. Audit them
with one local step (``local_steps=1``, FedSGD): the mods clip the round's whole update, not
each local step.

Privacy: two updates clipped to ``C`` differ by at most ``2 C`` in L2, whichever example (or
candidate image) is swapped for another, so the noise multiplier of the accounting is
``s / (2 C)``; :meth:`FlowerLocalDP.privacy` gives the RDP (epsilon, delta) of ``steps``
noised updates with it (:func:`defenses.dpsgd.privacy_spent`). Flower calibrates ``s`` to the
deployment's declared ``sensitivity``; the per-round ``(epsilon, delta)`` it states holds when
that sensitivity bounds the update's change.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.types import Defense

from defenses.clip import clip_by_norm
from defenses.common import check_range, global_norm
from defenses.dpsgd import PrivacySpent, privacy_spent
from defenses.noise import add_noise, gaussian_log_density
from defenses.registry import DEFENSES

def mirror_differences(action: str) -> tuple:
    """Where the mirror of a Flower mod that ``action`` (e.g. "clips") the update departs from it."""
    return (
        f"Flower {action} the round's whole update after local training; the mirror models one local SGD step with "
        "learning rate lr (update = -lr * gradient) and shares the update in gradient units (-update / lr).",
        f"Flower's update covers every array of the reply; the mirror {action} the weights' update and, where the "
        "client shares its state, the floating-point buffers' change with it (one norm over both); integer buffers "
        "(BatchNorm's num_batches_tracked) are left as they are.",
    )


def localdp_noise_std(sensitivity: float, epsilon: float, delta: float) -> float:
    """The std of ``LocalDpMod``'s Gaussian noise on the update:
    ``sensitivity * sqrt(2 ln(1.25 / delta)) / epsilon`` (the classical Gaussian mechanism)."""
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


@DEFENSES.register("flower-fixedclipping",
                   "Flower's fixedclipping_mod: clip the one-step update to clipping_norm (=1); lr=0.1")
class FlowerFixedClipping(Defense):
    """Flower's client-side fixed clipping: the update clipped to ``clipping_norm``, i.e. the
    gradient clipped to ``clipping_norm / lr`` (see the module docstring)."""

    name = "flower-fixedclipping"
    buffer_effect = "clipped"  # the buffers' change is clipped with the weights' (transform_state)
    stochastic = False
    whole_update = True  # the transform of a round's whole update: one local step, never per step
    differences = mirror_differences("clips")

    def __init__(self, clipping_norm: float = 1.0, lr: float = 0.1):
        self.clipping_norm = check_range(self.name, "clipping_norm", clipping_norm, 0, None, low_open=True)
        self.lr = check_range(self.name, "lr", lr, 0, None, low_open=True)

    @property
    def gradient_bound(self) -> float:
        """The clipping bound in gradient units: ``clipping_norm / lr``."""
        return self.clipping_norm / self.lr

    def transform(self, grads, *, generator=None, model=None) -> List[Tensor]:
        return clip_by_norm(grads, self.gradient_bound)

    def transform_state(self, update: Sequence[Tensor], buffers: Dict[str, Tensor], before: Dict[str, Tensor], *,
                        lr: float, generator=None) -> Tuple[List[Tensor], Dict[str, Tensor]]:
        """The mod on a reply that carries the client's state: ``update`` (the weights' update in
        gradient units, ``(theta_0 - theta_1) / lr``) and the floating-point ``buffers``' change
        from ``before`` scaled by ``min(1, clipping_norm / norm)``, the norm over every array's
        change as Flower computes it (integer buffers' counts included; those pass unscaled, as
        Flower's in-place scaling leaves a 0-d integer difference as it is), then :meth:`noise_state`."""
        steps = [-lr * u for u in update]
        names = [n for n, b in buffers.items() if b.is_floating_point()]
        moved = [buffers[n] - before[n] for n in names]
        counts = [(b - before[n]).double() for n, b in buffers.items() if not b.is_floating_point()]
        norm = global_norm([t.double() for t in steps + moved] + counts)
        factor = torch.clamp(self.clipping_norm / (norm + 1e-12), max=1.0)
        steps, moved = self.noise_state([t * factor.to(t.dtype) for t in steps],
                                        [t * factor.to(t.dtype) for t in moved], generator)
        out = dict(buffers)
        out.update({n: before[n] + m for n, m in zip(names, moved)})
        return [-t / lr for t in steps], out

    def noise_state(self, steps: List[Tensor], moved: List[Tensor], generator) -> Tuple[List[Tensor], List[Tensor]]:
        """The clipped arrays as the mod sends them (fixed clipping adds nothing)."""
        return steps, moved

    def without_noise(self) -> "FlowerFixedClipping":
        """The mod's clipping alone: what a reply is expected to be before any noise."""
        return FlowerFixedClipping(self.clipping_norm, self.lr)


@DEFENSES.register("flower-localdp",
                   "Flower's LocalDpMod: clip the one-step update to clipping_norm, add Gaussian noise of std "
                   "sensitivity*sqrt(2 ln(1.25/delta))/epsilon (clipping_norm=1, sensitivity=1, epsilon=1, "
                   "delta=1e-5, lr=0.1)")
class FlowerLocalDP(FlowerFixedClipping):
    """Flower's local DP: the clipped update plus ``N(0, s^2)`` per entry, i.e. the gradient
    clipped to ``clipping_norm / lr`` plus ``N(0, (s / lr)^2)``; declares its exact
    likelihood and its (epsilon, delta) accounting (see the module docstring)."""

    name = "flower-localdp"
    buffer_effect = "clipped and noised"  # LocalDpMod clips and noises every array of the reply (transform_state)
    vmap_draws = True  # its noise comes from defenses.common.randn (audit.core.randomness)
    differences = mirror_differences("clips and noises")

    def __init__(self, clipping_norm: float = 1.0, sensitivity: float = 1.0, epsilon: float = 1.0,
                 delta: float = 1e-5, lr: float = 0.1):
        super().__init__(clipping_norm, lr)
        self.sensitivity = check_range(self.name, "sensitivity", sensitivity, 0, None)
        self.epsilon = check_range(self.name, "epsilon", epsilon, 0, None, low_open=True)
        self.delta = check_range(self.name, "delta", delta, 0, 1, low_open=True, high_open=True)

    @property
    def noise_std(self) -> float:
        """The std of the noise Flower adds to every entry of the update."""
        return localdp_noise_std(self.sensitivity, self.epsilon, self.delta)

    def noise_state(self, steps: List[Tensor], moved: List[Tensor], generator) -> Tuple[List[Tensor], List[Tensor]]:
        """``N(0, noise_std^2)`` on every entry of the clipped weights' step and buffers' change
        (LocalDpMod noises each array of the reply; the buffers are sent as they are)."""
        if self.noise_std == 0:
            return steps, moved
        noised = add_noise(steps + moved, "gaussian", self.noise_std, generator)
        return noised[:len(steps)], noised[len(steps):]

    @property
    def gradient_noise_std(self) -> float:
        """The same noise in gradient units: ``noise_std / lr``."""
        return self.noise_std / self.lr

    @property
    def noise_multiplier(self) -> float:
        """Noise std over the update's L2 sensitivity ``2 * clipping_norm``."""
        return self.noise_std / (2 * self.clipping_norm)

    @property
    def stochastic(self) -> bool:  # sensitivity 0 adds no noise (as in Flower)
        return self.noise_std > 0

    @property
    def log_prob(self):
        """``log p(shared | clean)``: Gaussian around the clipped clean gradient (None without noise)."""
        return self._log_prob if self.noise_std > 0 else None

    def _log_prob(self, shared: Sequence[Tensor], clean: Sequence[Tensor]) -> Tensor:
        scale = self.gradient_noise_std
        return sum(gaussian_log_density(s - c, scale).sum()
                   for s, c in zip(shared, clip_by_norm(clean, self.gradient_bound)))

    def transform(self, grads, *, generator=None, model=None) -> List[Tensor]:
        clipped = clip_by_norm(grads, self.gradient_bound)
        if self.noise_std == 0:
            return clipped
        return add_noise(clipped, "gaussian", self.gradient_noise_std, generator)

    def privacy(self, steps: int, sample_rate: float, delta: float = 1e-5, accountant: str = "auto") -> PrivacySpent:
        """:func:`~defenses.dpsgd.privacy_spent` of ``steps`` noised updates at ``sample_rate``
        with noise multiplier ``noise_std / (2 * clipping_norm)``."""
        return privacy_spent(steps, sample_rate, self.noise_multiplier, delta, accountant=accountant)
