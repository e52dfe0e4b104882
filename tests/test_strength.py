"""Attack strength regressions: exact DLG on a sigmoid LeNet, the portfolio beating
the previous base attack, and no silent stall. Fixed seeds, a few seconds each."""
import dataclasses
import os

import numpy as np
import pytest
import torch

from attacks import ATTACKS, observe
from attacks.optimizers import LBFGS, Watchdog
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.report.reasons import word

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(scope="module")
def photo16():
    """A natural 16x16 photo not in the embedded data (matplotlib's Grace Hopper, the face)."""
    import matplotlib
    from PIL import Image

    pic = Image.open(os.path.join(matplotlib.get_data_path(), "sample_data", "grace_hopper.jpg")).convert("RGB")
    pic = pic.crop((120, 60, 420, 360)).resize((16, 16), Image.BICUBIC)
    return torch.from_numpy(np.asarray(pic, dtype=np.float32) / 255).permute(2, 0, 1).unsqueeze(0)


def _lenet_obs(x, label=7):
    model = build_model("lenet", (3, 16, 16), 10, mean=MEAN, std=STD, seed=0)
    return observe(model, x, torch.tensor([label]), client_mode="eval")


def test_dlg_recovers_sigmoid_lenet_exactly_within_its_default_budget(one_thread, photo16):
    rec = ATTACKS.build("dlg").reconstruct(_lenet_obs(photo16), None, seed=0)
    assert float(psnr(rec.inputs, photo16).mean()) > 40.0
    assert int(rec.labels[0]) == 7
    assert not rec.trace.get("failed_to_optimise")


def test_portfolio_beats_the_previous_base_attack_on_a_natural_image(one_thread, photo16):
    obs = _lenet_obs(photo16)
    old = ATTACKS.build("ig").reconstruct(obs, 2000, seed=0)
    new = ATTACKS.build("portfolio").reconstruct(obs, 2000, seed=0)
    assert float(psnr(new.inputs, photo16).mean()) > float(psnr(old.inputs, photo16).mean()) + 10.0
    assert new.trace["chosen_strategy"] == "exact"
    assert {c["strategy"] for c in new.trace["candidates"]} == {"smooth", "sharp", "exact"}


def _flat(dummy, target):
    return sum((g * 0).sum() for g in dummy) + 1.0  # the loss cannot move


def test_a_stalled_optimiser_is_detected_changed_and_reported(one_thread, photo16):
    rec = ATTACKS.build("ig", objective=_flat, tv=0.0).reconstruct(_lenet_obs(photo16), 40, seed=0)
    assert rec.trace["failed_to_optimise"] is True
    assert rec.trace["failure"]["code"] == "stalled" and "attack failed to optimise" in word(rec.trace["failure"])
    events = rec.trace["optimizer_events"]
    assert events and events[0]["iteration"] < 10 and "no decrease" in events[0]["event"]
    assert rec.trace["flat_loss"] is True  # a zero gradient never moves the point


