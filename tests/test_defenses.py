"""Each defense's defining property, seeded reproducibility, differentiability, bad input."""
import math
import re

import pytest
import torch
from torch import nn

from audit.core.errors import ConfigError, DefenseError
from audit.core.models import build_model
from audit.core.types import FunctionDefense, clean_gradients
from defenses import DEFENSES, build_defense, call_defense, check_output, resolve_defense
from defenses.augment import AUGMENTATIONS
from defenses.evaluator import NoiseRatioNet, load_or_train_evaluator, train_evaluator

SHAPE = (3, 8, 8)
ALL = ["ats", "censor", "clip", "dp-sgd", "gaussian", "laplacian", "none", "precode", "prune",
       "quantize", "refiner", "soft-prune", "soteria", "svdefense"]


@pytest.fixture(scope="module")
def evaluator():
    gen = torch.Generator().manual_seed(0)
    return train_evaluator(torch.rand(32, *SHAPE, generator=gen), width=4, epochs=1, batch_size=16)


def small_params(name, evaluator):
    """Cheap settings for the slow defenses (the defining code path stays the same)."""
    return {"refiner": {"evaluator": evaluator, "iota": 2}, "precode": {"latent": 8},
            "censor": {"trials": 5}}.get(name, {})


def mlp(seed=0):
    return build_model("mlp", SHAPE, 4, hidden=(24, 12), seed=seed)


def batch(n=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, *SHAPE, generator=gen), torch.arange(n) % 4


