"""Each defense's defining property, seeded reproducibility, differentiability, bad input."""
import math
import os
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
ALL = ["ats", "censor", "clip", "decoy", "dp-sgd", "flower-fixedclipping", "flower-localdp", "gaussian", "laplacian",
       "none", "precode", "prune", "quantize", "refiner", "soft-prune", "soteria", "svdefense"]


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


def test_soteria_prunes_the_features_with_the_lowest_scores():
    """Per-feature scores sum_b ||d r_bf / d x_b|| / |r_bf| computed here one feature and one
    example at a time; the shared gradient zeroes exactly the lowest-scoring columns."""
    model, (x, y) = mlp(), batch(3, seed=2)
    features = model[:-1]  # everything before the defended (last) linear layer
    scores = torch.zeros(12, dtype=torch.float64)
    for b in range(3):
        xb = x[b:b + 1].clone().requires_grad_(True)
        r = features(xb)[0]
        for f in range(12):
            (dr_dx,) = torch.autograd.grad(r[f], xb, retain_graph=True)
            scores[f] += float(dr_dx.norm()) / (abs(float(r[f].detach())) + 1e-12)
    ratio = 0.25
    pruned = torch.argsort(scores)[:round(ratio * 12)]
    assert float(scores.sort().values[2]) < float(scores.sort().values[3])  # no tie at the cut
    shared = run(build_defense("soteria", ratio=ratio), model, x, y)
    clean = clean_gradients(model, x, y)
    zero_columns = {int(c) for c in torch.nonzero(~shared[-2].any(0)).flatten()}
    assert zero_columns == {int(f) for f in pruned}
    kept = [f for f in range(12) if f not in zero_columns]
    assert torch.equal(shared[-2][:, kept], clean[-2][:, kept])


def test_precode_kl_term_reaches_the_shared_gradient():
    """Same draw, different beta: the encoder's (and earlier) gradients move linearly in beta;
    the decoder and head, which the KL term does not touch, do not move."""
    defense = {beta: build_defense("precode", latent=6, beta=beta) for beta in (0.0, 0.5, 1.0)}
    model = defense[0.0].wrap_model(mlp())
    x, y = batch(3)
    shared = {beta: run(d, model, x, y, seed=2) for beta, d in defense.items()}
    names = [n for n, _ in model.named_parameters()]
    for i, name in enumerate(names):
        step_half, step_full = shared[0.5][i] - shared[0.0][i], shared[1.0][i] - shared[0.0][i]
        if "decoder" in name or name.startswith(names[-1].rpartition(".")[0]):
            assert torch.allclose(step_full, torch.zeros_like(step_full), atol=1e-7), name
        else:
            assert float(step_full.abs().max()) > 1e-4, name
            assert torch.allclose(step_half, 0.5 * step_full, atol=1e-6), name


def test_refiner_objective_decreases_over_the_refinement_steps(evaluator):
    model, (x, y) = mlp(), batch(2)
    cases = {"privacy term": {"beta": 1.0, "lr": 50.0}, "utility term": {"beta": 0.0, "lr": 1e3}}
    for label, params in cases.items():
        trace = []
        build_defense("refiner", evaluator=evaluator, iota=5, **params).robust_data(
            model, x, y, generator=torch.Generator().manual_seed(7), trace=trace)
        assert len(trace) == 6, label
        assert all(b < a for a, b in zip(trace, trace[1:])), (label, trace)
        assert trace[0] - trace[-1] > 1e-3 * abs(trace[0]), (label, trace)


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


@pytest.mark.parametrize("per_layer", [False, True])
def test_dp_sgd_noise_is_calibrated_to_the_clipping_bound(per_layer):
    """The noise std on the sum is noise_multiplier times the sum's sensitivity (the largest
    norm one example can contribute), measured from each example's clipped gradient alone."""
    model, (x, y) = mlp(), batch(4)
    clip, multiplier = 1e-3, 2.0
    quiet = build_defense("dp-sgd", clip=clip, noise_multiplier=0.0, per_layer=per_layer)
    contributions = [run(quiet, model, x[i:i + 1], y[i:i + 1]) for i in range(4)]
    sensitivity = max(math.sqrt(sum(float((g.double() ** 2).sum()) for g in c)) for c in contributions)
    assert sensitivity == pytest.approx(clip, rel=1e-4)  # every example is clipped: the bound is reached
    mean = run(quiet, model, x, y)
    noisy = run(build_defense("dp-sgd", clip=clip, noise_multiplier=multiplier, per_layer=per_layer), model, x, y)
    std = float(torch.cat([(a - b).flatten() for a, b in zip(noisy, mean)]).std())
    assert std * 4 == pytest.approx(multiplier * sensitivity, rel=0.05)