def test_a_loss_flat_in_the_image_is_told_apart_from_a_hard_one(one_thread, photo16):
    """A model with no hidden unit alive for any image (as a collapsed training leaves it):
    only the classifier's bias has a gradient, so the attack's loss is flat in the image."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 16 * 16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    with torch.no_grad():
        model[1].bias.fill_(-1e4)
    obs = observe(model, photo16, torch.tensor([7]), client_mode="eval")
    assert not obs.silent and sum(int(g.abs().sum() > 0) for g in obs.gradients) == 1
    rec = ATTACKS.build("ig", tv=0.0, features=0.0).reconstruct(obs, 40, seed=0)
    assert rec.trace["failed_to_optimise"] is True and rec.trace["flat_loss"] is True
    assert "flat in the image" in word(rec.trace["failure"])
    # the same attack on a live model moves, and is not called flat
    live = ATTACKS.build("ig", tv=0.0, features=0.0).reconstruct(_lenet_obs(photo16), 40, seed=0)
    assert "flat_loss" not in live.trace
    # L-BFGS may refuse every step on a live loss: a point it never moved says nothing of flatness
    refusing = Watchdog(LBFGS())
    refusing.start([torch.zeros(2, 3)], 10)
    assert not refusing.flat().any()


def test_a_silent_upload_is_evidence_of_nothing_not_a_failed_attack(one_thread, photo16):
    """A client whose model gives its label probability 1 uploads zeros: the cosine cannot
    fall, yet the attack did not fail; a flat objective on a live upload still does."""
    live = _lenet_obs(photo16)
    silent = dataclasses.replace(live, gradients=[torch.zeros_like(g) for g in live.gradients])
    assert silent.silent and not live.silent
    rec = ATTACKS.build("ig", tv=0.0).reconstruct(silent, 40, seed=0)
    assert not rec.trace.get("failed_to_optimise") and "upload is zero" in word(rec.trace["silent_upload"])
    stalled = ATTACKS.build("ig", objective=_flat, tv=0.0).reconstruct(live, 40, seed=0)
    assert stalled.trace["failed_to_optimise"] is True and "silent_upload" not in stalled.trace


def test_lbfgs_failed_line_search_resets_and_moves_on():
    # f(x) = |x|^2 with a gradient that lies (points uphill): every Armijo search fails at first
    calls = []

    def closure(variables):
        x = variables[0]
        calls.append(1)
        loss = (x ** 2).flatten(1).sum(1)
        lie = -2 * x if len(calls) < 3 else 2 * x
        return loss, [lie]

    x = [torch.ones(1, 4)]
    opt = Watchdog(LBFGS(backtracks=2), patience=3)
    opt.start(x, 20)
    for it in range(20):
        opt.step(x, closure, it)
    assert any("line search failed" in e["event"] for e in opt.all_events())
    assert bool(opt.progress()[0]) and float(x[0].abs().max()) < 0.5


def test_data_randn_init_is_standard_normal_in_the_models_input_space():
    from types import SimpleNamespace

    from attacks.search_space import INITS

    declared = SimpleNamespace(data_mean=(0.2, 0.5, 0.8), data_std=(0.1, 0.2, 0.3))
    x = INITS.get("data-randn")((64, 3, 16, 16), torch.Generator().manual_seed(0), "cpu", observation=declared)
    for c in range(3):  # normalised with the declared statistics it is N(0, 1)
        z = (x[:, c] - declared.data_mean[c]) / declared.data_std[c]
        assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02


def test_lbfgs_compact_direction_equals_the_two_loop_recursion():
    """The batched compact form (Nocedal & Wright 7.24) gives the textbook two-loop product
    per restart, over that restart's stored pairs only, across the history window's wrap."""
    gen = torch.Generator().manual_seed(0)
    restarts, shapes, history = 3, [(2, 3, 4), (5,)], 4
    like = [torch.zeros(restarts, *s) for s in shapes]
    width = sum(torch.Size(s).numel() for s in shapes)
    opt = LBFGS(history=history)
    opt.start(like, 10)
    window = []
    for k in range(7):
        a = torch.randn(width, width, generator=gen)
        hess = a @ a.T / width + torch.eye(width)          # a positive definite curvature
        s = torch.randn(restarts, width, generator=gen)
        y = s @ hess
        useful = torch.rand(restarts, generator=gen) > 0.3
        opt._store(s, y, useful)
        window = (window + [(s, y, useful)])[-history:]
        g = torch.randn(restarts, width, generator=gen)
        got = opt._flat(opt._direction(opt._split(g, like)))
        for r in range(restarts):
            pairs = [(s[r], y[r]) for s, y, u in window if u[r]]
            q, alphas = -g[r].clone(), []
            for si, yi in reversed(pairs):
                alphas.append((si @ q) / (si @ yi))
                q -= alphas[-1] * yi
            q *= float(opt.gamma[r])   # H0 = gamma I from the restart's latest stored pair
            for (si, yi), al in zip(pairs, reversed(alphas)):
                q += (al - (yi @ q) / (si @ yi)) * si
            assert torch.allclose(got[r], q, rtol=1e-4, atol=1e-4 * float(q.abs().max())), (k, r)


def test_keep_best_after_gives_the_rest_of_the_budget_to_each_batch_s_best_restart(one_thread, photo16):
    """``keep_best_after``: at that fraction of the budget each private batch keeps its
    lowest-loss restart, which then gets the remaining evaluations (more iterations than
    the same budget spread over every restart); grouped runs select per batch."""
    obs = _lenet_obs(photo16)
    plain = ATTACKS.build("idlg", restarts=4, per_restart=0).reconstruct(obs, 400, seed=0)
    halved = ATTACKS.build("idlg", restarts=4, keep_best_after=0.25, per_restart=0).reconstruct(obs, 400, seed=0)
    sel = halved.trace["restart_selection"]
    assert 100 <= sel["after_gradient_evaluations"] < 140 and len(sel["losses"]) == 4
    assert sel["kept"] == int(np.argmin(sel["losses"])) == halved.trace["chosen_restart"]
    # within the budget, plus the final evaluation that picks the restart (1 member after the selection)
    assert halved.trace["gradient_evaluations"] <= 400 + 1 and plain.trace["gradient_evaluations"] <= 400 + 4
    assert halved.trace["iterations"] > 1.5 * plain.trace["iterations"]
    kept = halved.trace["loss_history"][sel["kept"]]
    others = [h for r, h in enumerate(halved.trace["loss_history"]) if r != sel["kept"]]
    assert len(kept) == halved.trace["iterations"] and all(len(h) == sel["iteration"] + 1 for h in others)
    assert [v is None for v in halved.trace["final_losses"]].count(False) == 1
    # two private batches in one grouped run: each keeps its own best
    other = _lenet_obs(torch.flip(photo16, dims=[3]), label=3)
    many = ATTACKS.build("idlg", restarts=4, keep_best_after=0.25, per_restart=0).reconstruct_many([obs, other], 400, seeds=[0, 1])
    for rec in many:
        s = rec.trace["restart_selection"]
        assert s["kept"] == int(np.argmin(s["losses"])) == rec.trace["chosen_restart"]
    assert float(psnr(many[0].inputs, photo16).mean()) > 20


def test_a_budget_runs_only_the_restarts_it_affords(one_thread, photo16):
    obs = _lenet_obs(photo16)  # 768 unknown pixel values: dlg's 4 restarts need ~3072 evaluations
    assert ATTACKS.build("dlg").afforded(obs, 1600)[0].restarts == 2
    assert ATTACKS.build("dlg").afforded(obs, 3200)[0].restarts == 4
    assert ATTACKS.build("dlg").afforded(obs, None)[0].restarts == 4
    cut = ATTACKS.build("dlg", per_restart=10).reconstruct(obs, 25, seed=0)
    assert cut.trace["restarts"] == 2 and "2 of 4 restarts" in word(cut.trace["restarts_afforded"])
    assert cut.trace["gradient_evaluations"] <= 25 + 2
    full = ATTACKS.build("dlg", per_restart=10).reconstruct(obs, 40, seed=0)
    assert full.trace["restarts"] == 4 and "restarts_afforded" not in full.trace
    assert ATTACKS.build("dlg", per_restart=0).reconstruct(obs, 25, seed=0).trace["restarts"] == 4


def test_observed_tv_grows_with_the_private_pixels_and_train_mode_batchnorm():
    from attacks.tv_rule import TV_BATCHNORM_TRAIN, TV_REFERENCE, observed_tv

    def scaled_tv(o):
        return {"tv": observed_tv(o)}

    def obs(batch, side, model="lenet", mode="eval", **kw):
        net = build_model(model, (3, side, side), 10, mean=MEAN, std=STD, seed=0, **kw)
        return observe(net, torch.rand(batch, 3, side, side), torch.arange(batch), client_mode=mode)

    assert scaled_tv(obs(1, 32))["tv"] == pytest.approx(TV_REFERENCE)
    assert scaled_tv(obs(1, 16))["tv"] == pytest.approx(TV_REFERENCE)      # never below the reference
    assert scaled_tv(obs(4, 16))["tv"] == pytest.approx(TV_REFERENCE)      # a 32x32 image's unknowns
    assert scaled_tv(obs(4, 32))["tv"] == pytest.approx(4 * TV_REFERENCE)
    assert scaled_tv(obs(4, 32, "convnet", "eval"))["tv"] == pytest.approx(4 * TV_REFERENCE)
    assert scaled_tv(obs(4, 32, "resnet18", "eval"))["tv"] == pytest.approx(TV_REFERENCE)  # 909 entries / pixel
    assert scaled_tv(obs(1, 16, "convnet", "train"))["tv"] == pytest.approx(TV_BATCHNORM_TRAIN)
    # a train-mode batch grows from the train-mode weight as an eval-mode one from the reference
    assert scaled_tv(obs(4, 32, "convnet", "train"))["tv"] == pytest.approx(4 * TV_BATCHNORM_TRAIN)
    assert scaled_tv(obs(1, 16, "convnet", "eval"))["tv"] == pytest.approx(TV_REFERENCE)
    assert scaled_tv(obs(1, 16, "convnet", "train", batchnorm=False))["tv"] == pytest.approx(TV_REFERENCE)


def test_a_long_run_on_shared_buffers_lets_tv_grow_less_with_the_batch_and_weighs_the_features_more():
    from attacks.optimization import OptimizationRun

    def weights(shares, iterations, mode="train", side=16):
        net = build_model("convnet", (3, side, side), 10, mean=MEAN, std=STD, seed=0)
        o = observe(net, torch.rand(4, 3, side, side), torch.arange(4), client_mode=mode, shares=shares, seed=0)
        run = OptimizationRun(ATTACKS.build("ig"), o, 0, show_bars=False, iterations=iterations)
        assert ("run-length" in run.side.notes) == (shares == "state" and mode == "train" and (iterations or 0) > 400)
        return {k: w for k, _, w in run.priors if k in ("tv", "features")}

    short = weights("state", 400)  # a batch of 4 16x16 images: the unknowns of one 32x32 image
    assert short == pytest.approx({"tv": 0.5, "features": 0.3})  # the rules' weights at 400 iterations
    assert weights("state", None) == pytest.approx(short)       # a run of unknown length keeps them
    # the TV weight does not grow beyond the one-image weight of 0.5 (growth 1, halved, floored at 1)
    assert weights("state", 1600) == pytest.approx({"tv": 0.5, "features": 1.0})
    big = weights("state", 400, side=32)  # 4 32x32 images: 4 times the unknowns, growth 4
    assert big == pytest.approx({"tv": 2.0, "features": 0.3})
    assert weights("state", 1600, side=32) == pytest.approx({"tv": 1.0, "features": 1.0})  # growth halved
    assert weights("state", 6400, side=32) == pytest.approx({"tv": 1.0, "features": 1.0})
    # half way (by the logarithm) between 400 and 1,600 iterations: the geometric means
    assert weights("state", 800, side=32) == pytest.approx({"tv": (2.0 * 1.0) ** 0.5, "features": (0.3 * 1.0) ** 0.5})
    # without revealed batch statistics the run's length changes nothing
    assert weights("gradient", 1600, side=32) == pytest.approx(big)
    assert weights("update", 1600, side=32) == pytest.approx(big)
    assert weights("state", 1600, mode="eval", side=32)["tv"] == pytest.approx(0.2)


def test_portfolio_beats_fixed_tv_ig_on_a_train_mode_batchnorm_convnet(one_thread, photo16):
    model = build_model("convnet", (3, 16, 16), 10, mean=MEAN, std=STD, seed=0)
    obs = observe(model, photo16, torch.tensor([7]), client_mode="train")
    ig = ATTACKS.build("ig", tv=5e-2).reconstruct(obs, 600, seed=0)  # Inverting Gradients' fixed weight
    new = ATTACKS.build("portfolio").reconstruct(obs, 600, seed=0)
    assert float(psnr(new.inputs, photo16).mean()) > float(psnr(ig.inputs, photo16).mean()) + 2.0
    assert new.trace["prior_weights"]["tv"] >= 0.5  # observed_tv: train-mode BatchNorm
    # ig's own default takes the same weight from the observation, and gains from it
    auto = ATTACKS.build("ig").reconstruct(obs, 600, seed=0)
    assert auto.trace["prior_weights"]["tv"] == pytest.approx(0.5)
    assert float(psnr(auto.inputs, photo16).mean()) > float(psnr(ig.inputs, photo16).mean()) + 1.0
    continued = [c for c in new.trace["candidates"] if c["phase"] == "continue"]
    assert continued and continued[0]["resumed"].startswith("fresh")  # signed Adam's schedule restarts


def test_portfolio_skips_the_running_statistics_prior_when_the_upload_reveals_the_batch():
    import attacks.portfolio  # noqa: F401  (registers the portfolio)

    model = build_model("convnet", (3, 16, 16), 10, mean=MEAN, std=STD, seed=0)
    x, y = torch.rand(2, 3, 16, 16), torch.tensor([1, 2])
    state = observe(model, x, y, client_mode="train", shares="state")
    rec = ATTACKS.build("portfolio").reconstruct(state, 24, seed=0)
    skipped = rec.trace["skipped_strategies"]["bn-prior"]
    assert skipped["code"] == "portfolio-bn-upload-instead"
    assert "reveal the batch's own BatchNorm statistics" in word(skipped)
    assert "bn-prior" not in {c["strategy"] for c in rec.trace["candidates"]}
    # without the buffers, or with their term switched off, the prior is the only statistics there are
    for obs, knobs in ((observe(model, x, y, client_mode="train", shares="update"), {}), (state, {"bn_upload": 0})):
        rec = ATTACKS.build("portfolio", **knobs).reconstruct(obs, 24, seed=0)
        assert "bn-prior" in {c["strategy"] for c in rec.trace["candidates"]}



def test_portfolio_stays_within_its_budget():
    import attacks.portfolio  # noqa: F401  (registers the portfolio)

    model = build_model("convnet", (3, 16, 16), 10, mean=MEAN, std=STD, seed=0)
    obs = observe(model, torch.rand(1, 3, 16, 16), torch.tensor([3]), client_mode="train")
    rec = ATTACKS.build("portfolio", strategies="smooth,sharp").reconstruct(obs, 80, seed=0)
    explored, continued = rec.trace["candidates"][:2], rec.trace["candidates"][2:]
    assert [c["phase"] for c in explored] == ["explore", "explore"] and len(continued) == 1
    # every run closes with one evaluation of its final point, and every candidate's score is one
    assert rec.trace["gradient_evaluations"] == 80
