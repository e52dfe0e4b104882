"""Image priors: values on known images, vmap compatibility, registry errors."""
import pytest
import torch

from audit.core.errors import ConfigError, NotApplicable
from priors import PRIORS, PriorContext


pytestmark = pytest.mark.usefixtures("one_thread")


def ctx(**kw):
    return PriorContext(**kw)


def test_registry_lists_the_priors_and_rejects_unknown_names():
    assert {"tv", "l2", "range", "bn", "group"} <= set(PRIORS.names())
    with pytest.raises(ConfigError, match="Valid priors"):
        PRIORS.build("totalvariation")
    with pytest.raises(ConfigError, match="anisotropic"):
        PRIORS.build("tv", kind="diagonal")


def test_tv_is_zero_on_constant_images_and_known_on_a_step_edge():
    flat = torch.full((1, 3, 8, 8), 0.3)
    edge = torch.zeros(1, 1, 4, 4)
    edge[..., :, 2:] = 1.0  # one vertical edge: |dx| = 1 on 4 of the 12 horizontal pairs
    aniso, iso = PRIORS.build("tv"), PRIORS.build("tv", kind="isotropic")
    assert float(aniso(flat, ctx())) == 0.0
    assert float(iso(flat, ctx())) == pytest.approx(0.0, abs=1e-3)
    assert float(aniso(edge, ctx())) == pytest.approx(4 / 12)
    assert float(iso(edge, ctx())) == pytest.approx(3 / 9, abs=1e-3)  # interior 3x3: one column of 1s


def test_pixel_priors():
    x = torch.tensor([[[[-0.5, 0.5], [1.0, 2.0]]]])
    assert float(PRIORS.build("range")(x, ctx())) == pytest.approx((0.25 + 1.0) / 4)
    assert float(PRIORS.build("l2")(x, ctx())) == pytest.approx((1 + 0 + 0.25 + 2.25) / 4)
    assert float(PRIORS.build("l2", center=0.0)(x, ctx())) == pytest.approx((0.25 + 0.25 + 1 + 4) / 4)


def test_bn_prior_matches_running_statistics():
    x = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    stats = [(x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False))]
    prior = PRIORS.build("bn")
    assert "bn_stats" in prior.requires
    assert float(prior(x, ctx(features={"bn": stats}, bn_running=stats))) == 0.0
    shifted = [(m + 1, v) for m, v in stats]
    assert float(prior(x, ctx(features={"bn": stats}, bn_running=shifted))) == pytest.approx(3 ** 0.5)
    with pytest.raises(NotApplicable, match="prior-needs-running-statistics"):
        prior(x, ctx(features={"bn": stats}, bn_running=None))


def test_group_consistency_switches_on_at_start():
    x, mean = torch.ones(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)
    prior = PRIORS.build("group", start=5)
    assert float(prior(x, ctx(iteration=4, group_mean=mean))) == 0.0
    assert float(prior(x, ctx(iteration=5, group_mean=mean))) == 1.0
    with pytest.raises(ConfigError):
        PRIORS.build("group", start=-1)


