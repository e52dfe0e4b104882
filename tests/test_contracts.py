import torch

from audit.core.models import build_model
from audit.core.registry import parse_kv_args
from audit.core.types import (Defense, FunctionDefense, Observation, Reconstruction, clean_gradients,
                         gradient_transform)


def _batch():
    model = build_model("lenet", (3, 16, 16), 4, seed=0)
    return model, torch.rand(2, 3, 16, 16), torch.tensor([1, 3])


def test_a_plain_function_is_a_defense():
    model, x, y = _batch()

    def halve(model, inputs, labels, *, loss_fn, generator):
        return [0.5 * g for g in clean_gradients(model, inputs, labels, loss_fn)]

    wrapped = FunctionDefense(halve)
    out = wrapped(model, x, y, generator=None)
    ref = clean_gradients(model, x, y)
    assert all(torch.allclose(o, 0.5 * r) for o, r in zip(out, ref))
    assert wrapped.name == "halve"


def test_gradient_transform_decorator_adapts_grads_to_grads():
    model, x, y = _batch()

    @gradient_transform(stochastic=True)
    def noisy(grads, generator=None):
        return [g + torch.randn(g.shape, generator=generator) for g in grads]

    assert isinstance(noisy, Defense) and noisy.stochastic
    a = noisy(model, x, y, generator=torch.Generator().manual_seed(1))
    b = noisy(model, x, y, generator=torch.Generator().manual_seed(1))
    c = noisy(model, x, y, generator=torch.Generator().manual_seed(2))
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not torch.equal(a[0], c[0])
    clean = clean_gradients(model, x, y)
    assert (a[0] - clean[0]).std() > 0.5  # unit noise was really added


def test_base_defense_is_identity_and_differentiable():
    model, x, y = _batch()
    x = x.requires_grad_()
    out = Defense()(model, x, y)
    (g,) = torch.autograd.grad(out[0].sum(), x)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_observation_declares_its_threat_model():
    model, x, y = _batch()
    obs = Observation(model, clean_gradients(model, x, y), (3, 16, 16), 4, batch_size=2)
    tm = obs.threat_model()
    assert tm["labels_shared"] is False and tm["batch_size"] == 2
    assert tm["defense_randomness_known"] is False
    obs.labels = y
    assert obs.threat_model()["labels_shared"] is True


def test_reconstruction_not_applicable_carries_reason():
    r = Reconstruction.not_applicable("model has no fully connected layer with a bias")
    assert not r.applicable and "bias" in str(r.reason) and r.inputs is None


def test_kv_args_parse_types():
    assert parse_kv_args(["ratio=0.9", "trials=20", "layerwise=false", "policy=7-4-15", "s=1,2"]) == {
        "ratio": 0.9, "trials": 20, "layerwise": False, "policy": "7-4-15", "s": (1, 2)}


def test_the_none_defense_returns_the_true_gradient():
    from defenses import build_defense

    model, x, y = _batch()
    shared = build_defense("none")(model, x, y, loss_fn=torch.nn.functional.cross_entropy,
                                   generator=torch.Generator().manual_seed(0))
    clean = clean_gradients(model, x, y)
    assert len(shared) == len(clean)
    assert all(torch.equal(s, c) for s, c in zip(shared, clean))
