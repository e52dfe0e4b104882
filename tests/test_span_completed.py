"""conv-span-completed: the span attack through magnitude pruning, each span layer's row space
completed by its rank where held-out kept entries confirm it."""
import torch
from torch import nn

import adaptive  # noqa: F401  (registers the adaptive attacks)
from attacks import ATTACKS, observe
from audit.core.evidence import aligned_psnr
from audit.core.models import build_model
from defenses import build_defense


def test_a_pruned_resnet_upload_gives_the_image_back_exactly_where_plain_conv_span_cannot_run():
    # the registered ResNet-18 at width 32 on a 16x16 image, 80% of every gradient's entries pruned
    torch.manual_seed(0)
    model = build_model("resnet18", (3, 16, 16), 10, width=32, seed=0)
    g = torch.Generator().manual_seed(0)
    x = nn.functional.interpolate(torch.rand(1, 3, 4, 4, generator=g), size=(16, 16), mode="bilinear",
                                  align_corners=False)
    obs = observe(model, x, torch.tensor([4]), build_defense("prune", ratio=0.8), client_mode="eval")
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