def test_priors_run_under_vmap_like_a_loop():
    xs = torch.rand(3, 2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    mean = xs.mean(0)
    for name in ("tv", "l2", "range", "group"):
        prior = PRIORS.build(name)
        batched = torch.func.vmap(lambda x: prior(x, ctx(group_mean=mean)))(xs)
        looped = torch.stack([prior(x, ctx(group_mean=mean)) for x in xs])
        torch.testing.assert_close(batched, looped)


def test_the_output_layers_gradient_gives_each_images_features_where_its_label_is_its_own():
    """Row c of dL/dW minus the mean absent row, over the same for dL/db, is the image of
    label c's input to the output layer (up to the softmax's departure from uniform)."""
    from priors import per_image_features

    torch.manual_seed(0)
    head = torch.nn.Linear(64, 10)
    torch.nn.init.normal_(head.weight, std=1e-3)  # a fresh classifier: a near-uniform softmax
    h = torch.rand(4, 64)
    labels = torch.tensor([2, 7, 5, 7])  # images 1 and 3 share a label: no reading for them
    loss = torch.nn.functional.cross_entropy(head(h), labels)
    gw, gb = torch.autograd.grad(loss, [head.weight, head.bias])
    read, usable = per_image_features(gw, gb, labels)
    assert usable.tolist() == [1.0, 0.0, 1.0, 0.0]
    for j in (0, 2):
        assert torch.nn.functional.cosine_similarity(read[j], h[j], 0) > 0.99
        assert torch.allclose(read[j], h[j], rtol=0.05, atol=0.05)
    assert torch.nn.functional.cosine_similarity(read[1], h[1], 0) < 0.99  # a mixture of two images
    _, none = per_image_features(gw, gb, torch.arange(10).repeat(1))  # every class present: none absent
    assert none.sum() == 0



def _batch_of_8_of_10_classes():
    """An output layer with a far-from-uniform softmax, 8 images' features with a label each of
    10 classes: the layer, features, labels, logits and the layer's gradient (weight, bias)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 10)
    torch.nn.init.normal_(head.weight, std=0.3)
    h = torch.rand(8, 64)
    labels = torch.tensor([3, 0, 9, 1, 4, 6, 2, 8])
    logits = head(h)
    gw, gb = torch.autograd.grad(torch.nn.functional.cross_entropy(logits, labels), [head.weight, head.bias])
    return head, h, labels, logits, gw, gb


def test_with_the_softmax_the_reading_is_exact_for_a_batch_of_8_of_10_classes_and_any_scale():
    """Where the absent classes' rows no longer stand in for the softmax (a trained-looking,
    far from uniform one, most classes present), the reading with the softmax still gives
    every image's own features; a scaled upload (a clipped one) reads the same."""
    from priors import per_image_features

    head, h, labels, logits, gw, gb = _batch_of_8_of_10_classes()
    probs = torch.softmax(logits.detach(), 1)
    approx, _ = per_image_features(gw, gb, labels)
    assert ((approx - h).norm(dim=1) / h.norm(dim=1)).max() > 0.1  # the uniform stand-in blurs here
    for scale in (1.0, 0.05):
        read, usable = per_image_features(scale * gw, scale * gb, labels, probs)
        assert usable.sum() == 8
        assert torch.allclose(read, h, rtol=1e-3, atol=1e-4)


def test_the_upload_alone_gives_its_softmax_and_every_images_features_by_a_fixed_point():
    """The softmax is not shared, but it is the output layer applied to the features: iterating
    the reading and the softmax from the softmax-free reading reaches the batch's own features
    and softmax (8 of 10 classes, where the softmax-free reading is off by more than 10%), with
    a residual that says so; the gradient of another output layer on the same batch, which no
    softmax of this model explains, leaves a residual that says the fit fails."""
    from priors.features import FIXED_POINT_TOLERANCE, observed_reading

    head, h, labels, logits, gw, gb = _batch_of_8_of_10_classes()
    for scale in (1.0, -0.05):  # a local step's update: minus the learning rate times the gradient
        read, probs, residual = observed_reading(scale * gw, scale * gb, labels, head.weight, head.bias)
        assert torch.allclose(read, h, rtol=1e-3, atol=1e-4)
        assert torch.allclose(probs, torch.softmax(logits.detach(), 1), atol=1e-4)
        assert residual < FIXED_POINT_TOLERANCE
    # a gradient that no softmax of the model explains: another layer's output for the same batch
    other = torch.nn.Linear(64, 10)
    gw2, gb2 = torch.autograd.grad(torch.nn.functional.cross_entropy(other(h), labels), [other.weight, other.bias])
    assert observed_reading(gw2, gb2, labels, head.weight, head.bias)[2] > 10 * FIXED_POINT_TOLERANCE


def test_the_features_term_is_zero_at_the_private_batch_and_not_elsewhere():
    from attacks import ATTACKS, observe
    from audit.core.models import build_model

    torch.manual_seed(0)
    model = build_model("convnet", (3, 16, 16), 10, seed=0, batchnorm=False)
    x, y = torch.rand(3, 3, 16, 16), torch.tensor([1, 4, 8])
    obs = observe(model, x, y, seed=0)
    attack = ATTACKS.build("ig", features=1.0, tv=0.0)
    at_truth = attack.evaluate(obs, x, y)["terms"]["features"]
    swapped = attack.evaluate(obs, x.roll(1, 0), y)["terms"]["features"]  # each label given another image
    noise = attack.evaluate(obs, torch.rand(3, 3, 16, 16), y)["terms"]["features"]
    assert float(at_truth) < 1e-8 and float(swapped) > 1e-3 and float(noise) > 1e-3