def test_privacy_spent_matches_opacus_numbers():
    from defenses.dpsgd import privacy_spent

    # opacus 1.6.0 RDPAccountant: q=0.01, sigma=1.1, 1000 steps, delta=1e-5 -> 1.71177 at order 9.6
    ours = privacy_spent(1000, 0.01, 1.1, 1e-5, accountant="rdp")
    assert ours.epsilon == pytest.approx(1.7117700912, rel=1e-6) and ours.order == 9.6
    assert tuple(ours) == (ours.epsilon, 1e-5) and ours.accountant == "gia-audit RDP"
    # opacus 1.6.0, q=0.1, sigma=0.8, 100 steps, delta=1e-6 (an integer optimal order)
    assert privacy_spent(100, 0.1, 0.8, 1e-6, accountant="rdp").epsilon == pytest.approx(
        build_defense("dp-sgd", noise_multiplier=0.8).privacy(100, 0.1, 1e-6, accountant="rdp").epsilon)
    more = [privacy_spent(steps, 0.05, 1.0, accountant="rdp").epsilon for steps in (1, 10, 100)]
    assert 0 < more[0] < more[1] < more[2]
    assert privacy_spent(0, 0.05, 1.0).epsilon == 0 and privacy_spent(5, 0.05, 0.0).epsilon == math.inf
    with pytest.raises(ConfigError, match=r"sample_rate must be in \[0, 1\]"):
        privacy_spent(10, 1.5, 1.0)


def test_privacy_spent_agrees_with_opacus_when_installed():
    pytest.importorskip("opacus", reason="checks our accountant against opacus, the optional [dp] extra "
                        "(pip install -e '.[dp]')")
    from defenses.dpsgd import privacy_spent

    for q, sigma, steps in [(0.001, 0.8, 1), (0.01, 1.1, 1000), (0.1, 0.5, 50), (0.5, 2.0, 10000)]:
        ours = privacy_spent(steps, q, sigma, 1e-5, accountant="rdp")
        theirs = privacy_spent(steps, q, sigma, 1e-5, accountant="opacus")
        assert theirs.accountant.startswith("opacus")
        assert ours.epsilon == pytest.approx(theirs.epsilon, rel=1e-6) and ours.order == theirs.order


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


def test_ats_applies_every_operation_with_the_ats_code_ranges():
    from defenses.ats import SEARCH_SPACE

    # the indices of ATS's best policies (7-4-15, 21-13-3) in its search space
    assert [SEARCH_SPACE[i] for i in (7, 4, 15, 21, 13, 3)] == [
        ("translateY", 0.7, 2), ("sharpness", 0.8, 1), ("brightness", 0.7, 9),
        ("translateX", 0.5, 5), ("brightness", 0.6, 5), ("translateX", 0.3, 9)]
    flat = 0.25 * torch.ones(64, *SHAPE)
    gen = torch.Generator().manual_seed(0)
    # probability 0 still applies (the ATS SubPolicy never draws against it); factor 1 +- 0.5
    brighter = build_defense("ats", policy="brightness:0.0:9", crop_flip=False).transform_inputs(flat, gen)
    per_image = {round(float(v), 4) for v in brighter.flatten(1).mean(1)}
    assert per_image == {0.125, 0.375}
    assert per_image == {round(0.25 * (1 + s * 0.5 * 9 / 9), 4) for s in (-1, 1)}
    x, _ = batch(3)
    assert torch.allclose(build_defense("ats", policy="29", crop_flip=False).transform_inputs(x, gen), 1 - x)
    # rotation has no sign draw: every seed rotates the same way
    rotations = [build_defense("ats", policy="rotate:9", crop_flip=False).transform_inputs(x[:1], torch.Generator()
                 .manual_seed(s)) for s in range(4)]
    assert all(torch.equal(r, rotations[0]) for r in rotations) and not torch.equal(rotations[0], x[:1])
    assert float(rotations[0][0, :, 0, 0].sub(128 / 255).abs().max()) < 1e-6  # grey fill in the corner
    posterized = AUGMENTATIONS.get("posterize")(x, 9, 1.0)  # 4 bits: multiples of 16/255
    assert torch.allclose(posterized * 255 / 16, (posterized * 255 / 16).round(), atol=1e-4)
    assert torch.equal(AUGMENTATIONS.get("solarize")(x, 0, 1.0), x)  # threshold 256: nothing inverted
    assert torch.allclose(AUGMENTATIONS.get("solarize")(x, 9, 1.0), 1 - x)


# --------------------------------------------------------------------------- rounds
def test_call_defense_passes_the_round_only_to_defenses_that_take_it():
    model, (x, y) = mlp(), batch(2)
    seen = []

    def by_round(model, inputs, labels, *, loss_fn, generator, round=None):
        seen.append(round)
        return clean_gradients(model, inputs, labels, loss_fn)

    def plain(model, inputs, labels, *, loss_fn, generator):
        return clean_gradients(model, inputs, labels, loss_fn)

    call_defense(FunctionDefense(by_round), model, x, y, round=4)
    call_defense(by_round, model, x, y, round=5)  # a bare callable too
    call_defense(FunctionDefense(by_round), model, x, y)
    assert seen == [4, 5, None]
    assert not FunctionDefense(plain).accepts_round and FunctionDefense(by_round).accepts_round
    call_defense(FunctionDefense(plain), model, x, y, round=3)  # no round keyword: not passed
    assert build_defense("censor").accepts_round and not build_defense("prune").accepts_round


