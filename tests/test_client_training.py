"""The client's training as one record and one round: the buffers each defense declares, the
one predicate of revealed statistics, the learning rate decided once, the FL trainer and the
Flower replay on the audit's round, and the unroll against torch.optim step by step."""
import copy
import json

import pytest
import torch
from torch import nn

from attacks.budget_rule import reveals_batch_statistics
from audit.client import fl as fl_module
from audit.client.fl import client_splits, train
from audit.client.observe import client_round, observe
from audit.core.buffers import BUFFER_EFFECTS, buffer_effect, upload_statistics
from audit.core.client_training import ClientTraining
from audit.core.errors import ConfigError
from audit.core.local_training import LocalOptimizer, torch_optimizer
from audit.core.types import clean_gradients, trainable_parameters
from audit.core.unroll import client_update
from audit.engine.audit import buffer_note
from audit.engine.settings import FLSettings
from audit.report.reasons import word
from defenses import build_defense
from tests.test_local_training import batch, small_bn_net


def _state_obs(defense, seed=0, **kw):
    net, (x, y) = small_bn_net(momentum=0.3), batch()
    return net, x, y, observe(net, x, y, defense, shares="state", seed=seed, **kw)


def _clipped_by_hand(clean, clipping_norm, lr=0.1):
    """Flower's clipping of a one-step reply, computed here from the clean round: one norm over
    the weights' step, the float buffers' change and the integer counts' change."""
    net = clean.model
    before = dict(net.named_buffers())
    steps = [lr * g for g in clean.gradients]
    moved = {n: b - before[n] for n, b in clean.buffers.items() if b.is_floating_point()}
    counts = [float(b - before[n]) for n, b in clean.buffers.items() if not b.is_floating_point()]
    norm = (sum(float(t.double().pow(2).sum()) for t in steps + list(moved.values())) + sum(c * c for c in counts)) ** 0.5
    factor = min(1.0, clipping_norm / norm)
    return factor, [g * factor for g in clean.gradients], {n: before[n] + factor * m for n, m in moved.items()}


def test_flower_clipping_scales_the_buffers_change_with_the_weights_as_flower_does():
    clip = build_defense("flower-fixedclipping", clipping_norm=0.05)
    _, _, _, obs = _state_obs(clip)
    _, _, _, clean = _state_obs(None)
    factor, update, buffers = _clipped_by_hand(clean, 0.05)
    assert factor < 0.5  # the bound bites: an unclipped buffer would be far off
    assert obs.buffer_effect == "clipped"
    for mine, theirs in zip(obs.gradients, update):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-7)
    for name, expected in buffers.items():
        torch.testing.assert_close(obs.buffers[name], expected, rtol=1e-4, atol=1e-7)
        assert not torch.allclose(obs.buffers[name], clean.buffers[name])
    for name, b in clean.buffers.items():
        if not b.is_floating_point():
            assert torch.equal(obs.buffers[name], b)  # the counts pass unscaled
    revealed, why = upload_statistics(obs)
    assert revealed is None and why.code == "buffers-not-revealing" and "clipped" in word(why)
    assert not reveals_batch_statistics(obs)


def test_flower_localdp_clips_then_noises_the_uploaded_buffers_as_localdpmod():
    dp = build_defense("flower-localdp", epsilon=50.0, clipping_norm=0.05)
    _, _, _, obs = _state_obs(dp)
    _, _, _, clean = _state_obs(None)
    _, update, buffers = _clipped_by_hand(clean, 0.05)
    assert obs.buffer_effect == "clipped and noised"
    residual = torch.cat([(obs.buffers[n] - b).flatten() for n, b in buffers.items()])
    # every float buffer carries N(0, s^2) around the clipped change, LocalDpMod's s (here 0.097): 32 entries
    assert residual.abs().min() > 0
    assert residual.std().item() == pytest.approx(dp.noise_std, rel=0.35)
    weights = torch.cat([(0.1 * (mine - theirs)).flatten() for mine, theirs in zip(obs.gradients, update)])
    assert weights.std().item() == pytest.approx(dp.noise_std, rel=0.1)  # the same noise on the weights' step
    assert not reveals_batch_statistics(obs)


def test_a_declared_whole_reply_effect_needs_its_transform():
    class Half:
        name, buffer_effect = "half", "clipped"

        def __call__(self, model, inputs, labels, *, loss_fn, generator=None):
            return clean_gradients(model, inputs, labels, loss_fn)

    with pytest.raises(ConfigError, match="transform_state"):
        _state_obs(Half())