def cos(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def run(defense, model, x, y, seed=0):
    return call_defense(defense, model, x, y, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- registry, errors
def test_every_defense_is_registered():
    assert DEFENSES.names() == ALL


@pytest.mark.parametrize("name,params,fragment", [
    ("prune", {"ratio": 1.5}, "[0, 1)"),
    ("gaussian", {"sigma": -1.0}, "(0, inf]"),
    ("soft-prune", {"prune_prob": 2}, "[0, 1]"),
    ("quantize", {"bits": 0}, "[1, 32]"),
    ("censor", {"trials": 0}, "[1, inf]"),
    ("svdefense", {"energy": 0}, "(0, 1]"),
    ("refiner", {"alpha": 1.2}, "[0, 1]"),
    ("prune", {"scope": "row"}, "'layer', 'global'"),
    ("ats", {"policy": "7-99"}, "known indices"),
    ("prune", {"ratio": "high"}, "must be a number"),
])
def test_bad_parameters_name_the_valid_range(name, params, fragment):
    with pytest.raises(ConfigError) as err:
        build_defense(name, **params)
    assert fragment in str(err.value) and name in str(err.value)


def test_unknown_names_and_parameters_list_the_valid_ones():
    with pytest.raises(ConfigError, match="Valid defenses: ats, censor"):
        build_defense("prunning")
    with pytest.raises(ConfigError, match="valid parameters: ratio, scope"):
        build_defense("prune", sigma=1)
    with pytest.raises(ConfigError, match="Valid augmentations"):
        build_defense("ats", policy="warp:0.5:3")


def test_resolve_defense_accepts_names_objects_callables_and_import_paths():
    assert resolve_defense("prune", {"ratio": 0.5}).ratio == 0.5
    assert resolve_defense(None).name == "none"
    obj = build_defense("clip")
    assert resolve_defense(obj) is obj
    fn = resolve_defense(lambda model, inputs, labels, *, loss_fn, generator: [])
    assert isinstance(fn, FunctionDefense)
    assert resolve_defense("defenses.noise:GaussianNoise", {"sigma": 0.2}).sigma == 0.2
    with pytest.raises(ConfigError, match="has no attribute 'Nope'"):
        resolve_defense("defenses.noise:Nope")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_pkg"):
        resolve_defense("no_such_pkg.mod:defense")
    with pytest.raises(ConfigError, match="cannot be applied"):
        resolve_defense(obj, {"bound": 1})


def test_check_output_names_the_defense_and_the_problem():
    model = mlp()
    x, y = batch()
    good = clean_gradients(model, x, y)
    assert len(check_output(build_defense("none"), good, model)) == len(good)
    cases = [(good[:-1], "returned 5 tensors for 6"), (good[0], "returned a Tensor"),
             ([good[1]] + good[1:], "has shape (24,)"),
             ([g * float("nan") for g in good], "NaN/inf")]
    for grads, message in cases:
        with pytest.raises(DefenseError, match=re.escape(message)):
            check_output(FunctionDefense(lambda *a, **k: grads, name="mine"), grads, model)

    def broken(model, inputs, labels, *, loss_fn, generator):
        raise RuntimeError("boom")

    with pytest.raises(DefenseError, match="'broken' raised RuntimeError: boom"):
        call_defense(FunctionDefense(broken), model, x, y)


# --------------------------------------------------------------------------- defining properties
@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("n", [1, 3])
def test_censor_is_orthogonal_with_the_clean_norms(layerwise, n):
    model, (x, y) = mlp(), batch(n)
    defense = build_defense("censor", trials=6, layerwise=layerwise)
    shared = run(defense, model, x, y)
    clean = clean_gradients(model, x, y)
    blocks = list(zip(shared, clean)) if layerwise else [
        (torch.cat([s.flatten() for s in shared]), torch.cat([c.flatten() for c in clean]))]
    for s, c in blocks:
        assert abs(cos(s, c)) < 1e-5
        assert float(s.norm()) == pytest.approx(float(c.norm()), rel=1e-5)
    if n > 1:  # the span of the per-example gradients is projected out too
        for i in range(n):
            example = clean_gradients(model, x[i:i + 1], y[i:i + 1])
            if layerwise:
                assert all(abs(cos(s, e)) < 1e-5 for s, e in zip(shared, example))
            else:
                assert abs(cos(torch.cat([s.flatten() for s in shared]),
                               torch.cat([e.flatten() for e in example]))) < 1e-5


def test_censor_shares_the_lowest_loss_candidate():
    model, (x, y) = mlp(), batch(2)
    defense = build_defense("censor", trials=8)
    clean = clean_gradients(model, x, y)
    spans = defense._spans(model, x, y, nn.functional.cross_entropy, clean)
    cands = defense.candidates(clean, spans, torch.Generator().manual_seed(0))
    losses = defense.candidate_losses(model, x, y, nn.functional.cross_entropy, cands)
    assert losses.dtype == torch.float64 and len(set(losses.tolist())) == 8
    shared = run(defense, model, x, y, seed=0)
    best = int(losses.argmin())
    assert all(torch.equal(s, c[best]) for s, c in zip(shared, cands))


@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.9])
def test_prune_keeps_exactly_the_requested_fraction(scope, ratio):
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(7, 13, generator=gen), torch.randn(5, generator=gen), torch.randn(3, 4, 2, generator=gen)]
    pruned = build_defense("prune", ratio=ratio, scope=scope).transform(grads)
    if scope == "layer":
        for g, p in zip(grads, pruned):
            kept = p != 0
            assert int(kept.sum()) == g.numel() - round(ratio * g.numel())
            if 0 < int(kept.sum()) < g.numel():
                assert float(g[kept].abs().min()) >= float(g[~kept].abs().max())
    else:
        n = sum(g.numel() for g in grads)
        assert sum(int((p != 0).sum()) for p in pruned) == n - round(ratio * n)
    assert all(torch.equal(p[p != 0], g[p != 0]) for g, p in zip(grads, pruned))


