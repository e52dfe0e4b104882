"""The span attack through a defense: through magnitude pruning (each span layer's row space
completed by its rank where held-out kept entries confirm it) and through small additive noise
(each row space read as the upload's top singular subspace)."""
import torch
from torch import nn

import adaptive  # noqa: F401  (registers the adaptive attacks)
from attacks import ATTACKS, observe
from audit.core.evidence import aligned_psnr
from audit.core.models import build_model
from defenses import build_defense



def _upload(defense):
    """The registered ResNet-18 at width 32 on a smooth 16x16 image (label 4), eval mode, through ``defense``."""
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 16, 16), 10, width=32, seed=0)
    g = torch.Generator().manual_seed(0)
    x = nn.functional.interpolate(torch.rand(1, 3, 4, 4, generator=g), size=(16, 16), mode="bilinear",
                                  align_corners=False)
    return x, observe(model, x, torch.tensor([4]), defense, client_mode="eval")

def test_a_pruned_resnet_upload_gives_the_image_back_exactly_where_plain_conv_span_cannot_run():
    x, obs = _upload(build_defense("prune", ratio=0.8))  # 80% of every gradient's entries pruned
    plain = ATTACKS.build("conv-span").reconstruct(obs, 100, seed=0)
    assert not plain.applicable and plain.reason.code == "conv-span-no-gap"  # pruning breaks every rank gap
    rec = ATTACKS.build("conv-span-completed").reconstruct(obs, 100, seed=0)
    assert rec.applicable and "8.conv1" in rec.trace["layers"], rec.trace
    assert float(aligned_psnr(rec.inputs, x)) > 40 and rec.labels.tolist() == [4]
    # certified on the kept entries: the recovered image's gradient, pruned where the upload is, is the upload
    assert rec.trace["certified"], rec.trace["certificate_error"]


def test_its_positive_control_runs_the_span_attack_it_adapts():
    from audit.engine.control import base_form

    assert base_form("conv-span-completed", {}) == "conv-span"
    assert base_form("mask-replay", {}) == "ig"  # an adaptive attack naming no base adapts ig


def test_a_slightly_noisy_upload_gives_the_image_back_from_its_top_singular_subspaces():
    # Gaussian noise of 1e-5 on every entry (the gradient's entries: 4e-2 rms):
    # every rank gap is gone, but where the noise stays below the span's smallest singular value the
    # top singular subspace is the span, nearly
    x, obs = _upload(build_defense("gaussian", sigma=1e-5))
    assert not ATTACKS.build("conv-span").reconstruct(obs, 100, seed=0).applicable
    rec = ATTACKS.build("conv-span-denoised").reconstruct(obs, 100, seed=0)
    assert rec.applicable and float(aligned_psnr(rec.inputs, x)) > 30 and rec.labels.tolist() == [4]
    assert not rec.trace["certified"]  # the noise is not reproduced: nothing claims an exact image
