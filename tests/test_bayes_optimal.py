"""The Bayes-optimal Monte Carlo adversary: ball sampling, likelihoods, and the
Bayes paper's two experiments on small models (embedded data, synthetic Gaussian data)."""
import math
from types import SimpleNamespace

import pytest
import torch

from adaptive.bayes.ball import uniform_ball_offsets
from adaptive.bayes.likelihood import kernel_log_likelihood
from adaptive.bayes.optimal import BayesOptimalAttack, applies
from adaptive.bayes.priors import GaussianPrior, LaplacePrior
from attacks import ATTACKS
from audit.core.data import load_dataset
from audit.core.errors import ConfigError, NotApplicable
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.client.observe import observe
from audit.core.types import clean_gradients
from defenses import build_defense
from audit.report.reasons import word

ITERATIONS = 100
SIGMA = 0.01  # soft-prune noise; the clean gradient's RMS is ~0.006 on this model


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    return load_dataset("embedded", size=16)


@pytest.fixture(scope="module")
def cnn(data):
    """The Bayes paper's conv net (conv32-pool-conv64-pool-dense100-dense) at step 0."""
    return build_model("cnn", data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=0)


def _held_out(data, i):
    idx = 23 * i
    return data.test_images[idx:idx + 1], data.test_labels[idx:idx + 1]


def _best_of_grid(observations, build, grid):
    """Mean PSNR over the images for each grid value; the best one (the paper's tuning)."""
    means = {}
    for value in grid:
        scores = [float(psnr(build(value).reconstruct(obs, ITERATIONS, 0).inputs, x).mean())
                  for obs, x in observations]
        means[value] = sum(scores) / len(scores)
    return max(means.values()), means


# --------------------------------------------------------------------------- components
def test_ball_offsets_are_uniform_in_the_ball_and_seeded():
    d, delta = 3, 0.5
    u = uniform_ball_offsets((d,), 4000, delta, generator=torch.Generator().manual_seed(0))
    again = uniform_ball_offsets((d,), 4000, delta, generator=torch.Generator().manual_seed(0))
    assert torch.equal(u, again)
    r = u.norm(dim=1)
    assert float(r.max()) <= delta + 1e-6
    # uniform in the ball: P(r < delta * 0.5^(1/d)) = 1/2, and the directions average out
    assert abs(float((r < delta * 0.5 ** (1 / d)).float().mean()) - 0.5) < 0.03
    assert float(u.mean(0).norm()) < 0.03
    with pytest.raises(ConfigError, match="delta"):
        uniform_ball_offsets((d,), 1, -1.0, generator=None)


def test_kernel_likelihood_prefers_the_true_input(cnn, data):
    """The Monte Carlo estimate of log p(g | x) ranks the private input above other images."""
    def noisy(model, inputs, labels, *, loss_fn, generator):
        return [g + 0.002 * torch.randn(g.shape, generator=generator) for g in
                clean_gradients(model, inputs, labels, loss_fn)]

    x, y = _held_out(data, 0)
    gen = torch.Generator().manual_seed(0)
    shared = noisy(cnn, x, y, loss_fn=torch.nn.functional.cross_entropy, generator=gen)

    def estimate(candidate):
        draws = [noisy(cnn, candidate, y, loss_fn=torch.nn.functional.cross_entropy, generator=gen)
                 for _ in range(4)]
        return float(kernel_log_likelihood(shared, draws))

    true = estimate(x)
    others = [estimate(_held_out(data, i)[0]) for i in (1, 2, 3)]
    assert all(true > o for o in others), (true, others)


# --------------------------------------------------------------------------- Table 2 ordering
def test_bayes_beats_l2_on_soft_prune_plus_gaussian_noise_at_step_0(cnn, data):
    """Bayes paper Table 2, Prune+Gauss at step 0: the exact mixture likelihood beats L2
    matching (same init, optimiser, budget and prior grid, in Gaussian-likelihood units)."""
    defense = build_defense("soft-prune", prune_prob=0.5, sigma=SIGMA, noise="gaussian")
    observations = []
    for i in range(3):
        x, y = _held_out(data, i)
        observations.append((observe(cnn, x, y, defense, seed=i), x))
    grid = (0.3, 1.0)  # TV weight per unit of squared gradient error
    l2, l2_grid = _best_of_grid(observations, lambda tv: ATTACKS.build("bayes-l2", tv=tv), grid)
    bayes, bayes_grid = _best_of_grid(
        observations, lambda tv: ATTACKS.build("bayes-optimal", beta=tv / (2 * SIGMA ** 2)), grid)
    assert bayes > l2 + 1.5, (bayes_grid, l2_grid)


def test_monte_carlo_likelihood_for_a_defense_without_log_prob(cnn, data):
    """A plain-function defense (no log_prob) with much more noise on one layer: the Monte
    Carlo likelihood learns per-layer bandwidths from the draws, L2 weighs every layer alike."""
    def layer_noise(model, inputs, labels, *, loss_fn, generator):
        grads = clean_gradients(model, inputs, labels, loss_fn)
        return [g + (0.05 if i == 4 else 0.001) * torch.randn(g.shape, generator=generator).to(g.device)
                for i, g in enumerate(grads)]

    x, y = _held_out(data, 1)
    obs = observe(cnn, x, y, layer_noise, seed=0)
    # the same 60 iterations each (budget None: the attacks' own iteration counts); in gradient
    # evaluations the Monte Carlo adversary spends mc_draws times more
    rec = ATTACKS.build("bayes-optimal", beta=0.1 / (2 * 0.001 ** 2), mc_draws=3, iterations=60).reconstruct(obs, None, 0)
    assert word(rec.trace["likelihood"]).startswith("monte-carlo")
    assert rec.trace["iterations"] == 60 and rec.trace["gradient_evaluations"] >= 3 * 60
    l2 = ATTACKS.build("bayes-l2", tv=1.0, iterations=60).reconstruct(obs, None, 0)
    assert float(psnr(rec.inputs, x)) > float(psnr(l2.inputs, x)) + 3


