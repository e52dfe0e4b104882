"""SPEAR: exact batch recovery through a ReLU-followed linear layer, its certificate, labels,
where it does not apply, the planner's rule and the leak rule's "exact" label."""
import pytest
import torch
from torch import nn

from attacks import ATTACKS, observe
from attacks.spear import Spear, labels_from_batch, low_rank_factors, relu_linear_layers
from audit.core.errors import ConfigError
from audit.core.metrics import score
from audit.core.models import build_model
from audit.report.reasons import word

pytestmark = pytest.mark.usefixtures("one_thread")

SHAPE = (3, 8, 8)


def _batch(b, seed=0, classes=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(b, *SHAPE, generator=g)
    y = torch.randperm(classes, generator=g)[:b] if b <= classes else torch.randint(classes, (b,), generator=g)
    return x, y


def _mlp(seed=0, hidden=(48, 24)):
    return build_model("mlp", SHAPE, 6, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3), hidden=hidden, seed=seed)


def _matched(rec, x, y):
    """Per-image PSNR and label accuracy after matching (SPEAR finds the images in no set order)."""
    scores = score(rec.inputs, rec.labels, x, y)
    return list(scores["psnr"].per_image), scores["label_accuracy"].value


def test_mlp_batch_is_recovered_exactly_with_certificate_and_labels():
    model = _mlp()
    x, y = _batch(6)
    rec = ATTACKS.build("spear").reconstruct(observe(model, x, y), None, 0)
    assert rec.applicable and rec.trace["certified"]
    assert rec.trace["certificate_error"] < 1e-4
    per_image, label_accuracy = _matched(rec, x, y)
    assert min(per_image) > 60
    assert label_accuracy == 1.0  # each label read off its recovered image
    assert rec.trace["labels_from"] == "recovered-batch"
    assert rec.trace["layer"] == "2"  # after Normalize and Flatten


def test_fedavg_update_with_local_steps_is_recovered_and_certified_by_replay():
    model = _mlp(1)
    x, y = _batch(4, 1)
    obs = observe(model, x, y, local_steps=3, local_lr=0.05)
    rec = ATTACKS.build("spear").reconstruct(obs, None, 0)
    assert rec.trace["certified"], rec.trace
    assert min(_matched(rec, x, y)[0]) > 50


def test_noisy_upload_is_not_certified_and_says_so():
    model = _mlp(2)
    x, y = _batch(4, 2)
    obs = observe(model, x, y)
    g = torch.Generator().manual_seed(5)
    obs.gradients = [t + 0.5 * t.std() * torch.randn(t.shape, generator=g) for t in obs.gradients]
    rec = Spear(samples=8192).reconstruct(obs, None, 0)
    assert not rec.trace["certified"] and "no selection of directions" in word(rec.trace["uncertified"])
    assert not rec.trace.get("failed_to_optimise")  # a reconstruction to score, never a silent "exact"
    assert rec.trace.get("certificate_error", float("inf")) > 1e-3


def test_labels_from_batch_use_the_classifier_gradient_not_the_order():
    model = _mlp(3)
    x, y = _batch(5, 3)
    obs = observe(model, x, y)
    tail = nn.Sequential(*list(obs.model)[2:])  # the layers from the first linear one on, as the server has them
    z = model[1](model[0](x))  # the exact inputs of the first linear layer
    assert labels_from_batch(obs, tail, z).tolist() == y.tolist()
    assert labels_from_batch(obs, tail, z.flip(0)).tolist() == y.flip(0).tolist()


def test_low_rank_factors_reproduce_a_rank_b_matrix():
    g = torch.Generator().manual_seed(0)
    a, c = torch.randn(20, 3, generator=g), torch.randn(3, 30, generator=g)
    left, right, floor = low_rank_factors(a @ c, 3)
    assert floor < 1e-6  # exactly rank 3: no noise above float32 rounding
    assert left.dtype == torch.float64 and left.shape == (20, 3) and right.shape == (3, 30)
    assert torch.allclose(left @ right, (a @ c).double(), atol=1e-5)


def test_cnn_features_are_recovered_exactly():
    from audit.core.data import load_dataset

    data = load_dataset("embedded", None, 32)  # natural images: the features' ReLU pattern varies per image
    model = build_model("cnn", data.input_shape, data.num_classes, seed=0)
    x, y = data.test_images[4:8], data.test_labels[4:8]
    rec = ATTACKS.build("spear").reconstruct(observe(model, x, y), None, 0)
    assert not rec.applicable and rec.reason.code == "spear-features-not-image"  # not the images
    assert "features" in word(rec.reason)
    assert rec.trace["certified"] and rec.trace["layer_input"] == "features"
    layers = list(model)
    index = next(i for i, m in enumerate(layers) if isinstance(m, nn.Linear))
    truth = nn.Sequential(*layers[:index])(x)
    found = rec.trace["features"]
    distance = torch.cdist(found.double(), truth.double())  # each recovered row is one image's features
    order = distance.argmin(1)
    assert sorted(order.tolist()) == list(range(4))
    assert float(distance.min(1).values.max()) < 1e-4 * float(truth.norm(dim=1).min())
    assert rec.labels.tolist() == y[order].tolist()


