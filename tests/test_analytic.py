"""Analytic inversion of a fully connected first layer (batch 1)."""
import pytest
import torch
from torch import nn

from attacks import ATTACKS, observe
from audit.core.metrics import psnr
from audit.core.models import build_model, with_normalization
from audit.report.reasons import word


pytestmark = pytest.mark.usefixtures("one_thread")


def _image(seed=0, shape=(3, 16, 16)):
    return torch.rand(1, *shape, generator=torch.Generator().manual_seed(seed))


def test_mlp_first_layer_inversion_is_exact():
    model = build_model("mlp", (3, 16, 16), 10, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3), hidden=(64, 32))
    x, y = _image(), torch.tensor([7])
    rec = ATTACKS.build("analytic").reconstruct(observe(model, x, y), None, 0)
    assert rec.applicable
    assert float(psnr(rec.inputs, x)) > 80
    assert rec.labels.tolist() == [7]
    assert rec.trace["layer"] == "2"  # after Normalize and Flatten


def test_fedavg_update_of_one_image_still_inverts_exactly():
    model = build_model("mlp", (1, 8, 8), 4, hidden=(32,))
    x, y = _image(1, (1, 8, 8)), torch.tensor([2])
    obs = observe(model, x, y, local_steps=3, local_lr=0.05)
    assert float(psnr(ATTACKS.build("analytic").reconstruct(obs, None, 0).inputs, x)) > 80


def test_user_model_wrapped_with_normalization():
    user = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 20), nn.ReLU(), nn.Linear(20, 5))
    model = with_normalization(user, (0.5, 0.5, 0.5), (0.2, 0.3, 0.4))
    x = _image(2, (3, 8, 8))
    rec = ATTACKS.build("analytic").reconstruct(observe(model, x, torch.tensor([1])), None, 0)
    assert rec.trace["layer"] == "1.1"
    assert float(psnr(rec.inputs, x)) > 80


def test_conv_net_is_not_applicable_for_the_image():
    model = build_model("lenet", (3, 16, 16), 10)
    rec = ATTACKS.build("analytic").reconstruct(observe(model, _image(), torch.tensor([0])), None, 0)
    assert not rec.applicable and rec.inputs is None
    assert rec.reason.code == "analytic-features-not-image" and rec.reason.params["before_type"] == "Conv2d"
    assert "Conv2d" in word(rec.reason) and "features, not the image" in word(rec.reason)
    assert rec.trace["feature_count"] == model[-1].in_features


def test_batch_and_bias_free_models_are_not_applicable():
    model = build_model("mlp", (1, 8, 8), 4, hidden=(16,))
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    rec = ATTACKS.build("analytic").reconstruct(observe(model, x, torch.tensor([0, 1])), None, 0)
    assert not rec.applicable and rec.reason.params == {"batch": 2} and "one image" in word(rec.reason)
    no_bias = nn.Sequential(nn.Flatten(), nn.Linear(64, 4, bias=False))
    rec = ATTACKS.build("analytic").reconstruct(observe(no_bias, x[:1], torch.tensor([0])), None, 0)
    assert not rec.applicable and "no fully connected layer with a bias" in word(rec.reason)


class Residual(nn.Module):
    """A forward that is not a sequence of its children (a skip connection)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Conv2d(1, 1, 3, padding=1), nn.Linear(64, 4)

    def forward(self, x):
        return self.head((x + self.body(x)).flatten(1))


def test_a_model_that_is_not_a_sequence_is_named_in_the_reason():
    model = with_normalization(Residual(), (0.5,), (0.2,))
    rec = ATTACKS.build("analytic").reconstruct(observe(model, _image(4, (1, 8, 8)), torch.tensor([1])), None, 0)
    assert not rec.applicable and "inside Residual ('1')" in word(rec.reason)
    assert "not a plain sequence" in word(rec.reason)
