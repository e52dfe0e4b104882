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
from typing import List, Sequence

from torch import Tensor

from audit.core.types import Defense

from defenses.clip import clip_by_norm
from defenses.common import check_range
from defenses.dpsgd import PrivacySpent, privacy_spent
from defenses.noise import add_noise, gaussian_log_density
from defenses.registry import DEFENSES

def mirror_differences(action: str) -> tuple:
    """Where the mirror of a Flower mod that ``action`` (e.g. "clips") the update departs from it."""
    return (
        f"Flower {action} the round's whole update after local training; the mirror models one local SGD step with "
        "learning rate lr (update = -lr * gradient) and shares the update in gradient units (-update / lr).",
        f"Flower's update covers every array of the ArrayRecord (buffers such as BatchNorm statistics included); the "
        f"mirror {action} the trainable parameters' update, the same transform for a model whose state is its "
        "trainable parameters.",
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
    buffer_effect = "untouched"  # audit.core.buffers.BUFFER_EFFECTS
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


@DEFENSES.register("flower-localdp",
                   "Flower's LocalDpMod: clip the one-step update to clipping_norm, add Gaussian noise of std "
                   "sensitivity*sqrt(2 ln(1.25/delta))/epsilon (clipping_norm=1, sensitivity=1, epsilon=1, "
                   "delta=1e-5, lr=0.1)")
class FlowerLocalDP(FlowerFixedClipping):
    """Flower's local DP: the clipped update plus ``N(0, s^2)`` per entry, i.e. the gradient
    clipped to ``clipping_norm / lr`` plus ``N(0, (s / lr)^2)``; declares its exact
    likelihood and its (epsilon, delta) accounting (see the module docstring)."""

    name = "flower-localdp"
    buffer_effect = "noised"  # LocalDpMod noises every array of the reply, buffers included
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

    @property
    def buffer_noise_std(self) -> float:
        """The noise on every uploaded buffer: LocalDpMod noises each array of the reply with
        ``noise_std`` (buffers are sent as they are, not in gradient units)."""
        return self.noise_std

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