def test_where_spear_does_not_apply_it_says_why():
    x, y = _batch(2)
    lenet = build_model("lenet", SHAPE, 6)  # sigmoid, one linear layer at the end
    rec = ATTACKS.build("spear").reconstruct(observe(lenet, x, y), None, 0)
    assert not rec.applicable and "Linear layer followed by ReLU" in word(rec.reason)
    cnn = build_model("cnn", SHAPE, 6)
    obs = observe(cnn, x, y, local_steps=2, local_lr=0.1)
    rec = ATTACKS.build("spear").reconstruct(obs, None, 0)
    assert not rec.applicable and rec.reason.code == "spear-local-steps"
    assert "features" in word(rec.reason) and "change" in word(rec.reason)
    assert relu_linear_layers(build_model("convnet", SHAPE, 6, width=2))[0] == []


def test_bad_settings_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="samples"):
        ATTACKS.build("spear", samples=0)
    with pytest.raises(ConfigError, match="zero_tol"):
        ATTACKS.build("spear", zero_tol=2.0)


def test_planner_plans_spear_on_clean_and_gaussian_uploads_not_on_pruned_ones():
    from adaptive.planner.plan import plan
    from audit.core.types import NoDefense
    from defenses import DEFENSES

    clean = plan(NoDefense())
    assert "spear" in clean.names() and "rank" in word(clean.get("spear").why)
    assert "spear" in plan(DEFENSES.build("gaussian")).names()
    assert "spear" not in plan(DEFENSES.build("prune")).names()  # pruning breaks the rank and the zeros
    behind_convolutions = plan(NoDefense(), build_model("cnn", SHAPE, 6, seed=0), SHAPE, 6)
    assert "spear-ig" in behind_convolutions.names() and "spear" not in behind_convolutions.names()
    assert "features" in word(behind_convolutions.get("spear-ig").why)
    assert "spear" in plan(NoDefense(), _mlp(), SHAPE, 6).names()


def test_leak_rule_labels_exact_only_recovered_images_with_a_certificate_or_at_its_psnr():
    from audit.core.records import ImageClass
    from audit.report.rule import LeakRule

    rule = LeakRule()
    assert rule.exact(ImageClass.RECOVERED, 1e-7)
    assert not rule.exact(ImageClass.RECOVERED, None)  # no certificate: never exact
    assert not rule.exact(ImageClass.RECOVERED, 0.05)  # reproduces the upload only roughly
    assert not rule.exact(ImageClass.PARTIAL, 1e-7)
    assert not LeakRule(exact_error=1e-9).exact(ImageClass.RECOVERED, 1e-7)
    with pytest.raises(ConfigError, match="exact_error"):
        LeakRule(exact_error=0)
    # the auditor's measure: a recovered image at 40 dB aligned is exact whatever its certificate
    assert rule.exact(ImageClass.RECOVERED, 0.05, 40.0) and rule.exact(ImageClass.RECOVERED, None, 85.1)
    assert not rule.exact(ImageClass.RECOVERED, 0.05, 39.9)
    assert not rule.exact(ImageClass.PARTIAL, None, 90.0)  # not recovered: never exact
    assert not LeakRule(exact_db=90).exact(ImageClass.RECOVERED, None, 85.1)
    with pytest.raises(ConfigError, match="exact_db"):
        LeakRule(exact_db=0)
    # a rule stored before the PSNR threshold keeps labelling by the certificate alone; today's round-trips
    old = LeakRule.stored({"margin_db": 1.0})
    assert old.exact_db is None and not old.exact(ImageClass.RECOVERED, None, 90.0) and "PSNR reaches" not in old.describe()
    assert LeakRule.stored(rule.to_dict()) == rule and LeakRule.from_dict(rule.to_dict()) == rule
    assert LeakRule.from_dict({"margin_db": 2}).exact_db == 40.0  # a user's thresholds get the default


def test_spear_ig_adds_the_exact_features_term_paired_with_spears_labels():
    from attacks.spear_features import ExactFeatures
    from audit.core.data import load_dataset

    data = load_dataset("embedded", None, 32)
    model = build_model("cnn", data.input_shape, data.num_classes, seed=0)
    x, y = data.test_images[4:8], data.test_labels[4:8]
    rec = ATTACKS.build("spear-ig").reconstruct(observe(model, x, y), 2, 0)
    assert "exact-features" in rec.trace["prior_weights"] and rec.trace["spear"]["certificate_error"] < 1e-3
    assert sorted(rec.labels.tolist()) == sorted(y.tolist())
    prefix = nn.Sequential(*list(model)[:8])
    term = ExactFeatures(prefix, prefix(x).flatten(1))
    assert float(term(x, None)) < 1e-10 < float(term(x.flip(0), None))  # zero only for each image in its row
    plain = ATTACKS.build("spear-ig").reconstruct(observe(_mlp(), *_batch(2)), 2, 0)
    assert "exact-features" not in plain.trace["prior_weights"] and plain.trace["spear"]  # says why not


