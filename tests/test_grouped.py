"""Grouped execution: every private batch of one (step, attack) in one batched computation
gives the per-image results of one-at-a-time runs; attacks that cannot group say why."""
import pytest
import torch

import adaptive  # noqa: F401  (registers the adaptive attacks)
import audit
from attacks import ATTACKS, observe
from attacks.simulator import ClientReplica
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.engine.audit import Audit
from defenses import build_defense
from audit.report.reasons import word

SHAPE = (3, 8, 8)


def _observations(defense, **settings):
    model = build_model("cnn", SHAPE, 4, seed=0)
    x = torch.rand(3, *SHAPE, generator=torch.Generator().manual_seed(0))
    defense = build_defense(defense, **settings)
    return [observe(model, x[i:i + 1], torch.tensor([i % 4]), defense, seed=i) for i in range(3)], x


@pytest.fixture(scope="module")
def observations():
    return _observations("prune", ratio=0.9)


def _close_in_quality(a, b, truth):
    """The same image to a few grey levels, or the same quality: signed Adam follows the sign of
    gradients whose last bits differ with the summation order, and a replayed top-k mask can
    flip where round-off crosses its threshold."""
    if torch.allclose(a, b, atol=2e-2, rtol=0):
        return True
    pa, pb = float(psnr(a, truth)), float(psnr(b, truth))
    return abs(pa - pb) < 1.0 or min(pa, pb) > 40


@pytest.mark.parametrize("name, settings", [("ig", {}), ("ig", {"restarts": 2}), ("through-defense", {}),
                                            ("mask-replay", {}), ("portfolio", {}), ("censor-invariants", {}),
                                            ("layer-drop", {"layers": "search"})])
def test_grouped_run_matches_one_at_a_time(observations, name, settings, one_thread):
    obs, x = observations
    attack = ATTACKS.build(name, **settings)
    budget = 8 if name == "layer-drop" else 24  # the search runs once per weight tensor
    one = [attack.reconstruct(o, budget, seed) for seed, o in enumerate(obs)]
    many = attack.reconstruct_many(obs, budget, [0, 1, 2])
    for i, (a, b) in enumerate(zip(one, many)):
        assert b.trace["grouped"]["code"].startswith("grouped"), b.trace["grouped"]
        assert "batched (vmap over 3 observations" in word(b.trace["execution"]) or name == "portfolio"
        assert a.trace["iterations"] == b.trace["iterations"] and torch.equal(a.labels, b.labels)
        if name == "ig":  # smooth objective: the same trajectory up to float summation order
            assert a.trace["chosen_restart"] == b.trace["chosen_restart"]
            torch.testing.assert_close(a.inputs, b.inputs, atol=1e-4, rtol=0)
        else:
            assert _close_in_quality(a.inputs, b.inputs, x[i:i + 1])
        if name == "portfolio":  # the same candidates, scored the same, the same pick
            assert a.trace["chosen_strategy"] == b.trace["chosen_strategy"]
            assert [c["strategy"] for c in a.trace["candidates"]] == [c["strategy"] for c in b.trace["candidates"]]
            for ca, cb in zip(a.trace["candidates"], b.trace["candidates"]):
                assert abs(ca["match"] - cb["match"]) < 1e-3


def test_portfolio_group_calls_the_model_per_strategy_not_per_image(observations, one_thread):
    """The launch proxy: a grouped portfolio calls the model as often for 3 images as for 1."""
    obs, _ = observations
    calls = []
    replica_forward = ClientReplica.forward

    def counted(self, params, x):
        calls.append(1)
        return replica_forward(self, params, x)

    attack = ATTACKS.build("portfolio", strategies="smooth,sharp")
    ClientReplica.forward = counted
    try:
        attack.reconstruct_many(obs[:1], 24, [0])
        single, calls[:] = len(calls), []
        attack.reconstruct_many(obs, 24, [0, 1, 2])
        grouped = len(calls)
    finally:
        ClientReplica.forward = replica_forward
    assert single > 10 and grouped <= single * 1.1, (single, grouped)


def test_bayes_optimal_groups_with_one_prior_weight(one_thread):
    """The prior weight is probed on the defense, not the image: one attack for the group."""
    obs, x = _observations("gaussian", sigma=0.01)
    attack = ATTACKS.build("bayes-optimal")
    one = [attack.reconstruct(o, 12, s) for s, o in enumerate(obs)]
    many = attack.reconstruct_many(obs, 12, [0, 1, 2])
    for i, (a, b) in enumerate(zip(one, many)):
        assert word(b.trace["execution"]).startswith("batched (vmap over 3 observations"), word(b.trace["execution"])
        assert a.trace["beta"] == b.trace["beta"] and a.trace["likelihood"] == b.trace["likelihood"]
        assert _close_in_quality(a.inputs, b.inputs, x[i:i + 1])


def test_svd_subspace_groups_with_each_observations_own_subspaces(one_thread):
    """Each member projects on the subspaces of its own observed gradient (read in the program)."""
    obs, x = _observations("svdefense")
    attack = ATTACKS.build("svd-subspace")
    one = [attack.reconstruct(o, 16, s) for s, o in enumerate(obs)]
    many = attack.reconstruct_many(obs, 16, [0, 1, 2])
    for i, (a, b) in enumerate(zip(one, many)):
        assert word(b.trace["execution"]).startswith("batched (vmap over 3 observations"), word(b.trace["execution"])
        assert _close_in_quality(a.inputs, b.inputs, x[i:i + 1])
    # a member handed another observation's subspaces matches worse: the data is per member
    swapped = attack.reconstruct_many([obs[1]], 16, [0])[0]
    assert not torch.allclose(swapped.inputs, one[0].inputs)