def test_censor_defends_only_its_active_rounds():
    model, (x, y) = mlp(), batch(2)
    clean = clean_gradients(model, x, y)
    defense = build_defense("censor", trials=4, active_rounds=2)
    gen = torch.Generator().manual_seed(0)
    for round in (None, 0, 1, 2, 7):
        shared = call_defense(defense, model, x, y, generator=gen, round=round)
        defended = round is None or round < 2
        assert all(abs(cos(s, c)) < 1e-5 for s, c in zip(shared, clean)) == defended, round
        assert all(torch.equal(s, c) for s, c in zip(shared, clean)) == (not defended), round
    always = build_defense("censor", trials=4)
    assert abs(cos(call_defense(always, model, x, y, generator=gen, round=1000)[0], clean[0])) < 1e-5
    with pytest.raises(ConfigError, match=r"censor: active_rounds must be in \[1, inf\]"):
        build_defense("censor", active_rounds=0)


def test_the_client_simulation_passes_the_round():
    from audit.client.fl import train
    from audit.client.observe import observe
    from audit.core.data import load_dataset

    seen = []

    def record(model, inputs, labels, *, loss_fn, generator, round=None):
        seen.append(round)
        return clean_gradients(model, inputs, labels, loss_fn)

    data = load_dataset("embedded", size=8)
    model = build_model("mlp", data.input_shape, data.num_classes, hidden=(8,))
    train(model, data, record, 3, lr=0.1, batch_size=2, clients=2)
    assert seen == [0, 0, 1, 1, 2, 2]
    seen.clear()
    observe(model, data.test_images[:1], data.test_labels[:1], defense=record, step=20, local_steps=2)
    assert seen == [20, 20]
    censor = build_defense("censor", trials=2, active_rounds=5)
    x, y = data.test_images[:1], data.test_labels[:1]
    clean = clean_gradients(model, x, y)
    late = observe(model, x, y, defense=censor, step=5).gradients
    early = observe(model, x, y, defense=censor, step=4).gradients
    assert all(torch.allclose(s, c) for s, c in zip(late, clean))
    assert abs(cos(early[0], clean[0])) < 1e-5


# --------------------------------------------------------------------------- declared differences
def test_every_defense_declares_its_differences_as_sentences():
    documented = {"ats", "censor", "dp-sgd", "flower-fixedclipping", "flower-localdp", "refiner", "svdefense"}
    for name in ALL:
        differences = DEFENSES.get(name).differences
        assert isinstance(differences, tuple) and all(isinstance(d, str) and d.endswith(".") for d in differences)
        assert bool(differences) == (name in documented), name

    def mine(model, inputs, labels, *, loss_fn, generator):
        return clean_gradients(model, inputs, labels, loss_fn)

    readme = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs", "reference.md"), encoding="utf-8").read()
    section = readme.split("## Where our reference defenses differ from the papers", 1)[1].split("\n## ", 1)[0]
    listed = [line.strip()[2:] for line in section.splitlines() if line.startswith("  - ")]
    assert listed == [d for name in ALL for d in DEFENSES.get(name).differences]

    mine.differences = ["Not the paper's algorithm."]
    assert FunctionDefense(mine).differences == ("Not the paper's algorithm.",)


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


@pytest.mark.parametrize("name", [n for n in ALL if n != "decoy"])  # a decoy ignores its inputs: below
def test_defense_is_differentiable_wrt_the_inputs(name, evaluator):
    x, y = batch(2)
    defense = build_defense(name, **small_params(name, evaluator))
    model = defense.wrap_model(mlp())
    dummy = x.clone().requires_grad_(True)
    shared = defense(model, dummy, y, generator=torch.Generator().manual_seed(0))
    (grad,) = torch.autograd.grad(sum((g ** 2).sum() for g in shared), dummy)
    assert torch.isfinite(grad).all() and float(grad.abs().sum()) > 0


@pytest.mark.parametrize("kind", ["flat", "texture"])
def test_a_decoy_shares_the_same_gradient_whatever_the_private_images(kind):
    x, y = batch(2)
    defense, model = build_defense("decoy", kind=kind), mlp()
    a = defense(model, x, y, generator=torch.Generator().manual_seed(0))
    b = defense(model, torch.rand_like(x), y, generator=torch.Generator().manual_seed(1))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    other_labels = defense(model, x, (y + 1) % 10, generator=torch.Generator().manual_seed(0))
    assert not all(torch.equal(u, v) for u, v in zip(a, other_labels))  # the true labels are used
