"""GGL, GIAS, GIFD and the optimisation attack's generator box, with the test generator trained on the
embedded *train* split, attacking a held-out *test* image (fixed seeds, small budgets)."""
import threading

import pytest
import torch
from torch import nn

from attacks import ATTACKS, OptimizationAttack
from attacks.generative import GeneratorBox, Scorer, project_l1_ball
from attacks.simulator import DefenseSimulator, GradientSimulator
from audit.core.data import load_dataset
from audit.core.errors import ConfigError
from audit.core.metrics import psnr, ssim
from audit.core.models import build_model
from audit.client.observe import observe
from audit.core.types import gradient_transform
from test_generators import session_generator
from audit.report.reasons import word

TARGET = 20  # a held-out (test split) image


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return session_generator(tmp_path_factory)


@pytest.fixture(scope="module")
def case():
    data = load_dataset("embedded", size=16)
    model = build_model("lenet", (3, 16, 16), 10, mean=data.mean, std=data.std, seed=0)
    x, y = data.test_images[TARGET:TARGET + 1], data.test_labels[TARGET:TARGET + 1]
    others = torch.cat([data.test_images[:TARGET], data.test_images[TARGET + 1:]])
    return model, x, y, others, observe(model, x, y)


def quality(images, x):
    return float(psnr(images, x.expand_as(images)).mean()), float(ssim(images, x.expand_as(images)).mean())


@pytest.fixture(scope="module")
def chance(gen, case):
    """Chance-level similarity: the mean over random generator samples (random classes) and
    over the other held-out images, whichever is higher."""
    _, x, _, others, _ = case
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        samples = gen(gen.sample_latent(64, g), torch.randint(10, (64,), generator=g))
    (p1, s1), (p2, s2) = quality(samples, x), quality(others, x)
    return max(p1, p2), max(s1, s2)


@pytest.fixture(scope="module")
def results(gen, case):
    obs = case[-1]
    runs = {
        "ggl": ("ggl", {}, 200),
        "latent": ("gias", {"latent_fraction": 1.0}, 100),  # plain latent search, same budget
        "gias": ("gias", {}, 100),
        "gifd": ("gifd", {}, 100),
    }
    out = {}
    for key, (name, kw, budget) in runs.items():
        rec = ATTACKS.build(name, generator=gen, **kw).reconstruct(obs, budget=budget, seed=0)
        out[key] = (rec, quality(rec.inputs, case[1]))
    return out


@pytest.mark.parametrize("attack", ["ggl", "latent", "gias", "gifd"])
def test_attacks_beat_chance_on_a_held_out_image(results, chance, case, attack):
    rec, (p, s) = results[attack]
    assert rec.inputs.shape == (1, 3, 16, 16) and rec.labels.tolist() == case[2].tolist()
    assert p > chance[0] + 2.0 and s > chance[1] + 0.1, (p, s, chance)
    assert rec.trace["generator"]["data"]["split"] == "train"  # the aux data is disjoint from the target


def test_gias_and_gifd_improve_on_plain_latent_search(results):
    latent_psnr, latent_ssim = results["latent"][1]
    for attack in ("gias", "gifd"):
        p, s = results[attack][1]
        assert p > latent_psnr + 1.0 and s > latent_ssim, (attack, p, s, latent_psnr, latent_ssim)
    trace = results["gifd"][0].trace
    assert trace["searched_layers"] == [0, 1, 2] and trace["chosen_layer"] in (1, 2)
    assert results["gias"][0].trace["parameter_search"]["weight_drift_l2"] > 0


def test_same_seed_same_reconstruction(gen, case):
    obs = case[-1]
    a = ATTACKS.build("ggl", generator=gen, batch=8).reconstruct(obs, budget=24, seed=3)
    b = ATTACKS.build("ggl", generator=gen, batch=8).reconstruct(obs, budget=24, seed=3)
    c = ATTACKS.build("ggl", generator=gen, batch=8).reconstruct(obs, budget=24, seed=4)
    assert torch.equal(a.inputs, b.inputs) and not torch.equal(a.inputs, c.inputs)
    g1 = ATTACKS.build("gifd", generator=gen, restarts=2).reconstruct(obs, budget=6, seed=0)
    g2 = ATTACKS.build("gifd", generator=gen, restarts=2).reconstruct(obs, budget=6, seed=0)
    assert torch.equal(g1.inputs, g2.inputs)


def test_ggl_optimizer_is_selectable_and_finishes_cleanly(gen, case):
    threads = threading.active_count()
    calls = []
    rec = ATTACKS.build("ggl", generator=gen, optimizer="OnePlusOne", batch=4).reconstruct(
        case[-1], budget=12, progress=lambda done, total, loss: calls.append((done, total)))
    assert rec.trace["optimizer"] == "OnePlusOne" and rec.trace["evaluations"] == 12
    assert calls == [(4, 12), (8, 12), (12, 12)]
    assert threading.active_count() == threads
    with pytest.raises(ConfigError, match="nevergrad"):
        ATTACKS.build("ggl", generator=gen, optimizer="NoSuchOpt").reconstruct(case[-1], budget=4)


def test_default_generator_trains_without_a_bar_under_a_progress_callback(gen, case, monkeypatch):
    """The audit (progress off or on) and the CLI pass a callback: no GAN training bar of its own."""
    import generators.resolve

    bars = []

    def default_generator(input_shape, *, device, progress):
        bars.append(progress)
        return gen

    monkeypatch.setattr(generators.resolve, "default_generator", default_generator)
    ATTACKS.build("ggl", batch=4).reconstruct(case[-1], budget=4, progress=lambda done, total, loss: None)
    ATTACKS.build("ggl", batch=4).reconstruct(case[-1], budget=4)
    assert bars == [False, True]


