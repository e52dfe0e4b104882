import pytest
import torch
from torch import nn

from audit.core.errors import ConfigError
from audit.core.models import MODELS, Normalize, build_model, last_linear, with_normalization
from audit.core.types import clean_gradients, trainable_parameters

SHAPES = [((3, 32, 32), 10), ((1, 28, 28), 7), ((3, 16, 16), 5)]


@pytest.mark.parametrize("name", MODELS.names())
@pytest.mark.parametrize("shape,classes", SHAPES)
def test_every_model_gives_gradients_of_its_parameter_shapes(name, shape, classes):
    kwargs = {"width": 8} if name in ("resnet18", "convnet") else {}
    model = build_model(name, shape, classes, **kwargs)
    x = torch.rand(2, *shape)
    y = torch.tensor([0, classes - 1])
    logits = model(x)
    assert logits.shape == (2, classes)
    grads = clean_gradients(model, x, y)
    params = trainable_parameters(model)
    assert [g.shape for g in grads] == [p.shape for p in params]
    assert all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0


def test_gradients_stay_differentiable_for_dummy_inputs():
    model = build_model("lenet", (3, 16, 16), 4)
    x = torch.rand(1, 3, 16, 16, requires_grad=True)
    grads = clean_gradients(model, x, torch.tensor([1]))
    (second,) = torch.autograd.grad(sum(g.pow(2).sum() for g in grads), x)
    assert second.abs().sum() > 0


def test_lenet_uses_dlg_uniform_init():
    model = build_model("lenet", (3, 32, 32), 10, seed=1)
    for p in model.parameters():
        assert p.min() >= -0.5 and p.max() <= 0.5
        if p.dim() > 1:
            assert p.abs().max() > 0.45  # not PyTorch's default (much smaller) init


def test_same_seed_same_model_different_seed_different_model():
    a = build_model("cnn", (3, 32, 32), 10, seed=3)
    b = build_model("cnn", (3, 32, 32), 10, seed=3)
    c = build_model("cnn", (3, 32, 32), 10, seed=4)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert not torch.equal(next(a.parameters()), next(c.parameters()))


def test_resnet18_is_cifar_style():
    model = build_model("resnet18", (3, 32, 32), 10)
    stem = model[1]
    assert isinstance(stem, nn.Conv2d) and stem.kernel_size == (3, 3) and stem.stride == (1, 1)
    assert not any(isinstance(m, nn.MaxPool2d) for m in model.modules())
    n_params = sum(p.numel() for p in model.parameters())
    assert 11.0e6 < n_params < 11.4e6  # the standard CIFAR ResNet-18 has 11.17M


def test_convbig_matches_the_bayes_paper_sizes():
    model = build_model("convbig", (3, 32, 32), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(5184, 2000), (2000, 1000), (1000, 10)]


def test_mlp_precode_sizes_and_last_linear():
    model = build_model("mlp", (3, 32, 32), 10)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears[0].in_features == 3072 and linears[0].out_features == 500
    assert linears[-1].in_features == 256
    name, head = last_linear(model)
    assert head is linears[-1] and name


def test_normalisation_lives_in_the_model():
    model = build_model("cnn", (3, 8, 8), 3, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert isinstance(model[0], Normalize)
    x = torch.full((1, 3, 8, 8), 0.75)
    assert torch.allclose(model[0](x), torch.ones_like(x))


def test_a_user_module_works_with_normalisation_wrapper():
    user = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))
    model = with_normalization(user, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    grads = clean_gradients(model, torch.rand(1, 3, 8, 8), torch.tensor([2]))
    assert [g.shape for g in grads] == [(4, 192), (4,)]


def test_bad_model_requests_name_the_fix():
    with pytest.raises(ConfigError, match="Valid models: cnn, convbig, convnet"):
        build_model("lenett", (3, 32, 32), 10)
    with pytest.raises(ConfigError, match="input_shape must be"):
        build_model("lenet", (32, 32), 10)
    with pytest.raises(ConfigError, match="no parameter 'depth'; valid parameters: .*width"):
        build_model("lenet", (3, 32, 32), 10, depth=3)
    with pytest.raises(ConfigError, match="one value per input channel"):
        build_model("lenet", (3, 32, 32), 10, mean=(0.5,), std=(0.5,))


@pytest.mark.parametrize("name", ["cnn", "convbig"])
def test_lecun_init_is_flax_default_kernels_and_zero_biases(name):
    # flax's default: kernel ~ normal truncated at 2 std, variance 1 / fan_in; bias 0
    model = build_model(name, init="lecun", seed=3)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert len(layers) >= 4
    for layer in layers:
        w = layer.weight.detach()
        fan_in = w[0].numel()
        assert torch.equal(layer.bias, torch.zeros_like(layer.bias))
        assert abs(float(w.std()) * fan_in ** 0.5 - 1.0) < 0.15, (name, tuple(w.shape))
        assert float(w.abs().max()) <= 2.0 / 0.8796 / fan_in ** 0.5 + 1e-6  # truncated at 2 std


def test_lecun_init_gives_the_bayes_cnn_larger_gradients_than_torch_default():
    x = torch.rand(4, 3, 32, 32)
    y = torch.tensor([0, 3, 5, 9])
    rms = {}
    for init in ("torch", "lecun"):
        grads = clean_gradients(build_model("cnn", init=init), x, y)
        rms[init] = float(torch.cat([g.flatten() for g in grads]).pow(2).mean().sqrt())
    assert rms["lecun"] > 2.5 * rms["torch"]
    with pytest.raises(ConfigError, match="init must be one of"):
        build_model("cnn", init="xavier")