def test_ats_buffers_record_the_transformed_batch_the_client_trained_on():
    ats = build_defense("ats")
    net, x, y, obs = _state_obs(ats, seed=3)
    assert obs.buffer_effect == "transformed"
    trained = ats.transform_inputs(x, torch.Generator().manual_seed(3))  # the defense's first draws
    assert not torch.allclose(trained, x)
    reference = copy.deepcopy(net).train()
    with torch.no_grad():
        reference(trained)
    for name, b in reference.named_buffers():
        torch.testing.assert_close(obs.buffers[name], b)
    raw = copy.deepcopy(net).train()
    with torch.no_grad():
        raw(x)
    assert not torch.allclose(obs.buffers["1.running_mean"], raw.state_dict()["1.running_mean"])


def test_the_threat_model_line_follows_the_declared_effect():
    def silent(model, inputs, labels, *, loss_fn, generator=None):
        return clean_gradients(model, inputs, labels, loss_fn)

    lines = {}
    for name, defense in [("localdp", build_defense("flower-localdp")), ("ats", build_defense("ats")),
                          ("gaussian", build_defense("gaussian")), ("user", silent)]:
        _, _, _, obs = _state_obs(defense)
        lines[name] = buffer_note(obs, obs.defense, "state")
    assert lines["localdp"]["buffers"].startswith("clipped and noised") and "untouched" not in lines["localdp"]["buffers"]
    assert lines["localdp"]["buffers_reveal"].startswith("nothing")
    assert lines["ats"]["buffers"].startswith("transformed")
    assert lines["gaussian"]["buffers"].startswith("untouched")
    assert "BatchNorm input statistics" in lines["gaussian"]["buffers_reveal"]
    assert lines["user"]["buffers"].startswith("not declared")
    assert buffer_effect(None).name == "untouched"
    assert buffer_note(None, None, "update") == {}


def test_a_declared_effect_outside_the_vocabulary_is_a_one_line_error():
    class Odd:
        name, buffer_effect = "odd", "scrambled"

    with pytest.raises(ConfigError, match="untouched"):
        buffer_effect(Odd())
    assert set(BUFFER_EFFECTS.names()) == {"untouched", "noised", "transformed", "dropped", "clipped",
                                           "clipped and noised", "not declared"}


def test_one_predicate_no_statistics_where_the_buffers_equal_the_global_models():
    def dropping(model, inputs, labels, *, loss_fn, generator=None):
        return clean_gradients(model, inputs, labels, loss_fn)

    dropping.buffer_effect = "dropped"
    net, x, y, obs = _state_obs(dropping)
    for name, b in net.named_buffers():
        assert torch.equal(obs.buffers[name], b)
    assert upload_statistics(obs)[0] is None and not reveals_batch_statistics(obs)
    # BatchNorm with momentum 0: the buffers never move, so the upload reveals nothing
    still = small_bn_net(momentum=0.0)
    obs = observe(still, *batch(), shares="state", seed=0)
    assert upload_statistics(obs)[0] is None and not reveals_batch_statistics(obs)


def test_bn_upload_zero_switches_off_the_run_length_weights():
    from attacks import ATTACKS
    from attacks.optimization import OptimizationRun
    from audit.core.models import build_model

    net = build_model("convnet", (3, 16, 16), 10, mean=(0.5,) * 3, std=(0.5,) * 3, seed=0)
    obs = observe(net, torch.rand(4, 3, 16, 16), torch.arange(4), shares="state", seed=0)

    def weights(**settings):
        run = OptimizationRun(ATTACKS.build("ig", **settings), obs, 0, show_bars=False, iterations=1600)
        return {k: w for k, _, w in run.priors if k in ("tv", "features")}, run.side.notes

    used, notes = weights()
    assert used["features"] == pytest.approx(1.0) and "run-length" in notes
    run_length = notes["run-length"]  # a code and its numbers; the report words them
    assert run_length.code == "run-length" and run_length.params["iterations"] == 1600
    assert 0 < run_length.params["share"] <= 1
    from audit.report.reasons import word

    assert word(run_length).startswith(f"the weights from the observation moved {run_length.params['share']:.0%}")
    off, notes = weights(bn_upload=0)
    assert off == pytest.approx({"tv": 0.5, "features": 0.3}) and "run-length" not in notes