@gradient_transform
def prune_90(grads):
    """Keep the 10 % largest-magnitude entries of every gradient tensor (data-dependent mask)."""
    out = []
    for g in grads:
        k = int(0.9 * g.numel())
        threshold = g.abs().flatten().kthvalue(k).values if k else -1.0
        out.append(torch.where(g.abs() > threshold, g, torch.zeros_like(g)))
    return out


def test_dummy_gradient_goes_through_the_defense(gen, case):
    """Against a deterministic defense (pruning 90 %), matching through the defense scores the
    true image as a perfect match; matching the clean gradient does not."""
    model, x, y, _, _ = case
    obs = observe(model, x, y, defense=prune_90)
    rng = torch.Generator().manual_seed(0)
    from attacks.objectives import build_objective

    through = Scorer(obs, build_objective("l2"), [], DefenseSimulator(), y, rng)
    clean = Scorer(obs, build_objective("l2"), [], GradientSimulator(), y, rng)
    assert float(through(x.unsqueeze(0))[0]) < 1e-10 < float(clean(x.unsqueeze(0))[0])
    rec = ATTACKS.build("ggl", generator=gen, batch=8).reconstruct(obs, budget=16)
    assert "through the observation's defense" in rec.trace["simulator"]


def test_generator_box_puts_the_attack_in_latent_space(gen, case, chance):
    box = GeneratorBox(generator=gen)
    attack = OptimizationAttack("cosine", box=box, iterations=60, restarts=2, name="ig-latent")
    rec = attack.reconstruct(case[-1], seed=0)
    assert rec.trace["settings"]["box"] == "generator"
    p, s = quality(rec.inputs, case[1])
    assert p > chance[0] + 2.0 and s > chance[1] + 0.1, (p, s, chance)
    preset = ATTACKS.build("ig", box=box, tv=0.0)  # any preset composes with the box
    assert preset.reconstruct(case[-1], budget=2).inputs.shape == (1, 3, 16, 16)
    with pytest.raises(ConfigError, match="fixed labels"):
        ATTACKS.build("dlg", box=box).reconstruct(case[-1], budget=1)


def test_l1_ball_projection_is_the_euclidean_projection():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(5, 40, generator=g)
    radius = torch.tensor([0.5, 2.0, 5.0, 100.0, 10.0])
    p = project_l1_ball(v, radius)
    assert torch.all(p.abs().sum(1) <= radius + 1e-5)
    assert torch.equal(p[3], v[3])  # already inside
    for i in (0, 1, 2, 4):  # on the boundary, soft-thresholded by the theta found by bisection
        lo, hi = 0.0, float(v[i].abs().max())
        for _ in range(60):
            theta = (lo + hi) / 2
            lo, hi = (theta, hi) if (v[i].abs() - theta).clamp_min(0).sum() > radius[i] else (lo, theta)
        expected = v[i].sign() * (v[i].abs() - theta).clamp_min(0)
        assert torch.allclose(p[i], expected, atol=1e-5)


def test_bad_settings_raise_config_errors(gen, case):
    obs = case[-1]
    with pytest.raises(ConfigError, match="fixed labels"):
        ATTACKS.build("gias", generator=gen, labels="optimize")
    with pytest.raises(ConfigError, match="layers must be increasing"):
        ATTACKS.build("gifd", generator=gen, layers=[2, 1]).reconstruct(obs, budget=3)
    with pytest.raises(ConfigError, match="no parameter"):
        ATTACKS.build("ggl", generator=gen, learning_rate=0.1)
    wrong = build_model("lenet", (3, 32, 32), 10, seed=0)
    x32 = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match="train-generator --image-size 32 on a data set of 3 channels"):
        ATTACKS.build("gifd", generator=gen).reconstruct(observe(wrong, x32, torch.tensor([1])), budget=3)


class _FlatGenerator(nn.Module):
    """A user's generator without blocks: GIFD can only search its latent space."""

    latent_dim = 8

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3 * 16 * 16)

    def forward(self, z):
        return torch.sigmoid(self.fc(z)).view(-1, 3, 16, 16)


def test_user_generator_without_blocks(case):
    torch.manual_seed(0)
    rec = ATTACKS.build("gifd", generator=_FlatGenerator()).reconstruct(case[-1], budget=4)
    assert rec.trace["searched_layers"] == [0] and "latent search only" in word(rec.trace["note"])
    assert rec.trace["conditioning"] == {"code": "generator-unconditional", "params": {}}


def test_batches_reconstruct_every_image(gen, case):
    model = case[0]
    data = load_dataset("embedded", size=16)
    x, y = data.test_images[[3, 90]], data.test_labels[[3, 90]]
    obs = observe(model, x, y, share_labels=True)
    for name, budget, kw in (("ggl", 8, {"batch": 4}), ("gias", 4, {"restarts": 2}), ("gifd", 3, {"restarts": 2})):
        out = ATTACKS.build(name, generator=gen, **kw).reconstruct(obs, budget=budget, seed=0)
        assert out.inputs.shape == (2, 3, 16, 16) and out.labels.tolist() == y.tolist(), name
        assert out.trace["labels"]["method"] == "shared"
