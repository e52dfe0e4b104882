"""The client's local training as it is run: the shared unroll against torch.optim, the
uploaded BatchNorm buffers and what they reveal, and the bad inputs named before any work."""
import copy

import pytest
import torch
from torch import nn

from audit.client.observe import observe
from audit.core.buffers import revealed_statistics
from audit.core.errors import ConfigError
from audit.core.local_training import LocalOptimizer, torch_optimizer
from audit.core.types import Observation, trainable_parameters
from attacks.simulator import ClientReplica, GradientSimulator, SimContext
from audit.report.reasons import word


def small_bn_net(seed=0, momentum=0.1):
    # bias-free convolutions before BatchNorm, as deployed: such a bias's gradient is float
    # noise around 0, which Adam's normalisation would amplify into a meaningless comparison
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 5))


def batch(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


OPTIMIZERS = ["sgd", "sgd:weight_decay=0.01", "sgd:momentum=0.9", "sgd:momentum=0.9,nesterov=1,weight_decay=5e-4",
              "sgd:momentum=0.5,dampening=0.3", "adam", "adam:weight_decay=0.01,beta1=0.8",
              "adamw:weight_decay=0.05"]


@pytest.mark.parametrize("spec", OPTIMIZERS)
def test_unroll_matches_torch_optim(spec):
    """The update the client simulation shares is what torch.optim's training loop makes on
    the same mini-batches, and so are the uploaded buffers."""
    net, (x, y) = small_bn_net(), batch()
    opt, steps, lr, local_batch = LocalOptimizer.parse(spec), 4, 0.05, 4
    obs = observe(net, x, y, local_steps=steps, local_lr=lr, local_batch_size=local_batch, optimizer=opt,
                  shares="state", seed=0)
    client = copy.deepcopy(net).train()
    params = trainable_parameters(client)
    start = [p.detach().clone() for p in params]
    optim = torch_optimizer(opt, params, lr)
    rows = [slice(0, 4), slice(4, 6), slice(0, 4), slice(4, 6)]
    for k in range(steps):
        optim.zero_grad()
        nn.functional.cross_entropy(client(x[rows[k]]), y[rows[k]]).backward()
        optim.step()
    expected = [(a - p.detach()) / lr for a, p in zip(start, params)]
    for got, want in zip(obs.gradients, expected):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-5)
    for name, buf in client.named_buffers():
        torch.testing.assert_close(obs.buffers[name], buf)
    assert obs.threat_model()["shares"] == "state"


def test_momentum_update_differs_from_plain_steps():
    """The optimiser is really run: momentum changes the shared update."""
    net, (x, y) = small_bn_net(), batch()
    plain = observe(net, x, y, local_steps=3, local_lr=0.1, seed=0)
    heavy = observe(net, x, y, local_steps=3, local_lr=0.1, optimizer="sgd:momentum=0.9", seed=0)
    ratio = torch.cat([g.flatten() for g in heavy.gradients]).norm() / torch.cat(
        [g.flatten() for g in plain.gradients]).norm()
    assert ratio > 1.3