def test_the_learning_rate_is_decided_once_and_the_wording_names_the_real_steps():
    assert FLSettings(lr=0.5).client.lr == 0.5
    fl = FLSettings(lr=0.5, local_lr=0.2, local_steps=3)
    assert fl.client.lr == 0.2 and "at lr 0.2" in fl.training_description()
    with pytest.raises(ConfigError) as err:
        FLSettings(local_optimizer="sgd:momentum=0.9", shares="gradient")
    assert "(1 local step(s) of sgd(momentum=0.9))" in str(err.value)
    with pytest.raises(ConfigError, match=r"\(2 local epoch\(s\) of sgd\)"):
        ClientTraining(epochs=2, shares="gradient")
    with pytest.raises(dataclass_frozen_error()):
        fl.client.lr = 1.0


def dataclass_frozen_error():
    from dataclasses import FrozenInstanceError
    return FrozenInstanceError


def test_fl_training_honours_local_mini_batches_and_epochs():
    """Between audited steps each client runs the audited round: 2 epochs over its batch of 4 in
    mini-batches of 2 are 4 torch.optim steps on rows 0-1, 2-3, 0-1, 2-3."""
    from audit.core.data import load_dataset

    data = load_dataset("embedded", size=8)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, data.num_classes))
    reference = copy.deepcopy(net)
    training = ClientTraining("sgd:momentum=0.9", epochs=2, lr=0.05, batch_size=2)
    train(net, data, None, 1, lr=0.1, batch_size=4, training=training, seed=0)
    gen = torch.Generator().manual_seed(0)
    split = client_splits(len(data.train_labels), 1, gen)[0]
    pick = split[torch.randperm(len(split), generator=gen)[:4]]
    x, y = data.train_images[pick], data.train_labels[pick]
    optim = torch_optimizer(training.optimizer, reference.parameters(), 0.05)
    for rows in [slice(0, 2), slice(2, 4)] * 2:
        optim.zero_grad()
        nn.functional.cross_entropy(reference(x[rows]), y[rows]).backward()
        optim.step()
    for got, want in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_flower_replay_is_the_audits_client_round():
    from audit.integrations.flower import fidelity

    assert fidelity.client_round is client_round
    net, (x, y) = small_bn_net(), batch()
    training = ClientTraining("adam", steps=3, lr=0.01, batch_size=4, shares="state")
    obs = observe(net, x, y, None, training=training, seed=0)
    replayed = fidelity.replay(net, x, y, defense=None, training=training, round=0, seed=0)
    for (name, p), g in zip(net.named_parameters(), obs.gradients):
        torch.testing.assert_close(replayed.weights[name], p.detach() - 0.01 * g)
    for name, b in obs.buffers.items():
        torch.testing.assert_close(replayed.buffers[name], b)


@pytest.mark.parametrize("spec", ["sgd:momentum=0.9,nesterov=1,weight_decay=5e-4", "adam", "adamw:weight_decay=0.05"])
def test_the_unroll_follows_torch_optim_step_by_step_in_norm_and_direction(spec):
    """After every one of 5 steps the replica's update ``(theta_0 - theta_k) / lr`` has
    torch.optim's norm (ratio within 1e-4 of 1) and direction (cosine above 1 - 1e-6)."""
    net, (x, y) = small_bn_net(), batch()
    opt, lr = LocalOptimizer.parse(spec), 0.02
    net.eval()  # the same function at every step on both sides
    params = trainable_parameters(net)
    theta0 = {str(i): p.detach().clone() for i, p in enumerate(params)}

    def step_grads(p, xb, yb, k):
        with torch.no_grad():
            for q, v in zip(params, p.values()):
                q.copy_(v)
        return {str(i): g for i, g in enumerate(torch.autograd.grad(
            nn.functional.cross_entropy(net(xb), yb), params))}

    reference = copy.deepcopy(net)
    optim = torch_optimizer(opt, reference.parameters(), lr)
    for k in range(1, 6):
        optim.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        optim.step()
        want = torch.cat([(a - p.detach()).flatten() / lr for a, p in zip(theta0.values(), reference.parameters())])
        got = torch.cat([g.flatten() for g in client_update(step_grads, dict(theta0), x, y, steps=k, lr=lr,
                                                            optimizer=opt)])
        assert float(got.norm() / want.norm()) == pytest.approx(1.0, abs=1e-4), k
        assert float(torch.nn.functional.cosine_similarity(got, want, dim=0)) > 1 - 1e-6, k


