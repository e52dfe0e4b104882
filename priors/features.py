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

from audit.core.errors import NotApplicable

from priors.base import PRIORS, Prior, PriorContext


def classifier_head(model: nn.Module) -> Tuple[int, int]:
    """Positions of the output layer's weight and bias among ``model``'s trainable parameters
    (the order of the shared gradient); NotApplicable when the model does not end in a
    trainable linear layer with a bias."""
    owners = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    head = owners[-1] if owners else None
    if not isinstance(head, nn.Linear) or head.bias is None:
        raise NotApplicable("the features term needs a model whose last layer is a linear layer with a bias")
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = [id(p) for p in trainable]
    if id(head.weight) not in ids or id(head.bias) not in ids:
        raise NotApplicable("the features term needs the output layer's gradient (its parameters are frozen)")
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


class LastLayerFeatures(Prior):
    """``mean_j |h_j(dummy) - h_j(observed)|^2 / |h_j(observed)|^2`` over the images the reading
    applies to (:func:`per_image_features`). Needs ``context.features``: ``grads`` (the dummy's
    simulated gradient), ``target`` (the observed one), ``labels`` and ``head`` (the output
    layer's positions, :func:`classifier_head`), filled by the optimisation run; with
    ``softmax`` (the dummy's, detached) both sides are read exactly with it."""

    name = "features"
    requires = frozenset({"grads"})

    def __call__(self, x: Tensor, context: PriorContext) -> Tensor:
        f = context.features
        if f.get("head") is None or f.get("grads") is None:
            raise NotApplicable("the features term needs the dummy's gradient and the output layer (set by the run)")
        w, b = f["head"]
        labels = f["labels"]
        probs = f.get("softmax")
        dummy, _ = per_image_features(f["grads"][w], f["grads"][b], labels, probs)
        truth, usable = per_image_features(f["target"][w], f["target"][b], labels, probs)
        error = (dummy - truth).pow(2).sum(1) / truth.pow(2).sum(1).clamp_min(1e-12)
        return (error * usable).sum() / usable.sum().clamp_min(1)


@PRIORS.register("features", "each image's last-layer features read off the output layer's gradient "
                             "(one image per label), dummy against observed")
def features() -> Prior:
    return LastLayerFeatures()