def test_the_run_reads_the_upload_once_where_its_own_softmax_explains_it_and_says_where_not():
    from attacks import ATTACKS, observe
    from audit.core.models import build_model

    model = build_model("convnet", (3, 16, 16), 10, seed=0, batchnorm=False)
    x, y = torch.rand(3, 3, 16, 16), torch.tensor([1, 4, 8])
    one = ATTACKS.build("ig", features=1.0, tv=0.0).reconstruct(observe(model, x, y, seed=0), 3, 0)
    from audit.report.reasons import word

    note = one.trace["side_information"]["features"]  # codes and numbers; the report words them
    assert note == {"code": "features-read", "params": {"reading": "fixed-point"}}
    assert "with the softmax recovered from it" in word(note)
    steps = observe(model, x, y, seed=0, local_steps=3, local_batch_size=1, shares="update")
    several = ATTACKS.build("ig", features=1.0, tv=0.0).reconstruct(steps, 3, 0)
    misfit = several.trace["side_information"]["features"]["params"]["because"]
    assert misfit["code"] == "softmax-misfit" and misfit["params"]["residual"] > misfit["params"]["tolerance"]
    assert "does not fit it: residual" in word(several.trace["side_information"]["features"])


def test_the_features_term_says_why_it_does_not_apply():
    from attacks import ATTACKS, observe

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10, bias=False))
    x, y = torch.rand(2, 3, 4, 4), torch.tensor([1, 2])
    rec = ATTACKS.build("ig", features=1.0, tv=0.0).reconstruct(observe(model, x, y, seed=0), 3, 0)
    note = rec.trace["side_information"]["features"]  # a code and the reason it holds; the report words it
    assert note["code"] == "side-unused" and note["params"]["why"]["code"] == "features-needs-linear-head"
    from audit.report.reasons import word

    assert word(note) == "not used: the features term needs a model whose last layer is a linear layer with a bias"
    assert "features" not in rec.trace["prior_weights"]
    rec = ATTACKS.build("ig", features=1.0, tv=0.0, labels="optimize").reconstruct(
        observe(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 10)), x, y, seed=0), 3, 0)
    assert "not used: the labels are optimised" in word(rec.trace["side_information"]["features"])


def test_ig_reads_the_features_only_where_the_upload_and_the_dummy_read_alike():
    import dataclasses

    from attacks import ATTACKS, observe
    from attacks.feature_rule import FEATURES_WEIGHT, FEATURES_WEIGHT_DUMMY_SOFTMAX
    from audit.report.reasons import word
    from audit.core.models import build_model

    model = build_model("convnet", (3, 16, 16), 10, seed=0, batchnorm=False)
    x, y = torch.rand(2, 3, 16, 16), torch.tensor([3, 6])
    obs = observe(model, x, y, seed=0)
    rec = ATTACKS.build("ig").reconstruct(obs, 2, 0)
    assert word(rec.trace["side_information"]["features"]).startswith("used") and "features" in rec.trace.side_information_used
    assert rec.trace["prior_weights"]["features"] == FEATURES_WEIGHT
    pruned = dataclasses.replace(obs, gradients=[g * (g.abs() > g.abs().median()) for g in obs.gradients])
    rec = ATTACKS.build("ig").reconstruct(pruned, 2, 0)
    assert "zeroed entries" in word(rec.trace["side_information"]["features"]) and "features" not in rec.trace["prior_weights"]
    wide = torch.rand(6, 3, 16, 16), torch.arange(6)  # 6 of 10 classes present
    rec = ATTACKS.build("ig").reconstruct(observe(model, *wide, seed=0), 2, 0)  # read exactly: on, at full weight
    assert rec.trace["prior_weights"]["features"] == FEATURES_WEIGHT
    steps = dict(local_steps=3, local_batch_size=2, shares="update")  # no softmax of the model explains it
    rec = ATTACKS.build("ig").reconstruct(observe(model, *wide, seed=0, **steps), 2, 0)
    assert "covers more than 50% of the 10 classes" in word(rec.trace["side_information"]["features"])
    rec = ATTACKS.build("ig").reconstruct(observe(model, x, y, seed=0, **{**steps, "local_batch_size": 1}), 2, 0)
    assert rec.trace["prior_weights"]["features"] == FEATURES_WEIGHT_DUMMY_SOFTMAX < FEATURES_WEIGHT
    rec = ATTACKS.build("ig", masks="observed").reconstruct(obs, 2, 0)
    assert "masks or reweights" in word(rec.trace["side_information"]["features"])
    rec = ATTACKS.build("ig", masks="observed", features=0.5).reconstruct(obs, 2, 0)  # a number is the user's call
    assert rec.trace["prior_weights"]["features"] == 0.5