def test_the_attackers_smoothed_adam_states_its_eps_and_shrinks_the_first_step():
    """With ``relative_eps`` r the first Adam step is ``g / (|g| + eps + r * rms(g))`` per entry
    (torch.optim's with that eps): its norm is below the exact rule's, by the stated amount."""
    g = {"w": torch.tensor([3.0, -0.5, 0.01, 2.0])}
    p = {"w": torch.zeros(4)}
    exact = LocalOptimizer.parse("adam")
    smooth = exact.with_(relative_eps=0.1)
    eps = 1e-8 + 0.1 * float(g["w"].square().mean().sqrt())
    expected = g["w"] / (g["w"].abs() + eps)
    got = client_update(lambda q, xb, yb, k: g, p, torch.zeros(1), torch.zeros(1), steps=1, optimizer=smooth)[0]
    torch.testing.assert_close(got, expected)
    full = client_update(lambda q, xb, yb, k: g, p, torch.zeros(1), torch.zeros(1), steps=1, optimizer=exact)[0]
    assert float(got.norm()) < float(full.norm())
    torch.testing.assert_close(full, torch.sign(g["w"]), atol=1e-5, rtol=0)


def test_the_step_verdict_line_says_whether_the_buffers_carried_the_attacks():
    from audit.core.records import AttackResult
    from audit.report.audit_report import buffers_used
    from audit.report.format import verdict_text

    def result(trace):
        return AttackResult.from_dict({"step": 0, "attack_id": "ig", "image": 0, "trace": trace})

    # the code decides, whatever the attack's note says
    used = result({"side_information_used": ["bn-upload"], "side_information": {"bn-upload": "matched"}})
    unused = result({"side_information_used": [], "side_information": {"bn-upload": "used, says an odd note"}})
    assert buffers_used({"ig": [unused], "portfolio": [used]}, "untouched: ...") == "the buffers' statistics used"
    line = buffers_used({"ig": [unused]}, "noised: the defense adds Gaussian noise")
    assert line == "the buffers' statistics not used (buffers noised)"
    # a result stored before the codes reads them from its notes as they were written then
    older = result({"side_information": {"bn-upload": "used (weight 3): the private batch's ..."}})
    assert buffers_used({"ig": [older]}, "untouched: ...") == "the buffers' statistics used"
    # the codes survive the store's JSON, notes or not
    again = AttackResult.from_dict(json.loads(json.dumps(unused.to_dict())))
    assert not again.trace.uses("bn-upload") and again.trace == unused.trace
    verdict = {"label": "leaks", "recovered": 7, "images": 8, "buffers": "the buffers' statistics used"}
    assert "7 recovered" in verdict_text(verdict) and "the buffers' statistics used" in verdict_text(verdict)


def test_run_hands_its_settings_to_the_audit_as_one_config(monkeypatch):
    """``audit.run`` builds one AuditConfig from its keywords (or takes one whole), the client's
    training record is built from it once, and an unknown setting is a one-line error naming the
    nearest valid one."""
    from audit.engine import audit as engine
    from audit.engine.config import AuditConfig

    seen = {}

    class Stub:
        @classmethod
        def from_config(cls, config):
            seen["config"] = config
            return cls()

        def run(self):
            return "report"

    monkeypatch.setattr(engine, "Audit", Stub)
    assert engine.run("gaussian", defense_args={"sigma": 0.1}, local_optimizer="sgd:momentum=0.9", local_steps=3,
                      local_lr=0.05, local_batch_size=2, shares="state") == "report"
    config = seen["config"]
    client = config.sections().fl_settings.client
    assert (config.defense, config.defense_args) == ("gaussian", {"sigma": 0.1})
    assert (client.optimizer.momentum, client.steps, client.lr, client.batch_size, client.shares) == \
        (0.9, 3, 0.05, 2, "state")
    whole = AuditConfig(defense="gaussian", images=3)
    assert engine.run(whole) == "report" and seen["config"] is whole
    assert engine.run(whole, images=4) == "report" and seen["config"].images == 4
    with pytest.raises(ConfigError, match="unknown setting 'local_step'; did you mean 'local_steps'"):
        engine.run("none", local_step=3)
    with pytest.raises(ConfigError, match="defense is given twice"):
        engine.run("none", defense="prune")
