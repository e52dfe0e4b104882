"""ig started from the conv-span batch: certified batches kept as they are, otherwise the batch
that reproduces the upload better, and plain ig where conv-span does not apply."""
import torch

from audit.client.observe import observe
from audit.core.evidence import aligned_psnr
from audit.core.models import build_model
from attacks.conv_span import upload_error
from attacks.presets import ATTACKS
from test_conv_span import resnet, smooth_images


def test_an_uncertified_conv_span_batch_is_refined_and_the_better_batch_kept():
    x = smooth_images(1, 0)
    obs = observe(resnet(), x, torch.tensor([4]), None, client_mode="eval")
    rec = ATTACKS.build("conv-span-ig").reconstruct(obs, budget=10, seed=0)  # conv-span on 5: short of exact
    errors = rec.trace["upload_errors"]
    assert not rec.trace["conv_span"]["certified"] and set(errors) == {"conv-span", "ig"}
    assert rec.trace["kept"] == min(errors, key=errors.get)
    # the batch returned is the one that reproduces the upload better, measured again here
    assert abs(upload_error(obs, rec.inputs, rec.labels) - min(errors.values())) < 0.02
    assert rec.labels.tolist() == [4]


def test_a_certified_conv_span_batch_is_final():
    x = smooth_images(1, 0)
    obs = observe(resnet(), x, torch.tensor([4]), None, client_mode="eval")
    rec = ATTACKS.build("conv-span-ig").reconstruct(obs, budget=40, seed=0)
    assert rec.trace["certified"] and rec.trace["ig"] == "skipped-certified", rec.trace
    assert float(aligned_psnr(rec.inputs, x)) > 25


def test_plain_ig_where_conv_span_does_not_apply():
    model = build_model("cnn", (3, 32, 32), 10)
    x, y = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.tensor([3])
    obs = observe(model, x, y)
    rec = ATTACKS.build("conv-span-ig").reconstruct(obs, budget=6, seed=0)
    plain = ATTACKS.build("ig").reconstruct(obs, budget=6, seed=0)
    assert rec.trace["conv_span"]["code"] == "conv-span-no-rank"
    assert torch.equal(rec.inputs, plain.inputs)