@pytest.mark.parametrize("noise", ["gaussian", "laplacian"])
def test_soft_prune_log_prob_matches_its_sampling(noise):
    defense = build_defense("soft-prune", prune_prob=0.3, sigma=0.1, noise=noise)
    clean = torch.full((200_000,), 0.25)
    shared = defense.transform([clean], generator=torch.Generator().manual_seed(0))[0]
    edges = torch.linspace(-0.6, 0.9, 31)
    observed = torch.histc(shared, bins=30, min=-0.6, max=0.9) / clean.numel()
    grid = torch.linspace(-0.6, 0.9, 30 * 200 + 1)
    density = defense.log_prob_elementwise(grid, torch.full_like(grid, 0.25)).exp()
    expected = torch.stack([torch.trapezoid(density[i * 200:(i + 1) * 200 + 1], grid[i * 200:(i + 1) * 200 + 1])
                            for i in range(30)])
    assert torch.allclose(observed, expected, atol=4e-3)
    assert float(expected.sum()) == pytest.approx(1.0, abs=0.02)  # the mass in [-0.6, 0.9]
    # the total log-likelihood is the sum of the per-coordinate mixtures, and the truth scores
    # higher than a wrong clean gradient
    total = defense.log_prob([shared], [clean])
    assert float(total) == pytest.approx(float(defense.log_prob_elementwise(shared, clean).sum()), rel=1e-6)
    assert float(total) > float(defense.log_prob([shared], [clean + 0.1]))


@pytest.mark.parametrize("name,dist", [
    ("gaussian", lambda s: torch.distributions.Normal(0.0, s)),
    ("laplacian", lambda s: torch.distributions.Laplace(0.0, s)),
])
def test_noise_log_prob_is_the_sampling_density(name, dist):
    defense = build_defense(name, sigma=0.3)
    clean = [torch.zeros(100_000)]
    shared = defense.transform(clean, generator=torch.Generator().manual_seed(0))
    noise = shared[0] - clean[0]
    assert float(noise.std()) == pytest.approx(float(dist(0.3).stddev), rel=0.02)
    assert float(defense.log_prob(shared, clean)) == pytest.approx(float(dist(0.3).log_prob(noise).sum()), rel=1e-5)


def test_soteria_changes_only_the_defended_layer():
    model, (x, y) = mlp(), batch(3)
    defense = build_defense("soteria", ratio=0.5)
    shared = run(defense, model, x, y)
    clean = clean_gradients(model, x, y)
    changed = defense.defended_parameters(model)
    assert changed == [len(clean) - 2]  # the last linear's weight; its bias is untouched
    for i, (s, c) in enumerate(zip(shared, clean)):
        if i not in changed:
            assert torch.equal(s, c)
    mask = defense.feature_mask(model, x)
    assert int(mask.sum()) == 12 - 6
    w_shared, w_clean = shared[changed[0]], clean[changed[0]]
    assert torch.equal(w_shared[:, mask], w_clean[:, mask]) and not w_shared[:, ~mask].any()
    assert not torch.equal(w_shared, w_clean)
    with pytest.raises(ConfigError, match="valid: last, largest"):
        build_defense("soteria", layer="3").defended_layer(model)


@pytest.mark.parametrize("energy", [None, 0.5, 0.9, 1.0])
def test_svdefense_reconstruction_keeps_the_requested_energy(energy):
    model, (x, y) = build_model("cnn", SHAPE, 4), batch(4)
    defense = build_defense("svdefense", energy=energy)
    clean = clean_gradients(model, x, y)
    factors = defense.compress(clean)
    rebuilt = defense.reconstruct(factors)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, run(defense, model, x, y)))
    low_rank = 0
    for g, f, r in zip(clean, factors, rebuilt):
        if g.dim() < 2:
            assert r is g
            continue
        matrix = g.reshape(g.shape[0], -1)
        w = matrix.norm(dim=1)
        s = torch.linalg.svdvals(w[:, None] * matrix).double()
        threshold = energy if energy is not None else 1 - math.exp(-0.3 * float(-(lambda p: (p * p.log()).sum())(
            (s ** 2 / (s ** 2).sum())[s > 0])))
        kept = float(((w[:, None] * r.reshape(matrix.shape)).double() ** 2).sum() / (s ** 2).sum())
        assert f.energy == pytest.approx(threshold, rel=1e-5)
        assert kept >= threshold - 1e-5  # the requested spectral energy is kept ...
        assert float((s[:f.rank - 1] ** 2).sum() / (s ** 2).sum()) < threshold  # ... with the smallest rank
        low_rank += f.rank < min(matrix.shape)
    if energy == 1.0:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(rebuilt, clean))
    else:
        assert low_rank > 0