@pytest.mark.parametrize("steps,local_batch", [(1, None), (3, 2)])
def test_buffers_reveal_the_batch_statistics(steps, local_batch):
    """One step: the upload gives the exact per-channel mean and unbiased variance of each
    BatchNorm input; several: the momentum-weighted mixture the replica predicts from the
    true images."""
    net, (x, y) = small_bn_net(momentum=0.3), batch()
    obs = observe(net, x, y, local_steps=steps, local_lr=0.1, local_batch_size=local_batch, shares="state", seed=0)
    revealed, why = revealed_statistics(obs.model, obs.buffers, obs.local_steps, obs.client_mode)
    assert revealed is not None, why
    if steps == 1:
        first = net[0](x)  # the first BatchNorm's input, computed independently
        torch.testing.assert_close(revealed.means[0], first.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(revealed.variances[0], first.var((0, 2, 3), unbiased=True), rtol=1e-4, atol=1e-5)
    replica, simulator = ClientReplica(obs), GradientSimulator()
    _, feats = simulator(replica, x, y, functional=False, context=SimContext(obs))
    for layer, (mean, var) in enumerate(zip(revealed.means, revealed.variances)):
        weights = revealed.weights[layer]
        assert len(weights) == steps and abs(sum(weights) - 1) < 1e-9
        predicted_mean = sum(w * s[layer][0] for w, s in zip(weights, feats["bn_steps"]))
        predicted_var = sum(w * s[layer][1] for w, s in zip(weights, feats["bn_steps"]))
        torch.testing.assert_close(predicted_mean.detach(), mean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(predicted_var.detach(), var, rtol=1e-4, atol=1e-5)


def test_eval_mode_and_gradient_share_nothing_extra():
    net, (x, y) = small_bn_net(), batch()
    obs = observe(net, x, y, client_mode="eval", shares="state", seed=0)
    revealed, why = revealed_statistics(obs.model, obs.buffers, 1, "eval")
    assert revealed is None and why.code == "buffers-eval-mode" and "eval mode" in word(why)
    plain = observe(net, x, y, seed=0)
    assert plain.shares == "gradient" and plain.buffers is None


@pytest.mark.parametrize("call,message", [
    (lambda: LocalOptimizer.parse("rmsprop"), "unknown local optimizer"),
    (lambda: LocalOptimizer.parse("sgd:momentum=1.0"), "momentum must be in [0, 1)"),
    (lambda: LocalOptimizer.parse("sgd:momentum=-0.1"), "momentum must be in [0, 1)"),
    (lambda: LocalOptimizer.parse("sgd:lr=0.1"), "unknown local optimizer setting"),
    (lambda: LocalOptimizer.parse("adam:momentum=0.9"), "not momentum"),
    (lambda: LocalOptimizer.parse("sgd:nesterov=1"), "nesterov needs momentum"),
    (lambda: observe(nn.Sequential(nn.Flatten(), nn.Linear(192, 5)), *batch(2), shares="state"),
     "no BatchNorm running statistics"),
    (lambda: observe(small_bn_net(), *batch(2), local_steps=2, local_lr=0.1, shares="gradient"),
     "uploads an update, not a gradient"),
])
def test_bad_training_descriptions_are_named(call, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        call()


# --------------------------------------------------------------------------- the attacker's side
def _attack_loss_at(obs, images, labels, **knobs):
    from attacks import ATTACKS

    return ATTACKS.build("ig", tv=0.0, **knobs).evaluate(obs, images, labels)["terms"]


@pytest.mark.parametrize("steps", [1, 3])
def test_bn_upload_term_is_zero_at_the_private_batch_only(steps):
    """The replica's unroll predicts the uploaded buffers exactly at the private images (the
    term vanishes there, one step or the momentum-weighted mixture of three) and not at others."""
    net, (x, y) = small_bn_net(momentum=0.2), batch(3)
    obs = observe(net, x, y, local_steps=steps, local_lr=0.05, optimizer="sgd:momentum=0.9", shares="state", seed=0)
    at_truth = _attack_loss_at(obs, x, y)
    other = 0.3 + 0.4 * torch.rand(x.shape, generator=torch.Generator().manual_seed(7))  # other statistics
    at_other = _attack_loss_at(obs, other, y)
    assert float(at_truth["bn-upload"]) < 1e-6
    assert float(at_other["bn-upload"]) > 1e-2
    assert float(at_truth["match"]) < 1e-4  # the unroll through momentum reproduces the update


def test_attack_that_assumes_plain_sgd_misses_the_update():
    """Unrolling the client's real optimiser matters: at the private images the update of three
    momentum steps is matched only by a replica that runs momentum."""
    import dataclasses

    from audit.core.local_training import LocalOptimizer

    net, (x, y) = small_bn_net(), batch(3)
    real = observe(net, x, y, local_steps=3, local_lr=0.1, optimizer="sgd:momentum=0.9", shares="update", seed=0)
    assumed = dataclasses.replace(real, training=dataclasses.replace(real.training, optimizer=LocalOptimizer()))
    exact, wrong = float(_attack_loss_at(real, x, y)["match"]), float(_attack_loss_at(assumed, x, y)["match"])
    assert exact < 1e-5 and wrong > 1e-3


def test_side_information_is_reported_where_it_does_not_apply():
    from attacks import ATTACKS

    net, (x, y) = small_bn_net(), batch(2)
    for shares, expected in (("update", "does not share its buffers"), ("state", "used (weight")):
        obs = observe(net, x, y, local_steps=1, shares=shares, seed=0)
        rec = ATTACKS.build("ig").reconstruct(obs, budget=2, seed=0, progress=lambda *a: None)
        assert expected in word(rec.trace["side_information"]["bn-upload"])  # stored as a code, worded by the report
    obs = observe(net, x, y, shares="state", seed=0)
    rec = ATTACKS.build("ig", bn_upload=0).reconstruct(obs, budget=2, seed=0, progress=lambda *a: None)
    assert rec.trace["side_information"]["bn-upload"]["code"] == "bn-upload-off"
    assert "switched off" in word(rec.trace["side_information"]["bn-upload"])
    assert "bn-upload" not in rec.trace["final_terms"]


def test_decoy_uploads_its_own_statistics():
    """A decoy shares nothing private: its buffers record the decoy batch, not the private one."""
    from defenses import resolve_defense

    net, (x, y) = small_bn_net(), batch(2)
    decoy = resolve_defense("decoy")
    obs = observe(net, x, y, decoy, shares="state", seed=0)
    revealed, _ = revealed_statistics(obs.model, obs.buffers, 1, "train")
    flat = decoy.buffer_inputs(x)
    torch.testing.assert_close(revealed.means[0], net[0](flat).mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(revealed.means[0], net[0](x).mean((0, 2, 3)), atol=1e-3)


# --------------------------------------------------------------------------- the audit
AUDIT = dict(model="convnet", model_args={"width": 4}, image_size=16, budget=3, utility=False, progress=False,
             steps=[0], images=1, attacks=["ig"])


def test_audit_of_a_state_upload_lists_what_was_shared(tmp_path):
    import json

    from audit.engine import audit

    report = audit.run(defense="gaussian", shares="state", local_optimizer="sgd:momentum=0.9", local_steps=2,
                       local_lr=0.05, out=tmp_path, **AUDIT)
    data = json.loads((tmp_path / "report.json").read_text())
    threat = data["threat_model"]
    assert threat["shares"] == "state" and "buffer" in threat["shared"]
    assert "untouched" in threat["buffers"]
    assert "momentum=0.9" in threat["local_optimizer"]
    assert data["plan"]["side_information"]["bn-upload"].startswith("used")
    assert report.out == tmp_path


@pytest.mark.parametrize("settings,message", [
    (dict(model="mlp", model_args={"hidden": 8}, shares="state"), "no BatchNorm running statistics"),
    (dict(local_optimizer="sgd:momentum=1"), "momentum must be in"),
    (dict(local_optimizer="lamb"), "unknown local optimizer"),
    (dict(local_steps=3, shares="gradient"), "uploads an update"),
    (dict(local_steps=2, local_epochs=1), "not both"),
    (dict(server_optimizer="sgd:nesterov=1"), "nesterov needs momentum"),
])
def test_audit_rejects_bad_training_descriptions_before_work(tmp_path, settings, message):
    from audit.engine import audit

    with pytest.raises(ConfigError, match=message):
        audit.run(defense="none", out=tmp_path, **{**AUDIT, **settings})
    assert not any(tmp_path.iterdir())  # nothing was written: the error came first


def test_gi_matches_the_uploaded_statistics_instead_of_the_running_ones():
    from attacks import ATTACKS

    net, (x, y) = small_bn_net(), batch(2)
    obs = observe(net, x, y, shares="state", seed=0)
    rec = ATTACKS.build("gi", restarts=1, group=0.0).reconstruct(obs, budget=2, seed=0, progress=lambda *a: None)
    assert "bn-upload" in rec.trace["final_terms"] and "bn" not in rec.trace["final_terms"]
    assert rec.trace["side_information"]["bn-upload"]["params"]["replaces"] == ["bn"]
    assert "replaces the running-statistics prior bn" in word(rec.trace["side_information"]["bn-upload"])


def test_fl_training_runs_the_clients_optimizer():
    """Between audited steps the clients train with the declared optimiser: momentum changes
    the model after a round of 3 local steps; plain SGD written as an optimiser does not."""
    from types import SimpleNamespace

    from audit.client.fl import train

    x, y = batch(24, seed=3)
    data = SimpleNamespace(train_images=x, train_labels=y)

    def after(optimizer):
        net = small_bn_net()
        train(net, data, None, 1, lr=0.1, batch_size=4, local_steps=3, optimizer=optimizer, seed=0)
        return torch.cat([p.detach().flatten() for p in net.parameters()])

    plain, named_plain, heavy = after(None), after("sgd"), after("sgd:momentum=0.9")
    torch.testing.assert_close(plain, named_plain)
    assert (heavy - plain).norm() > 1e-3 * plain.norm()


def _adam_match(relative_eps, at, observed, net, y):
    """The cosine mismatch between ``observed`` and the update of 3 Adam steps (lr 0.001) on
    ``at`` (eps raised by ``relative_eps`` x the gradient RMS), and its gradient in the image."""
    from torch.func import functional_call

    from audit.core.unroll import client_update

    model = copy.deepcopy(net)
    params = {n: p.detach().requires_grad_(True) for n, p in model.named_parameters()}
    x = at.clone().requires_grad_(True)

    def step(p, xb, yb, k):
        loss = nn.functional.cross_entropy(functional_call(model, p, (xb,)), yb)
        return dict(zip(p, torch.autograd.grad(loss, list(p.values()), create_graph=True)))

    update = client_update(step, params, x, y, steps=3, lr=0.001,
                           optimizer=LocalOptimizer("adam", relative_eps=relative_eps))
    flat = torch.cat([u.reshape(-1) for u in update])
    mismatch = 1 - torch.nn.functional.cosine_similarity(flat, observed, dim=0)
    return float(mismatch), torch.autograd.grad(mismatch, x)[0]


def _slope_kept(relative_eps, at, observed, net, y, length):
    """How much of the decrease its slope promises the match delivers along a step of ``length``."""
    before, slope = _adam_match(relative_eps, at, observed, net, y)
    after, _ = _adam_match(relative_eps, at - length * slope / slope.norm(), observed, net, y)
    return (before - after) / (length * float(slope.norm()))


def test_replica_smooths_adam_into_a_descendable_match():
    """Adam's exact update is near the gradient's sign, a step function of the image: its slope
    promises a decrease the match does not deliver. The replica's smoothed rule (eps + k x the
    gradient RMS) keeps its slope's promise and still matches the private image better than
    another image. Every other rule is unrolled exactly, and a client cannot be described with
    the attacker's smoothing."""
    from attacks.local_surrogate import ADAM_RELATIVE_EPS

    net, (x, y) = small_bn_net(), batch(1)
    obs = observe(net, x, y, local_steps=3, local_lr=0.001, optimizer="adam", shares="update", seed=0)
    assert ClientReplica(obs).optimizer == obs.optimizer.with_(relative_eps=ADAM_RELATIVE_EPS)
    momentum = observe(net, x, y, local_steps=3, local_lr=0.01, optimizer="sgd:momentum=0.9", seed=0)
    assert ClientReplica(momentum).optimizer == momentum.optimizer
    observed = torch.cat([g.reshape(-1) for g in obs.gradients])
    near = (x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(3))).clamp(0, 1)
    other = torch.rand(x.shape, generator=torch.Generator().manual_seed(5))
    for length in (0.01, 0.1):
        assert _slope_kept(0.0, near, observed, net, y, length) < 0.3
        assert 0.5 < _slope_kept(ADAM_RELATIVE_EPS, near, observed, net, y, length) < 1.5
    assert _adam_match(ADAM_RELATIVE_EPS, near, observed, net, y)[0] < _adam_match(ADAM_RELATIVE_EPS, other,
                                                                                   observed, net, y)[0]
    with pytest.raises(ConfigError, match="unknown local optimizer setting"):
        LocalOptimizer.parse("adam:relative_eps=1")


def test_bn_upload_weight_gives_every_layer_the_same_share():
    """The term averages its layers, so its default weight grows with their number: the
    measured ConvNet keeps its weight, and a model with more BatchNorm layers gets the same
    weight per layer (so its early layers are not diluted)."""
    from attacks.side_information import BN_UPLOAD_LAYERS, BN_UPLOAD_WEIGHT, side_information
    from audit.core.models import build_model

    x, y = batch(2)
    weights = {}
    for name, net in (("small", small_bn_net()), ("convnet", build_model("convnet", (3, 8, 8), 5, seed=0))):
        side = side_information(observe(net, x, y, shares="state", seed=0), "auto")
        (_, _, weight), = side.priors
        weights[name] = (weight, len(side.revealed.layers))
    assert weights["convnet"] == (BN_UPLOAD_WEIGHT, BN_UPLOAD_LAYERS)
    assert weights["small"][1] == 2 and weights["small"][0] / 2 == BN_UPLOAD_WEIGHT / BN_UPLOAD_LAYERS
    assert side_information(observe(small_bn_net(), x, y, shares="state", seed=0), 7.0).priors[0][2] == 7.0
