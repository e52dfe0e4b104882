"""SPEAR: exact recovery of a whole batch from the gradient of a linear layer followed by ReLU
(Dimitrov, Mueller, Baader, Vechev, NeurIPS 2024).

For ``Z = W X + b`` (``X``: ``n x B``) followed by ReLU, ``dW = dZ X^T`` has rank <= ``B`` and
``dZ[i, j] = 0`` wherever ``Z[i, j] <= 0``. With ``dW = L R`` (SVD, rank ``B``), ``dZ = L Q`` and
``X^T = Q^-1 R`` for an unknown invertible ``Q``, whose column ``q_j`` spans the kernel of any
``B - 1`` rows of ``L`` where column ``j`` of ``dZ`` is zero. The attack samples random
``(B-1)``-row subsets and their kernel directions; keeps those whose ``L q`` has more zeros
than the sampled ones (a one-dimensional kernel), ranked by how often each comes back; picks
``B`` independent ones and swaps in others while the ReLU activity the recovered batch
predicts (``Z > 0``) differs from the observed one (``dZ != 0``); fixes the scales from the
bias gradient (``db = L Q 1``); reads ``X^T = Q^-1 R`` and the labels; and stops at the
certificate: the batch and labels reproduce the upload (this layer's gradient and those
after it; the whole client update for FedAvg) within ``tolerance``.

An image whose zero rows are all zero rows of another image too (correlated ReLU patterns,
as untrained convolutions give) has no subset that isolates it. Where the layer's input is
features behind a ReLU, the search then reads the other side, the input's own zeros
(:mod:`attacks.spear_dual`); otherwise it ends without a certificate and says so. Where the
layer is the model's first (only Normalize / Flatten before it) its inputs are the images;
where convolutions come first they are each image's features (``trace["features"]``). Float64 throughout. Cost and noise: docs/strength.md (SPEAR).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError
from audit.core.reasons import Reason
from audit.core.types import Observation, Reconstruction, trainable_names

from attacks.analytic import input_blocker, layer_input_to_images, leaf_layers
from attacks.spear_algebra import Candidates, Layer, improve, low_rank_factors, sample_directions, scaled_mixing
from attacks.spear_dual import InputSide, default_input_samples
from attacks.labels import infer_labels
from attacks.presets import ATTACKS
from attacks.simulator import GradientSimulator, SimContext

#: relative error of the reproduced upload under which the recovered batch is certified exact
CERTIFICATE_TOLERANCE = 1e-3
#: an entry of ``L q`` counts as zero within this many noise floors (the SVD's first dropped
#: singular value over its last kept) of the largest, where that exceeds ``zero_tol`` (at most 0.1)
NOISE_MARGIN = 3.0


@dataclass(frozen=True)
class ReluLinear:
    """A ``Linear`` layer with a bias whose output goes through ReLU: its position among the
    model's leaf layers, its name, and whether its input is the image."""

    index: int
    name: str
    layer: nn.Linear
    is_image: bool


def relu_linear_layers(model: nn.Module) -> Tuple[List[ReluLinear], Optional[Reason]]:
    """Every biased ``Linear`` followed directly by ``ReLU`` in a plain layer sequence, first
    first, and why there is none (None when some are found)."""
    layers = leaf_layers(model)
    found = [ReluLinear(i, name, layer, input_blocker(layers, i) is None)
             for i, (name, layer) in enumerate(layers[:-1])
             if isinstance(layer, nn.Linear) and layer.bias is not None and isinstance(layers[i + 1][1], nn.ReLU)]
    if found:
        return found, None
    if any(isinstance(m, nn.Linear) for _, layer in layers for m in layer.modules() if m is not layer):
        return [], Reason("spear-fc-inside-module")
    return [], Reason("spear-no-relu-linear")


# --------------------------------------------------------------------------- labels and certificate
def _tail(layers, start: int) -> nn.Sequential:
    return nn.Sequential(*[layer for _, layer in layers[start:]])