# --------------------------------------------------------------------------- synthetic check
def test_synthetic_true_prior_and_likelihood_end_closest():
    """Bayes paper Fig. 4: x ~ N(0, I_20), y = argmax(Wx), 2-layer MLP, Laplace noise. Of the
    four (prior, conditional) choices among Gaussian / Laplace, the true pair ends closest.
    Inputs enter the model as pixels 0.5 + x/8 (the model's Normalize layer undoes it)."""
    d, classes, scale, b = 20, 5, 0.125, 0.3
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(classes, d, generator=gen)
    model = build_model("mlp", (1, 1, d), classes, mean=(0.5,), std=(scale,), seed=0, hidden=(32,))
    defense = build_defense("laplacian", sigma=b)
    priors = {"gaussian": GaussianPrior(0.5, scale), "laplace": LaplacePrior(0.5, scale / math.sqrt(2))}
    likelihoods = {"laplace": {"likelihood": "laplacian", "b": b},
                   "gaussian": {"likelihood": "gaussian", "sigma": b * math.sqrt(2)}}  # same variance
    distances = {(p, c): [] for p in priors for c in likelihoods}
    for n in range(16):
        x = torch.randn(1, d, generator=gen)
        pixels = (0.5 + scale * x).view(1, 1, 1, d)
        obs = observe(model, pixels, (x @ w.T).argmax(1), defense, share_labels=True, seed=n)
        for (p, c), out in distances.items():
            attack = BayesOptimalAttack(prior=priors[p], beta=1.0, box="none", init="gray", lr=0.03,
                                        iterations=100, **likelihoods[c])
            rec = attack.reconstruct(obs, seed=n)
            out.append(float(((rec.inputs - pixels) / scale).norm()))
    mean = {k: sum(v) / len(v) for k, v in distances.items()}
    assert min(mean, key=mean.get) == ("gaussian", "laplace"), mean


# --------------------------------------------------------------------------- contracts
def test_settings_are_checked_and_the_attack_is_registered(cnn, data):
    assert "bayes-optimal" in ATTACKS
    with pytest.raises(ConfigError, match="likelihood"):
        ATTACKS.build("bayes-optimal", likelihood="nope")
    with pytest.raises(ConfigError, match="mc_draws"):
        ATTACKS.build("bayes-optimal", mc_draws=1)
    with pytest.raises(ConfigError, match="no parameter"):
        ATTACKS.build("bayes-optimal", tv=1.0)
    x, y = _held_out(data, 0)
    with pytest.raises(NotApplicable, match="bayes-monte-carlo-needs-defense"):
        ATTACKS.build("bayes-optimal", likelihood="monte-carlo").reconstruct(observe(cnn, x, y), 1, 0)


def test_prior_weight_is_scaled_by_the_likelihood_fisher_information(cnn, data):
    """With beta unset, beta = prior_weight * I / 2: exactly bayes-l2's TV weight under
    Gaussian noise (I = 1/sigma^2); the soft-prune mixture is flatter (smaller I)."""
    x, y = _held_out(data, 0)
    attack = ATTACKS.build("bayes-optimal", prior_weight=0.5)
    gauss = attack.reconstruct(observe(cnn, x, y, build_defense("gaussian", sigma=SIGMA)), 1, 0)
    assert gauss.trace["beta"] == pytest.approx(0.5 / (2 * SIGMA ** 2), rel=0.02)
    soft = attack.reconstruct(observe(cnn, x, y, build_defense("soft-prune", sigma=SIGMA)), 1, 0)
    assert 0 < soft.trace["beta"] < gauss.trace["beta"] and "Fisher" in word(soft.trace["beta_source"])
    given = ATTACKS.build("bayes-optimal", beta=3.0).reconstruct(observe(cnn, x, y), 1, 0)
    assert given.trace["beta"] == 3.0 and word(given.trace["likelihood"]) == "given: l2"


def test_ball_points_run_batched_and_sequential_with_the_same_seed_semantics():
    model = build_model("mlp", (1, 4, 4), 3, seed=0, hidden=(8,))
    obs = observe(model, torch.rand(1, 1, 4, 4, generator=torch.Generator().manual_seed(0)),
                  torch.tensor([1]), build_defense("soft-prune", sigma=0.01), seed=0)
    batched = ATTACKS.build("bayes-optimal", k=3, delta=0.1, restarts=2)
    first, second = batched.reconstruct(obs, 5, 0), batched.reconstruct(obs, 5, 0)
    assert word(first.trace["execution"]).startswith("batched")
    assert torch.equal(first.inputs, second.inputs)
    mc = ATTACKS.build("bayes-optimal", k=2, delta=0.1, likelihood="monte-carlo", mc_draws=2).reconstruct(obs, 5, 0)
    assert word(mc.trace["execution"]).startswith("stacked") and math.isfinite(mc.trace["final_losses"][0])


def test_applies_to_likelihoods_and_stochastic_defenses():
    traits = dict(has_log_prob=False, architectural=False, stochastic=True, differentiable=True)
    assert applies(SimpleNamespace(**{**traits, "has_log_prob": True}))[0]
    ok, why = applies(SimpleNamespace(**traits))
    assert ok and why.code == "bayes-monte-carlo" and "Monte Carlo" in word(why)
    assert not applies(SimpleNamespace(**{**traits, "stochastic": False}))[0]
    assert not applies(SimpleNamespace(**{**traits, "differentiable": False}))[0]