@pytest.mark.parametrize("defense, settings, execution", [
    ("gaussian", {"sigma": 0.01}, "batched (vmap over 3 observations"),  # draws inside the vmapped program
    ("censor", {}, "stacked (one call of the defense over 3 member(s)"),  # the defense's own Defense.many
    ("soteria", {}, "stacked (one call of the defense over 3 member(s)")])
def test_eot_groups_its_draws(defense, settings, execution, one_thread):
    """EOT over a stochastic defense: every image x draw of the group in one program (a defense
    that draws through the shared helpers) or one batched defense call per evaluation (a defense
    that computes its own gradient); the same numbers for the same seed, the same quality as one
    image at a time."""
    obs, x = _observations(defense, **settings)
    attack = ATTACKS.build("through-defense", samples=2)
    budget = 12 if defense == "gaussian" else 6  # a call of CENSOR or Soteria costs tens of gradients
    many = attack.reconstruct_many(obs, budget, [0, 1, 2])
    again = attack.reconstruct_many(obs, budget, [0, 1, 2])
    one = [attack.reconstruct(o, budget, s) for s, o in enumerate(obs)]
    for b, c in zip(many, again):
        assert word(b.trace["execution"]).startswith(execution), word(b.trace["execution"])
        assert word(b.trace["grouped"]).startswith("one batched run over 3")
        assert torch.equal(b.inputs, c.inputs)
    mean = lambda recs: sum(float(psnr(r.inputs, x[i:i + 1])) for i, r in enumerate(recs)) / 3  # noqa: E731
    assert abs(mean(one) - mean(many)) < 1.0  # other draws of the defense's randomness, the same quality


def test_attacks_that_cannot_group_say_why(observations, one_thread):
    obs, _ = observations
    other = build_model("cnn", SHAPE, 4, seed=1)  # another model: not one batched run
    mixed = obs[:1] + [observe(other, torch.rand(1, *SHAPE, generator=torch.Generator().manual_seed(5)),
                               torch.tensor([1]), build_defense("prune", ratio=0.9), seed=1)]
    for name in ("ig", "portfolio"):
        recs = ATTACKS.build(name).reconstruct_many(mixed, 6, [0, 1])
        assert all(r.trace["grouped"]["code"] == "not-grouped" and "differ" in word(r.trace["grouped"]) for r in recs)


def test_audit_groups_the_images_of_a_step(tmp_path, monkeypatch, one_thread):
    kwargs = dict(defense="prune", steps=[0], attacks=["ig", "mask-replay"], images=3, model="cnn",
                  image_size=8, budget=12, utility=False, progress=False)
    grouped = audit.run(out=tmp_path / "grouped", **kwargs)
    traces = {(r["attack_id"], r["image"]): r["trace"] for r in grouped.data["results"]}
    assert word(traces[("ig", 0)]["grouped"]).startswith("one batched run over 3")
    assert word(traces[("mask-replay", 0)]["grouped"]).startswith("one batched run over 3")
    original = Audit.__init__

    def ungrouped(self, *args, **kw):
        original(self, *args, **kw)
        self.max_members = 1

    monkeypatch.setattr(Audit, "__init__", ungrouped)
    single = audit.run(out=tmp_path / "single", **kwargs)
    for a, b in zip(grouped.data["results"], single.data["results"]):
        assert (a["attack_id"], a["image"]) == (b["attack_id"], b["image"])
        assert abs(a["metrics"]["psnr"] - b["metrics"]["psnr"]) < 0.1


def test_observed_masks_are_the_targets_nonzeros():
    """masks='observed' reads each target's mask in the objective: the same loss as the masks
    given explicitly, and another target gives another mask."""
    from attacks.objectives import OBJECTIVES

    gen = torch.Generator().manual_seed(0)
    dummy = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    target = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)]
    target[0][target[0].abs() < 0.8] = 0
    for name in ("l2", "cosine"):
        given = OBJECTIVES.build(name, masks=[(t != 0) for t in target])(dummy, target)
        observed = OBJECTIVES.build(name, masks="observed")(dummy, target)
        assert torch.equal(given, observed)
        assert not torch.equal(OBJECTIVES.build(name)(dummy, target), observed)


def test_observed_masks_bound_to_a_group_mask_the_layers_with_zeros_in_any_target():
    """Bound to a group, masks='observed' masks only the layers where some target has an exact
    zero, and still gives each target the loss of its own explicit mask."""
    from types import SimpleNamespace

    from attacks.objectives import OBJECTIVES

    gen = torch.Generator().manual_seed(1)
    dummy = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen), torch.randn(2, generator=gen)]
    first = [torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen), torch.randn(2, generator=gen)]
    second = [t.clone() for t in first]
    first[0][first[0].abs() < 0.8] = 0
    second[1][second[1].abs() < 0.8] = 0
    group = [SimpleNamespace(gradients=first), SimpleNamespace(gradients=second)]
    for name in ("l2", "l1", "cosine"):
        bound = OBJECTIVES.build(name, masks="observed").bind_group(group)
        assert bound.zero_layers == (0, 1)
        for target in (first, second):
            given = OBJECTIVES.build(name, masks=[(t != 0) for t in target])(dummy, target)
            assert torch.allclose(bound(dummy, target), given, rtol=1e-6, atol=0)
    scaled = OBJECTIVES.build("gaussian", sigma=0.5, masks="observed").bind_group(group)
    assert scaled.distance.zero_layers == (0, 1)
