"""Grouped execution: every private batch of one (step, attack) in one batched computation
gives the per-image results of one-at-a-time runs; attacks that cannot group say why."""
import pytest
import torch

import adaptive  # noqa: F401  (registers the adaptive attacks)
import audit
from attacks import ATTACKS, observe
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.engine.audit import Audit
from defenses import build_defense

SHAPE = (3, 8, 8)


@pytest.fixture(scope="module")
def observations():
    model = build_model("cnn", SHAPE, 4, seed=0)
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(3, *SHAPE, generator=gen)
    defense = build_defense("prune", ratio=0.9)
    return [observe(model, x[i:i + 1], torch.tensor([i % 4]), defense, seed=i) for i in range(3)], x


@pytest.mark.parametrize("name, settings", [("ig", {}), ("ig", {"restarts": 2}), ("through-defense", {})])
def test_grouped_run_matches_one_at_a_time(observations, name, settings, one_thread):
    obs, x = observations
    attack = ATTACKS.build(name, **settings)
    one = [attack.reconstruct(o, 24, seed) for seed, o in enumerate(obs)]
    many = attack.reconstruct_many(obs, 24, [0, 1, 2])
    for i, (a, b) in enumerate(zip(one, many)):
        assert b.trace["grouped"].startswith("one batched run over 3 observations")
        assert b.trace["execution"].startswith("batched (vmap over 3 observations")
        assert a.trace["iterations"] == b.trace["iterations"] and torch.equal(a.labels, b.labels)
        if name == "ig":  # smooth objective: the same trajectory up to float summation order
            assert a.trace["chosen_restart"] == b.trace["chosen_restart"]
            torch.testing.assert_close(a.inputs, b.inputs, atol=1e-4, rtol=0)
        else:  # the replayed top-k mask can flip where round-off crosses its threshold: the
            # same image to a few grey levels, the same quality
            torch.testing.assert_close(a.inputs, b.inputs, atol=2e-2, rtol=0)
            assert abs(float(psnr(a.inputs, x[i:i + 1])) - float(psnr(b.inputs, x[i:i + 1]))) < 1.0 or \
                min(float(psnr(a.inputs, x[i:i + 1])), float(psnr(b.inputs, x[i:i + 1]))) > 40


def test_attacks_that_cannot_group_say_why(observations, one_thread):
    obs, _ = observations
    masked = ATTACKS.build("mask-replay").reconstruct_many(obs, 6, [0, 1, 2])
    assert all(r.trace["grouped"].startswith("no: ") for r in masked)
    other = build_model("cnn", SHAPE, 4, seed=1)  # another model: not one batched run
    mixed = obs[:1] + [observe(other, torch.rand(1, *SHAPE, generator=torch.Generator().manual_seed(5)),
                               torch.tensor([1]), build_defense("prune", ratio=0.9), seed=1)]
    recs = ATTACKS.build("ig").reconstruct_many(mixed, 6, [0, 1])
    assert all("differ" in r.trace["grouped"] for r in recs)


def test_audit_groups_the_images_of_a_step(tmp_path, monkeypatch, one_thread):
    kwargs = dict(defense="prune", steps=[0], attacks=["ig", "mask-replay"], images=3, model="cnn",
                  image_size=8, budget=12, utility=False, progress=False)
    grouped = audit.run(out=tmp_path / "grouped", **kwargs)
    traces = {(r["attack_id"], r["image"]): r["trace"] for r in grouped.data["results"]}
    assert traces[("ig", 0)]["grouped"].startswith("one batched run over 3")
    assert traces[("mask-replay", 0)]["grouped"].startswith("no: ")
    original = Audit.__init__

    def ungrouped(self, *args, **kw):
        original(self, *args, **kw)
        self.max_members = 1

    monkeypatch.setattr(Audit, "__init__", ungrouped)
    single = audit.run(out=tmp_path / "single", **kwargs)
    for a, b in zip(grouped.data["results"], single.data["results"]):
        assert (a["attack_id"], a["image"]) == (b["attack_id"], b["image"])
        assert abs(a["metrics"]["psnr"] - b["metrics"]["psnr"]) < 0.1