def test_cli_attack_names_why_spear_does_not_apply(tmp_path):
    from click.testing import CliRunner

    from cli import main

    result = CliRunner().invoke(main, ["attack", "--attack", "spear", "--model", "lenet", "--batch", "2", "--size", "8",
                                       "--quiet", "--out", str(tmp_path)])
    assert result.exit_code == 0
    assert result.output.strip().splitlines()[-1].startswith(
        "spear: not applicable: the model has no biased Linear layer followed by ReLU")


def test_one_label_cnn_batch_needs_the_inputs_zeros_and_is_then_certified():
    """Eight images of one label on an untrained cnn: their dZ columns differ only by their
    masks, so differences of two images recur like true directions and dZ's zeros alone give
    no certificate; the features' zeros (the other side) do, and give each image's features."""
    from audit.core.data import load_dataset

    data = load_dataset("embedded", None, 32)
    model = build_model("cnn", data.input_shape, data.num_classes, seed=0)
    x, y = data.test_images[0:8], data.test_labels[0:8]
    assert len(set(y.tolist())) == 1
    obs = observe(model, x, y)
    alone = Spear(input_samples=0).reconstruct(obs, None, 0)
    assert not alone.trace.get("certified")
    rec = Spear().reconstruct(obs, None, 0)
    assert rec.trace["certified"] and rec.trace["from_input_zeros"] and rec.trace["input_samples"] > 0
    index = next(i for i, layer in enumerate(model) if isinstance(layer, nn.Linear))
    truth = nn.Sequential(*list(model)[:index])(x).double()
    distance = torch.cdist(rec.trace["features"].double(), truth)
    assert sorted(distance.argmin(1).tolist()) == list(range(8))
    assert float(distance.min(1).values.max()) < 1e-4 * float(truth.norm(dim=1).min())


def test_completion_recovers_the_columns_no_input_row_was_found_for():
    """Rows of Q^-1 known for some images of a ReLU layer's batch: the missing images' columns
    come from the null space's sparsest dZ columns, the known images' from where their known
    inputs make the layer inactive (up to the inputs' scale), in a float32 upload."""
    from attacks.spear_algebra import Layer
    from attacks.spear_dual import complete

    g = torch.Generator().manual_seed(3)
    b, n, m = 6, 300, 80
    x = torch.rand(b, n, generator=g, dtype=torch.float64) * (torch.rand(b, n, generator=g) > 0.3)
    weight = torch.randn(m, n, generator=g, dtype=torch.float64) / n ** 0.5
    bias = torch.randn(m, generator=g, dtype=torch.float64) * 0.3
    dz = torch.randn(b, m, generator=g, dtype=torch.float64) * ((x @ weight.T + bias) > 0)
    left, right, _ = low_rank_factors((dz.T @ x).float(), b)  # an upload in float32, as clients send it
    layer = Layer(left, right, dz.sum(0), right @ weight.T, bias[None], 1e-5)
    p = x @ torch.linalg.pinv(right)  # the true rows of Q^-1 in this factorisation
    truth = torch.linalg.inv(p)
    truth = truth / truth.norm(dim=0, keepdim=True)
    for known in (4, 5):  # two columns missing, then one (the null space is the missing column)
        q = complete(p[:known] * torch.linspace(0.5, 2.0, known, dtype=torch.float64)[:, None], layer, g, 1e-5)
        assert q is not None
        cos = (q.T @ truth).abs()
        assert bool((cos.max(1).values > 1 - 1e-6).all()) and sorted(cos.argmax(1).tolist()) == list(range(b))


def test_a_single_image_is_its_gradients_one_direction_exact_clean_and_never_a_crash_noisy():
    """At batch 1 the layer's gradient has rank one: its one direction needs no sampling, and a
    noisy upload leaves spear-ig an ig with the reason, not an error."""
    x, y = _batch(1, 3)
    rec = Spear().reconstruct(observe(_mlp(), x, y), None, 0)
    psnr, acc = _matched(rec, x, y)
    assert rec.trace["certified"] and rec.trace["samples"] == 0 and psnr[0] > 100 and acc == 1.0
    from audit.core.data import load_dataset

    data = load_dataset("embedded", None, 32)
    model = build_model("cnn", data.input_shape, data.num_classes, seed=0)
    obs = observe(model, data.test_images[4:5], data.test_labels[4:5])
    g = torch.Generator().manual_seed(5)
    obs.gradients = [t + 0.1 * t.std() * torch.randn(t.shape, generator=g) for t in obs.gradients]
    noisy = ATTACKS.build("spear-ig").reconstruct(obs, 2, 0)
    assert noisy.inputs is not None and torch.isfinite(noisy.inputs).all()
    assert "reproduced the upload" in word(noisy.trace["spear"]) and "exact-features" not in noisy.trace["prior_weights"]
