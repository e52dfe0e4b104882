"""Each private image's last-layer features, read off the classifier's gradient.

For a final linear layer ``z = W h + b`` under cross-entropy, ``dL/dW = (1/B) sum_j (p_j - y_j) h_j^T``
and ``dL/db = (1/B) sum_j (p_j - y_j)``. Row ``c`` of an image whose label no other image of the
batch has is dominated by that image's ``h``; the rows of the classes no image has hold only
the softmax's share of every image. Row ``c`` minus the mean absent row, over the same
difference of the bias gradient, is that image's ``h`` up to the softmax's departure from
uniform (R-GAP's and iDLG's reading, one image per label). With the softmax ``P`` known the
reading is exact: ``[dL/dW | dL/db] = (1/B) (P - Y)^T [H | 1]``, solved for ``[H | 1]`` by least
squares and each row divided by its last entry (so a scaled upload reads the same). The run
supplies the dummy's own softmax, which approaches the private batch's as the dummy does; it
reads both sides. The cosine over the whole gradient mixes the images of a batch; this term
gives each image its own target: the dummy gradient's reading against the observed gradient's,
so any simulator (an unrolled optimiser, a replayed defense) transforms both alike.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from audit.core.reasons import Reason
from audit.core.errors import NotApplicable

from priors.base import PRIORS, Prior, PriorContext


def classifier_head(model: nn.Module) -> Tuple[int, int]:
    """Positions of the output layer's weight and bias among ``model``'s trainable parameters
    (the order of the shared gradient); NotApplicable when the model does not end in a
    trainable linear layer with a bias."""
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    head = owners[-1] if owners else None
    if not isinstance(head, nn.Linear) or head.bias is None:
        raise NotApplicable(Reason("features-needs-linear-head"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = [id(p) for p in trainable]
    if id(head.weight) not in ids or id(head.bias) not in ids:
        raise NotApplicable(Reason("features-head-frozen"))
    return ids.index(id(head.weight)), ids.index(id(head.bias))


#: ridge of the exact reading's least squares, relative to the mean diagonal of ``(P - Y)(P - Y)^T``
READING_RIDGE = 1e-6


def per_image_features(weight_grad: Tensor, bias_grad: Tensor, labels: Tensor,
                       softmax: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Per image of the batch, its last-layer features read off the output layer's gradient
    ``(B, features)``, and a mask ``(B,)`` of the images the reading applies to (a label of
    their own in the batch, and some class absent). ``softmax`` ``(B, classes)``: the exact
    reading with these class probabilities; without it, the absent classes' rows stand in for
    the softmax's share. Pure torch (runs under vmap)."""
    classes = weight_grad.shape[0]
    onehot = (labels.reshape(-1, 1) == torch.arange(classes, device=labels.device)).to(weight_grad.dtype)
    counts = onehot.sum(0)
    absent = (counts == 0).to(weight_grad.dtype)
    n_absent = absent.sum()
    if softmax is None:
        mix = onehot - absent / n_absent.clamp_min(1)
    else:
        a = softmax.to(weight_grad.dtype) - onehot
        gram = a @ a.T
        ridge = READING_RIDGE * gram.diagonal().mean() * torch.eye(len(a), dtype=a.dtype, device=a.device)
        mix = torch.linalg.solve_ex(gram + ridge, a)[0]  # no error check: no host sync in a captured program
    rows, bias = mix @ weight_grad, mix @ bias_grad
    usable = (onehot @ counts == 1).to(weight_grad.dtype) * (n_absent > 0).to(weight_grad.dtype)
    safe = torch.where(bias.abs() > 1e-12, bias, torch.ones_like(bias))
    return rows / safe.unsqueeze(1), usable


#: iterations of :func:`observed_reading`'s fixed point (it settles in about five on a batch of 8 of 10 classes)
FIXED_POINT_ITERATIONS = 30
#: the largest relative residual at which the fixed point is taken to explain the upload
FIXED_POINT_TOLERANCE = 1e-3


def observed_reading(weight_grad: Tensor, bias_grad: Tensor, labels: Tensor, head_weight: Tensor,
                     head_bias: Tensor, iterations: int = FIXED_POINT_ITERATIONS) -> Tuple[Tensor, Tensor, float]:
    """The private batch's last-layer features, its softmax and the relative residual of the fit,
    read off the observed output layer's gradient alone. The softmax is a function of the
    features, ``P = softmax(H W^T + b)`` with the model's own output layer, and the exact reading
    gives ``H`` from ``P``: iterating the two from the softmax-free reading reaches the fixed
    point where both are the batch's. The residual, ``|O - s (P - Y)^T [H | 1]| / |O|`` with the
    best scale ``s``, says whether it explains the upload (one plain gradient or one local
    step: about 1e-6; several local steps or noise: larger)."""
    w = head_weight.detach().to(weight_grad.dtype)
    b = head_bias.detach().to(weight_grad.dtype)
    classes = weight_grad.shape[0]
    onehot = (labels.reshape(-1, 1) == torch.arange(classes, device=labels.device)).to(weight_grad.dtype)
    has_absent = bool((onehot.sum(0) == 0).any())
    start = None if has_absent else torch.full_like(onehot, 1.0 / classes)
    features = per_image_features(weight_grad, bias_grad, labels, start)[0]
    for _ in range(iterations):
        probs = torch.softmax(features @ w.T + b, dim=1)
        features = per_image_features(weight_grad, bias_grad, labels, probs)[0]
    probs = torch.softmax(features @ w.T + b, dim=1)
    observed = torch.cat([weight_grad.reshape(classes, -1), bias_grad.reshape(classes, 1)], 1)
    model = (probs - onehot).T @ torch.cat([features, torch.ones_like(features[:, :1])], 1)
    scale = (model * observed).sum() / (model * model).sum().clamp_min(1e-30)
    residual = float((observed - scale * model).norm() / observed.norm().clamp_min(1e-30))
    if not torch.isfinite(features).all():
        residual = float("inf")
    return features, probs, residual


class LastLayerFeatures(Prior):
    """``mean_j |h_j(dummy) - h_j(observed)|^2 / |h_j(observed)|^2`` over the images the reading
    applies to (:func:`per_image_features`). Needs ``context.features``: ``grads`` (the dummy's
    simulated gradient), ``target`` (the observed one), ``labels`` and ``head`` (the output
    layer's positions, :func:`classifier_head`), filled by the optimisation run; the dummy's
    side is read with ``softmax`` (the dummy's, detached); the upload's is ``target_features``
    where the run read it once (:func:`observed_reading`), else read with the same softmax."""

    name = "features"
    requires = frozenset({"grads"})

    def __call__(self, x: Tensor, context: PriorContext) -> Tensor:
        f = context.features
        if f.get("head") is None or f.get("grads") is None:
            raise NotApplicable(Reason("features-needs-run"))
        w, b = f["head"]
        labels = f["labels"]
        probs = f.get("softmax")
        dummy, usable = per_image_features(f["grads"][w], f["grads"][b], labels, probs)
        truth = f.get("target_features")
        if truth is None:
            truth, _ = per_image_features(f["target"][w], f["target"][b], labels, probs)
        error = (dummy - truth).pow(2).sum(1) / truth.pow(2).sum(1).clamp_min(1e-12)
        return (error * usable).sum() / usable.sum().clamp_min(1)


@PRIORS.register("features", "each image's last-layer features read off the output layer's gradient "
                             "(one image per label), dummy against observed")
def features() -> Prior:
    return LastLayerFeatures()