def labels_from_batch(observation: Observation, tail: nn.Module, z: Tensor) -> Optional[Tensor]:
    """Each image's label from its recovered layer input ``z`` (one plain gradient of mean
    cross-entropy; an update after local steps is read per step): the classifier's weight gradient is ``(P - Y)^T H / B`` with ``P`` the
    softmax and ``H`` the classifier's inputs, both computed from ``z``; so
    ``Y = P - B (dW H^+)^T``. None where ``H`` has rank below ``B``."""
    head = [m for m in tail if isinstance(m, nn.Linear)][-1]
    names = trainable_names(observation.model)
    captured: List[Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, inp: captured.append(inp[0].detach()))
    try:
        with torch.no_grad():
            probs = torch.softmax(tail(z.to(head.weight.dtype)), -1).double()
    finally:
        hook.remove()
    h = captured[0].double()
    if int(torch.linalg.matrix_rank(h)) < h.shape[0]:
        return None
    weight_name = next((n for n, p in observation.model.named_parameters() if p is head.weight), None)
    if weight_name not in names:
        return None
    dw = observation.gradients[names.index(weight_name)].detach().double() / max(1, observation.local_steps)
    y = probs - h.shape[0] * (dw @ torch.linalg.pinv(h)).T
    return y.argmax(1)


def upload_error(observation: Observation, tail_params: List[str], tail: nn.Module, z: Tensor,
                 images: Optional[Tensor], labels: Tensor) -> float:
    """Relative error of the upload the recovered batch reproduces: for one plain gradient,
    the gradients of the layer and every layer after it (from ``z``); for FedAvg, the whole
    client update replayed on ``images``."""
    names = trainable_names(observation.model)
    if observation.one_step:
        params = dict(observation.model.named_parameters())
        loss = observation.loss_fn(tail(z.to(params[tail_params[0]].dtype)), labels)
        mine = torch.autograd.grad(loss, [params[n] for n in tail_params], allow_unused=True)
        theirs = [observation.gradients[names.index(n)] for n in tail_params]
    else:
        sim = GradientSimulator()
        replica = sim.prepare(observation)
        grads, _ = sim(replica, images.to(observation.gradients[0].dtype), labels, functional=False,
                       context=SimContext(observation, capture_features=False))
        mine, theirs = grads, observation.gradients
    diff = sum(float((m.detach().double() - t.detach().double()).pow(2).sum())
               for m, t in zip(mine, theirs) if m is not None)
    ref = sum(float(t.detach().double().pow(2).sum()) for t in theirs)
    return math.sqrt(diff / ref) if ref > 0 else math.inf


# --------------------------------------------------------------------------- the attack
def default_samples(batch: int) -> int:
    """The most subsets drawn by default: ``2^(B+8)``, at most ``2^22``. A subset isolates an
    image with chance about ``s^(B-1)`` (``s``: the share of its zero rows, near 1/2 at
    initialisation), so this is ~2^9 times the expected draws per image; measured needs:
    docs/strength.md (SPEAR)."""
    return min(1 << 22, 1 << (batch + 8))


