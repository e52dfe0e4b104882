"""The conv-span attack: the span property of convolution gradients, exact recovery of a deep map
and of the image, a batch, the certificate and the reasons it does not apply."""
import dataclasses
import math

import pytest
import torch
from torch import nn

from audit.client.observe import observe
from audit.core.evidence import aligned_psnr
from audit.core.metrics import match_batches
from audit.core.models import Normalize, build_model
from audit.core.types import trainable_names
from attacks.conv_span import ConvSpan
from attacks.simulator import GradientSimulator
from attacks.conv_span_algebra import patches, row_spaces, span_layers, span_residual
from audit.report.reasons import word


def small_net(seed=0):
    """A strided conv net on 16x16 images whose last two convolutions meet the rank condition
    (16 and 4 positions against 64 and 128 channels)."""
    torch.manual_seed(seed)
    block = lambda cin, cout: [nn.Conv2d(cin, cout, 3, 2, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]  # noqa: E731
    return nn.Sequential(Normalize([0.5] * 3, [0.25] * 3, 3), *block(3, 16), *block(16, 64), *block(64, 128),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))


def smooth_images(n, seed):
    """Images with the low-frequency structure of photos: random 4x4 colour fields, upsampled."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, 4, 4, generator=g)
    return nn.functional.interpolate(coarse, size=(16, 16), mode="bilinear", align_corners=False)


def _input_of(model, name, x):
    kept = {}
    module = dict(model.named_modules())[name]
    handle = module.register_forward_hook(lambda m, i, o: kept.update(x=i[0].detach()))
    try:
        model(x)
    finally:
        handle.remove()
    return kept["x"]


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_resnet_stage4_gradient_spans_its_input_patches_in_float64(mode):
    model = build_model("resnet18", (3, 32, 32), 10, width=16, seed=0).double().train(mode == "train")
    x = torch.rand(1, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([3])
    layers, why = span_layers(model, (3, 32, 32), 1)
    assert why is None and "10.conv1" in [l.name for l in layers] and "6.conv1" not in [l.name for l in layers]
    grads = dict(zip(trainable_names(model), torch.autograd.grad(
        nn.functional.cross_entropy(model(x), y), [p for p in model.parameters() if p.requires_grad])))
    layer = next(l for l in layers if l.name == "10.conv1")
    spaces, broken = row_spaces({"10.conv1": grads["10.conv1.weight"]}, [layer], 1, centred=mode == "train")
    assert not broken and spaces[0].basis.shape[0] == 16 - (mode == "train")
    conv = dict(model.named_modules())["10.conv1"]
    true_map = _input_of(model, "10.conv1", x)
    assert float(span_residual(spaces[0], conv, true_map)) < 1e-20  # squared share outside: ~(1e-15)^2
    other = _input_of(model, "10.conv1", torch.rand(1, 3, 32, 32, dtype=torch.float64))
    assert float(span_residual(spaces[0], conv, other)) > 1e-2  # another image: ~0.09
    # the rank is the number of positions (less one in train mode), not the output channels
    s = torch.linalg.svdvals(grads["10.conv1.weight"].reshape(128, -1))
    assert float(s[15 - (mode == "train")] / s[0]) > 1e-8 and float(s[16 - (mode == "train")] / s[0]) < 1e-12


def resnet(seed=0):
    """The registered ResNet-18 at width 32 on 16x16 images: stages 3 and 4 (4x4 and 2x2 maps,
    128 and 256 channels) meet the rank condition."""
    return build_model("resnet18", (3, 16, 16), 10, width=32, seed=seed)


def test_vgg_style_gradient_spans_its_input_patches():
    model = small_net().double().eval()
    x = smooth_images(1, 0).double()
    layers, _ = span_layers(model, (3, 16, 16), 1)
    assert [l.name for l in layers] == ["4", "7"]
    grads = dict(zip(trainable_names(model), torch.autograd.grad(
        nn.functional.cross_entropy(model(x), torch.tensor([2])), list(model.parameters()))))
    spaces, _ = row_spaces({n: grads[f"{n}.weight"] for n in ("4", "7")}, layers, 1, centred=False)
    modules = dict(model.named_modules())
    assert all(float(span_residual(s, modules[s.layer.name], _input_of(model, s.layer.name, x))) < 1e-20
               for s in spaces)


def test_recovers_the_image_and_its_deep_map_exactly_and_certifies_it():
    model = resnet()
    x, y = smooth_images(1, 0), torch.tensor([4])
    rec = ConvSpan().reconstruct(observe(model, x, y, None, client_mode="eval"), budget=100, seed=0)
    assert rec.applicable, rec.reason
    assert rec.trace["layers"][0] == "8.conv1" and rec.trace["certified"], rec.trace
    assert float(aligned_psnr(rec.inputs, x)) > 40
    assert rec.labels.tolist() == [4]
    model.eval()
    truth, mine = _input_of(model, "8.conv1", x), _input_of(model, "8.conv1", rec.inputs)  # stage 2's 8x8x64 output
    assert float((mine - truth).norm() / truth.norm()) < 1e-3


def test_a_batch_of_two_is_parted_into_both_exact_images_and_their_labels():
    model = resnet(1)
    x, y = smooth_images(2, 5), torch.tensor([4, 9])
    rec = ConvSpan().reconstruct(observe(model, x, y, None, client_mode="eval"), budget=200, seed=0)
    # both images' patches fill the row space (the true pair scores 1e-5 to 3e-4 in float32, one image copied 0.5)
    assert rec.applicable and rec.trace["residual"] < 1e-3, rec.trace
    order = match_batches(rec.inputs, x)
    assert min(float(aligned_psnr(rec.inputs[order][i:i + 1], x[i:i + 1])) for i in range(2)) > 40
    assert sorted(rec.labels.tolist()) == [4, 9]


def _train_mode_fit(truth, recovered):
    """The colour fit of ``recovered`` against the train-mode, float64 upload of ``truth`` (label 2)
    on the test ResNet with the data normalisation declared: the fitted images and the certificate."""
    model = build_model("resnet18", (3, 16, 16), 10, width=32, mean=[0.5] * 3, std=[0.25] * 3, seed=0)
    y = torch.tensor([2])
    obs = observe(model.double(), truth.double(), y, None, client_mode="train")
    obs = dataclasses.replace(obs, data_mean=(0.5,) * 3, data_std=(0.25,) * 3)
    sim = GradientSimulator()
    images, _, error, _ = ConvSpan()._fit(obs, sim, sim.prepare(obs), recovered, y)
    return images, error


def test_train_mode_colour_fit_keeps_the_recovered_image_and_finds_its_gain():
    # under train-mode BatchNorm the residual returns the normalised image up to a gain (here 8x, far
    # out of the data's range); the fit must keep its pattern and sign and bring it back in range
    x = smooth_images(1, 3)
    images, error = _train_mode_fit(x, 0.5 + 8 * (x.double() - 0.5))
    fitted = images.clamp(0, 1).float()
    assert float(aligned_psnr(fitted, x)) > 40  # the pattern kept, no channel flipped
    plain = float(10 * torch.log10(1 / (fitted - x).pow(2).mean()))
    assert plain > 40 and error < 1e-2, (plain, error)  # and the gain found: the upload reproduced


def test_certificate_refused_where_the_defense_changes_the_head():
    def noisy_head(model, inputs, labels, *, loss_fn, generator):
        grads = torch.autograd.grad(loss_fn(model(inputs), labels), [p for p in model.parameters() if p.requires_grad])
        g = torch.Generator().manual_seed(0)
        return [*grads[:-2], *(t + 0.5 * t.std() * torch.randn(t.shape, generator=g) for t in grads[-2:])]

    x, y = smooth_images(1, 0), torch.tensor([4])
    rec = ConvSpan(fit=2).reconstruct(observe(resnet(), x, y, noisy_head, client_mode="eval"), budget=30, seed=0)
    assert rec.applicable and rec.trace["layers"][0] == "8.conv1"  # the convolutions are whole: it runs
    assert float(aligned_psnr(rec.inputs, x)) > 20  # and finds the image (its colour fitted to a noisy upload)
    assert not rec.trace["certified"] and rec.trace["certificate_error"] > 1e-2  # but the upload is not reproduced


def test_noise_on_every_layer_breaks_every_gap():
    def noisy(model, inputs, labels, *, loss_fn, generator):
        grads = torch.autograd.grad(loss_fn(model(inputs), labels), [p for p in model.parameters() if p.requires_grad])
        g = torch.Generator().manual_seed(0)
        return [t + 0.01 * t.std() * torch.randn(t.shape, generator=g) for t in grads]

    rec = ConvSpan().reconstruct(observe(resnet(), smooth_images(1, 0), torch.tensor([4]), noisy), budget=10)
    assert not rec.applicable and rec.reason.code == "conv-span-no-gap"
    assert "rank" in word(rec.reason) and "perturbed" in word(rec.reason)


def test_not_applicable_without_a_conv_that_meets_the_rank_condition():
    model = build_model("cnn", (3, 32, 32), 10)
    rec = ConvSpan().reconstruct(observe(model, torch.rand(1, 3, 32, 32), torch.tensor([0])), budget=10)
    assert not rec.applicable and "rank condition" in word(rec.reason) and "'4'" in word(rec.reason)


def test_not_applicable_for_a_batch_too_large_for_the_span():
    rec = ConvSpan().reconstruct(observe(resnet(), smooth_images(64, 0), torch.arange(64) % 10), budget=10)
    assert not rec.applicable and rec.reason.params["largest"] == 63
    assert "holds up to a batch of 63" in word(rec.reason)


def test_an_update_after_local_sgd_steps_is_read_as_the_union_of_the_steps_spans():
    # three full-batch steps: the update's row space is the union of the three steps' patch spans,
    # which holds the image's patches at the shared weights
    x = smooth_images(1, 0)
    obs = observe(resnet(), x, torch.tensor([4]), None, client_mode="eval", local_steps=3, local_lr=0.1,
                  shares="update")
    rec = ConvSpan().reconstruct(obs, budget=80, seed=0)
    assert rec.applicable, rec.reason
    assert max(rec.trace["gaps"]) < 1e-3 and rec.trace["certified"], rec.trace
    assert float(aligned_psnr(rec.inputs, x)) > 40


@pytest.mark.parametrize("training, code", [(dict(optimizer="adam"), "conv-span-nonlinear-steps"),
                                            (dict(optimizer="sgd:weight_decay=0.0005"), "conv-span-nonlinear-steps"),
                                            (dict(local_batch_size=1), "conv-span-minibatch-steps")])
def test_not_applicable_after_steps_whose_update_is_no_union_of_patch_spans(training, code):
    obs = observe(resnet(), smooth_images(2, 0), torch.tensor([4, 5]), None, local_steps=2, local_lr=0.1,
                  **training)
    rec = ConvSpan().reconstruct(obs, budget=10)
    assert not rec.applicable and rec.reason.code == code, rec.reason
    assert "local steps" in word(rec.reason)


def test_a_batch_too_large_for_the_span_of_every_step_is_refused():
    obs = observe(resnet(), smooth_images(20, 0), torch.arange(20) % 10, None, local_steps=4, local_lr=0.1)
    rec = ConvSpan().reconstruct(obs, budget=10)
    assert not rec.applicable and rec.reason.params["largest"] == 15 and "4 local step(s)" in word(rec.reason)


def test_the_planner_plans_it_where_the_rank_condition_holds_and_the_control_runs_it():
    from adaptive.planner.plan import plan
    from audit.engine.control import base_form

    identity = lambda model, inputs, labels, *, loss_fn, generator: list(torch.autograd.grad(  # noqa: E731
        loss_fn(model(inputs), labels), [p for p in model.parameters() if p.requires_grad]))
    planned = plan(identity, resnet(), (3, 16, 16), 10)
    conv = planned.get("conv-span")
    assert conv is not None and not conv.adaptive and "8.conv1" in conv.why.params["layers"]
    assert "their weight gradient's row space is the span of their input's patches" in word(conv.why)
    assert base_form("conv-span", {}) == "conv-span"  # a base attack: the positive control runs it too
    assert plan(identity, build_model("cnn", (3, 16, 16), 10), (3, 16, 16), 10).get("conv-span") is None


def test_levenberg_marquardt_stops_where_the_residual_does_not_move():
    from attacks.conv_span import _gauss_newton
    theta = torch.tensor([0.3, -1.0], dtype=torch.float64)
    out, used = _gauss_newton(lambda t: torch.ones(5, dtype=torch.float64), theta, 10)
    assert torch.equal(out, theta) and used == 3  # one residual, one Jacobian of two columns, then it stops
    fitted, _ = _gauss_newton(lambda t: t - torch.tensor([2.0, 5.0], dtype=torch.float64), theta, 10)
    assert torch.allclose(fitted, torch.tensor([2.0, 5.0], dtype=torch.float64))


def test_several_observations_run_side_by_side_give_each_one_its_own_result():
    model = resnet()
    attack = ConvSpan(evaluations=40, fit=2)
    observations = [observe(model, smooth_images(1, k), torch.tensor([k]), None, client_mode="eval") for k in (0, 1)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [attack.reconstruct(o, None, seed) for o, seed in zip(observations, (3, 4))]
        torch.set_num_threads(2)
        seen = []
        together = attack.reconstruct_many(observations, None, [3, 4], progress=lambda n, of, loss: seen.append((n, of)))
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(alone, together):
        assert torch.equal(a.inputs, b.inputs) and a.labels.tolist() == b.labels.tolist()
    assert not torch.equal(together[0].inputs, together[1].inputs)  # each its own observation and seed
    assert seen[-1][0] == seen[-1][1] and len({of for _, of in seen}) == 1  # progress counts both members to the end


def test_colour_fit_never_flattens_a_stalled_image_into_the_zero_upload():
    # a wrong image under train-mode BatchNorm: no gain reproduces the upload better than sharing
    # nothing, and shrinking the image toward flat moves the replay toward zero; the fit keeps it
    wrong = smooth_images(1, 11).double()
    images, error = _train_mode_fit(smooth_images(1, 3), wrong)
    assert error >= 1  # not certified, and said so
    spread = float(((images - 0.5) / 0.25).std())
    assert 0.5 < spread < 2 and float(aligned_psnr(images.clamp(0, 1).float(), wrong.float())) > 40