def test_precode_wraps_the_last_layer_and_adds_the_kl_term():
    model = mlp()
    n_before = len(list(model.parameters()))
    defense = build_defense("precode", latent=6, beta=0.5)
    wrapped = defense.wrap_model(model)
    assert wrapped is model and defense.wrap_model(model) is model  # in place, idempotent
    assert isinstance(model, nn.Sequential) and len(list(model.parameters())) == n_before + 4
    x, y = batch(3)
    shared = run(defense, model, x, y)
    again = run(defense, model, x, y)
    other = run(defense, model, x, y, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(shared, again))
    assert not all(torch.equal(a, b) for a, b in zip(shared, other))  # the latent is sampled
    from defenses.precode import bottlenecks, kl_loss
    neck = bottlenecks(model)[0]
    model.eval()
    assert torch.equal(model(x), model(x))  # no sampling outside the client's computation
    assert float(kl_loss(model).detach()) > 0 and neck.last_latent.shape == (3, 6)
    with pytest.raises(ConfigError, match="wrap_model"):
        defense(mlp(), x, y)


def test_refiner_upload_is_within_eps_of_the_clean_gradient(evaluator):
    model, (x, y) = mlp(), batch(2)
    clean = clean_gradients(model, x, y)
    tight = build_defense("refiner", eps=1e-3, evaluator=evaluator, iota=3)
    shared = run(tight, model, x, y)
    dist = math.sqrt(sum(float(((s - c) ** 2).sum()) for s, c in zip(shared, clean)))
    assert dist == pytest.approx(1e-3, rel=1e-4)  # projected onto the eps-sphere
    loose = build_defense("refiner", eps=100.0, evaluator=evaluator, iota=3)
    robust_x = loose.robust_data(model, x, y, generator=torch.Generator().manual_seed(5))
    assert float((robust_x - x).abs().mean()) > 0.05 and 0 <= float(robust_x.min()) <= float(robust_x.max()) <= 1
    unprojected = run(loose, model, x, y, seed=5)
    expected = clean_gradients(model, robust_x, y)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(unprojected, expected))


def test_refiner_evaluator_is_trained_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GIA_AUDIT_CACHE", str(tmp_path))
    first = load_or_train_evaluator(SHAPE, width=2, epochs=1)
    files = list(tmp_path.glob("refiner-evaluator-embedded-3x8x8-w2-e1-s0.pt"))
    assert len(files) == 1
    again = load_or_train_evaluator(SHAPE, width=2, epochs=1)
    assert isinstance(again, NoiseRatioNet)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))
    noise = torch.rand(4, *SHAPE)
    assert first(noise).shape == (4,)


def test_evaluator_learns_the_noise_ratio():
    gen = torch.Generator().manual_seed(0)
    smooth = torch.nn.functional.interpolate(torch.rand(32, 3, 2, 2, generator=gen), size=(8, 8), mode="bilinear")
    net = train_evaluator(smooth, width=8, epochs=10, batch_size=16, lr=1e-3)
    noisy = [float(net((1 - r) * smooth[:16] + r * torch.rand(16, *SHAPE, generator=gen)).mean())
             for r in (0.0, 0.5, 1.0)]
    assert noisy[0] < noisy[1] < noisy[2] and noisy[2] - noisy[0] > 0.04