class Spear:
    """SPEAR on the first ReLU-followed linear layer (see the module docstring).

    ``samples``: most (B-1)-row subsets drawn (None: :func:`default_samples`); ``chunk``: drawn per batched step;
    ``zero_tol``: an entry of ``L q`` counts as zero within this share of its largest;
    ``min_sparsity``: share of ``L``'s rows a kept direction must zero; ``tolerance``: the
    certificate's relative error; ``input_samples``: where no selection is certified and the
    layer's input is features, column subsets drawn from the other side, the zeros of the
    input (:mod:`attacks.spear_dual`; None: its default, 0: off).
    ``budget`` (gradient evaluations) is unused: SPEAR's cost is its samples.
    """

    name = "spear"
    uses_budget = False  # its cost is its samples: a larger budget gives it nothing

    def __init__(self, samples: Optional[int] = None, chunk: int = 4096, zero_tol: float = 1e-5,
                 min_sparsity: float = 0.0, tolerance: float = CERTIFICATE_TOLERANCE,
                 input_samples: Optional[int] = None):
        if samples is not None and samples < 1 or chunk < 1:
            raise ConfigError(f"spear: samples and chunk must be >= 1, got {samples} and {chunk}")
        if not 0 < zero_tol < 1 or not 0 <= min_sparsity < 1 or not tolerance > 0:
            raise ConfigError("spear: need 0 < zero_tol < 1, 0 <= min_sparsity < 1 and tolerance > 0, got "
                              f"{zero_tol}, {min_sparsity}, {tolerance}")
        self.samples, self.chunk = None if samples is None else int(samples), int(chunk)
        self.zero_tol, self.min_sparsity, self.tolerance = float(zero_tol), float(min_sparsity), float(tolerance)
        if input_samples is not None and input_samples < 0:
            raise ConfigError(f"spear: input_samples must be >= 0 (0: off), got {input_samples}")
        self._input_samples = input_samples

    def not_applicable_reason(self, observation: Observation) -> Tuple[Optional[ReluLinear], Optional[Reason]]:
        """The layer SPEAR inverts, or why it does not apply to ``observation``."""
        found, why = relu_linear_layers(observation.model)
        if not found:
            return None, why
        target = found[0]
        names = trainable_names(observation.model)
        if f"{target.name}.weight" not in names or f"{target.name}.bias" not in names:
            return None, Reason("spear-layer-frozen", layer=target.name)
        if not observation.one_step and not target.is_image:
            return None, Reason("spear-local-steps", steps=observation.local_steps,
                                optimizer=observation.optimizer.describe(), layer=target.name)
        if observation.batch_size > target.layer.out_features:
            return None, Reason("spear-batch-exceeds-outputs", batch=observation.batch_size,
                                outputs=target.layer.out_features, layer=target.name)
        return target, None

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Callable] = None) -> Reconstruction:
        target, why = self.not_applicable_reason(observation)
        if target is None:
            return Reconstruction.not_applicable(why)
        start = time.perf_counter()
        names = trainable_names(observation.model)
        dw = observation.gradients[names.index(f"{target.name}.weight")]
        db = observation.gradients[names.index(f"{target.name}.bias")]
        b = observation.batch_size
        left, right, floor = low_rank_factors(dw, b)
        zero_tol = min(max(self.zero_tol, NOISE_MARGIN * floor), 0.1)  # noise lifts the zeros to about its floor
        norms = left.norm(dim=1)
        rows = left[norms > max(1e-9, zero_tol) * norms.max()]  # rows of dZ that are all zero carry nothing
        if len(rows) < b:
            return Reconstruction.not_applicable(Reason("spear-too-few-rows", rows=len(rows), layer=target.name,
                                                        batch=b))
        layers = leaf_layers(observation.model)
        tail = _tail(layers, target.index)
        tail_params = [n for n in names if any(n.startswith(f"{name}.") for name, _ in layers[target.index:])]
        min_zeros = max(b + 1, math.ceil(self.min_sparsity * len(rows)))
        generator = torch.Generator(device=rows.device).manual_seed(int(seed))
        active = norms > max(1e-9, zero_tol) * norms.max()
        weight = target.layer.weight.detach().double()[active]
        layer = Layer(rows, right, db.detach().double()[active], right @ weight.T,
                      target.layer.bias.detach().double()[active][None], zero_tol)
        found = Candidates(b, 32 * b, rows.dtype, rows.device)
        best = None  # (error, z, labels, label source)
        drawn = attempts = 0
        checked: List[Tuple[Tensor, int]] = []  # selections (and recurring counts) already certified
        from_input = False
        cap = default_samples(b) if self.samples is None else self.samples
        if b == 1:  # dW = dz x^T has rank one: its one direction is the line itself, nothing to sample
            line = torch.ones(1, 1, dtype=rows.dtype, device=rows.device)
            best = self._candidate(observation, target, layers, tail, tail_params, left, right, db, line, seed)
            best_match, attempts, cap = float(layer.activity_match(line[None])[0].min()), 1, 0
        while drawn < cap:
            count = min(self.chunk, cap - drawn)
            q, zeros = sample_directions(rows, count, generator, zero_tol, min_zeros)
            drawn += count
            found.add(q, zeros)
            if progress is not None:
                progress(drawn, cap, float(len(found)))
            chosen = found.greedy(b)
            if chosen is None:
                continue
            state = (found.q[chosen].T, int((found.hits > 1).sum()))  # recurring directions are the true ones
            if any(torch.equal(d, state[0]) and n == state[1] for d, n in checked):
                continue
            checked.append(state)
            chosen, match = improve(layer, found.q, chosen)
            attempts += 1
            candidate = self._candidate(observation, target, layers, tail, tail_params, left, right, db,
                                        found.q[chosen].T, seed)
            if best is None or candidate[0] < best[0]:
                best, best_match = candidate, float(match.min())
            if best[0] <= self.tolerance:
                break
        input_drawn = 0
        input_cap = default_input_samples(b) if self._input_samples is None else self._input_samples
        if input_cap and b > 1 and not target.is_image and (best is None or best[0] > self.tolerance):
            side = InputSide(right, generator, zero_tol)  # the batch from the zeros of the features
            while input_drawn < input_cap and (best is None or best[0] > self.tolerance):
                count = min(4 * self.chunk, input_cap - input_drawn)
                side.draw(count)
                input_drawn += count
                for directions in side.selections(layer) + side.completions(layer):
                    attempts += 1
                    candidate = self._candidate(observation, target, layers, tail, tail_params, left, right, db,
                                                directions, seed)
                    if best is None or candidate[0] < best[0]:
                        best = candidate
                        best_match = float(layer.activity_match(directions[None])[0].min())
                        from_input = True
                    if best[0] <= self.tolerance:
                        break
        trace = {"attack": self.name, "layer": target.name, "layer_input": "image" if target.is_image else "features",
                 "samples": drawn, "input_samples": input_drawn, "directions_kept": len(found), "selections_checked": attempts,
                 "seconds": time.perf_counter() - start, "certificate_tolerance": self.tolerance,
                 "noise_floor": floor, "zero_tol": zero_tol}
        if best is None and not target.is_image:
            return Reconstruction(None, None, trace, applicable=False,
                                  reason=Reason("spear-too-few-directions", batch=b, layer=target.name))
        if best is None:
            trace.update(failed_to_optimise=True, failure=Reason("spear-too-few-samples", kept=len(found),
                                                                 samples=drawn, batch=b).to_dict(), certified=False)
            return Reconstruction(torch.full((b, *observation.input_shape), 0.5, device=dw.device),
                                  infer_labels(observation, seed=seed).labels, trace)
        error, z, labels, label_source = best
        certified = error <= self.tolerance
        trace.update(certificate_error=error, certified=certified, labels_from=label_source, activity_match=best_match,
                     from_input_zeros=from_input,
                     note=Reason("spear-certificate", error=error, tolerance=self.tolerance).to_dict())
        if not certified:  # still a reconstruction, scored like any attack's; only "exact" needs the certificate
            trace.update(uncertified=Reason("spear-uncertified", tolerance=self.tolerance, samples=drawn,
                                            error=error).to_dict())
        if target.is_image:
            images = layer_input_to_images(z, layers, target.index, observation.input_shape)
            trace["raw_range"] = [float(images.min()), float(images.max())]
            return Reconstruction(images.float().clamp(0, 1), labels, trace)
        trace["features"] = z.float()
        return Reconstruction(None, labels, trace, applicable=False,
                              reason=Reason("spear-features-not-image", layer=target.name,
                                            features=target.layer.in_features))

    def _candidate(self, observation, target, layers, tail, tail_params, left, right, db, directions, seed):
        """The batch one selection of directions gives, its labels and its certificate error."""
        mixing = scaled_mixing(left, directions, db)
        z = torch.linalg.solve(mixing, right)  # (B, n): row j is image j's layer input
        images = layer_input_to_images(z, layers, target.index, observation.input_shape) if target.is_image else None
        options = []
        if observation.labels_shared:
            options.append((observation.labels.to(z.device).long(), "shared"))
        else:
            mine = labels_from_batch(observation, tail, z)
            if mine is not None:
                options.append((mine, "recovered-batch"))
            options.append((infer_labels(observation, seed=seed).labels.to(z.device), "label-inference"))
        scored = []
        for labels, source in options:
            error = upload_error(observation, tail_params, tail, z, images, labels)
            scored.append((error, z, labels, source))
            if error <= self.tolerance:
                break
        return min(scored, key=lambda t: t[0])


@ATTACKS.register("spear", "SPEAR: exact recovery of a whole batch through a biased Linear layer followed by ReLU "
                  "(its inputs: the images of an MLP, the features where convolutions come first), certified "
                  "by reproducing the upload")
def spear(samples: Optional[int] = None, chunk: int = 4096, zero_tol: float = 1e-5, min_sparsity: float = 0.0,
          tolerance: float = CERTIFICATE_TOLERANCE, input_samples: Optional[int] = None) -> Spear:
    return Spear(samples, chunk, zero_tol, min_sparsity, tolerance, input_samples)