def test_dp_sgd_clips_each_example():
    model, (x, y) = mlp(), batch(3)
    shared = run(build_defense("dp-sgd", clip=1e-3, noise_multiplier=0.0), model, x, y)
    per_example = [clean_gradients(model, x[i:i + 1], y[i:i + 1]) for i in range(3)]
    clipped = [[g * 1e-3 / math.sqrt(sum(float((h ** 2).sum()) for h in ex)) for g in ex] for ex in per_example]
    for i, s in enumerate(shared):
        assert torch.allclose(s, sum(c[i] for c in clipped) / 3, atol=1e-9)
    noisy = run(build_defense("dp-sgd", clip=1e-3, noise_multiplier=2.0), model, x, y)
    std = float(torch.cat([(a - b).flatten() for a, b in zip(noisy, shared)]).std())
    assert std == pytest.approx(2.0 * 1e-3 / 3, rel=0.1)


def test_clip_and_quantize():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(10, 10, generator=gen), torch.randn(10, generator=gen)]
    clipped = build_defense("clip", bound=1.0).transform(grads)
    assert math.sqrt(sum(float((g ** 2).sum()) for g in clipped)) == pytest.approx(1.0, rel=1e-5)
    assert all(float(g.norm()) == pytest.approx(0.5, rel=1e-5)
               for g in build_defense("clip", bound=0.5, per_layer=True).transform(grads))
    q = build_defense("quantize", bits=2).transform([g.clone().requires_grad_() for g in grads])
    assert all(len(torch.unique(t)) <= 4 for t in q)
    assert all(float((t.detach() - g).abs().max()) <= float(g.max() - g.min()) / 6 + 1e-6 for t, g in zip(q, grads))
    q[0].sum().backward()  # straight-through: attackers can differentiate through rounding


def test_ats_transforms_the_private_images():
    x, y = batch(4)
    ats = build_defense("ats", policy="21-13-3+7-4-15")
    out = ats.transform_inputs(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape and 0 <= float(out.min()) and float(out.max()) <= 1
    assert not torch.allclose(out, x)
    img = torch.rand(1, *SHAPE)
    moved = AUGMENTATIONS.get("translateY")(img, 9, 1.0)  # 150/331 of 8 pixels -> 4 rows down
    assert torch.equal(moved[..., 4:, :], img[..., :4, :]) and not moved[..., :4, :].any()
    explicit = build_defense("ats", policy="brightness:1.0:9", crop_flip=False)
    brighter = explicit.transform_inputs(0.25 * torch.ones(2, *SHAPE), torch.Generator().manual_seed(0))
    assert {round(float(v), 4) for v in brighter.unique()} <= {0.025, 0.475}


# --------------------------------------------------------------------------- generic contracts
def _stochastic_build(name, evaluator):
    extra = {"quantize": {"stochastic_rounding": True}}.get(name, {})
    return build_defense(name, **small_params(name, evaluator), **extra)


@pytest.mark.parametrize("name", ALL)
def test_seeded_defense_is_reproducible(name, evaluator):
    x, y = batch(2)
    defense = _stochastic_build(name, evaluator)
    model = defense.wrap_model(mlp())
    a, b, c = run(defense, model, x, y, 3), run(defense, model, x, y, 3), run(defense, model, x, y, 4)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    differs = not all(torch.equal(u, v) for u, v in zip(a, c))
    assert differs == defense.stochastic, f"{name}: stochastic={defense.stochastic}, differs={differs}"


@pytest.mark.parametrize("name", ALL)
def test_defense_is_differentiable_wrt_the_inputs(name, evaluator):
    x, y = batch(2)
    defense = build_defense(name, **small_params(name, evaluator))
    model = defense.wrap_model(mlp())
    dummy = x.clone().requires_grad_(True)
    shared = defense(model, dummy, y, generator=torch.Generator().manual_seed(0))
    (grad,) = torch.autograd.grad(sum((g ** 2).sum() for g in shared), dummy)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0
