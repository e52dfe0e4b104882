"""The learned inverter: projection, cache, auxiliary data, and the headline
outcome -- trained on the embedded *train* split, it beats an untrained inverter and plain
IG on held-out *test* images under a defense that defeats IG (99% magnitude pruning)."""
from types import SimpleNamespace

import pytest
import torch

from adaptive.inverter import pairs
from adaptive.inverter.pairs import defended_features, pair_indices
from adaptive.inverter.sketch import GradientSketch
from adaptive.inverter.attack import LearnedInverter, applies
from attacks import ATTACKS
from audit.core.data import load_dataset
from audit.core.errors import ConfigError, DataError
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.client.observe import observe
from audit.core.types import FunctionDefense
from audit.report.reasons import word
from defenses import build_defense

SMALL = dict(pairs=64, hidden=32, batch_size=16, train_steps=3, progress=False)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GIA_AUDIT_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def data():
    return load_dataset("embedded", size=16)


@pytest.fixture(scope="module")
def lenet(data):
    return build_model("lenet", data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=0)


def _held_out(data, i):
    idx = 37 * i
    return data.test_images[idx:idx + 1], data.test_labels[idx:idx + 1]


def _entries(tmp_root):
    return sorted((tmp_root / "learned-inverter").glob("*.pt"))


# --------------------------------------------------------------------------- components
def test_sketch_is_seeded_and_nearly_preserves_norms():
    v = torch.randn(16, 5000, generator=torch.Generator().manual_seed(0))
    a, b = GradientSketch(5000, 512, seed=3), GradientSketch(5000, 512, seed=3)
    assert torch.equal(a(v), b(v)) and not torch.equal(a(v), GradientSketch(5000, 512, seed=4)(v))
    ratio = a(v).norm(dim=1) / v.norm(dim=1)
    assert 0.9 < float(ratio.mean()) < 1.1 and float(ratio.min()) > 0.8
    assert torch.equal(a(v[0]), a(v)[0])  # one gradient or a batch
    small = GradientSketch(300, 512)
    assert small.identity and small.out_dim == 300 and torch.equal(small(v[:, :300]), v[:, :300])
    with pytest.raises(ConfigError, match="retrain"):
        a(torch.zeros(4999))


# --------------------------------------------------------------------------- the headline outcome
def test_trained_inverter_beats_untrained_and_ig_under_heavy_pruning(lenet, data):
    defense = build_defense("prune", ratio=0.99)
    inverter = LearnedInverter(pairs=512, hidden=256, train_steps=200, progress=False)
    untrained = LearnedInverter(pairs=512, hidden=256, train_steps=0, progress=False)
    scores = {"trained": [], "untrained": [], "ig": []}
    for i in range(4):
        x, y = _held_out(data, i)
        obs = observe(lenet, x, y, defense, seed=i)
        scores["trained"].append(float(psnr(inverter.reconstruct(obs, 200).inputs, x)))
        scores["untrained"].append(float(psnr(untrained.reconstruct(obs, 200).inputs, x)))
        scores["ig"].append(float(psnr(ATTACKS.build("ig").reconstruct(obs, 200, 0).inputs, x)))
    mean = {k: sum(v) / len(v) for k, v in scores.items()}
    assert mean["trained"] > mean["untrained"] + 3, mean
    assert mean["trained"] > mean["ig"] + 3, mean


# --------------------------------------------------------------------------- the cache
def test_cache_is_reused_per_step_and_defense(lenet, data, tmp_path):
    x, y = _held_out(data, 0)
    defense = build_defense("quantize", bits=1)
    inverter = ATTACKS.build("learned-inverter", **SMALL)
    first = inverter.reconstruct(observe(lenet, x, y, defense), 5, seed=1)
    assert first.trace["inverter"]["cache"] == "saved"
    # another image of the same step, another attack seed: the same inverter, loaded
    x2, y2 = _held_out(data, 1)
    second = inverter.reconstruct(observe(lenet, x2, y2, defense), 5, seed=7)
    assert second.trace["inverter"]["cache"] == "loaded"
    assert len(_entries(tmp_path / "cache")) == 1
    again = inverter.reconstruct(observe(lenet, x, y, defense), 5, seed=3)
    assert torch.equal(again.inputs, first.inputs)
    # the next training step (other parameters) and another defense setting each train anew
    later = build_model("lenet", data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=1)
    inverter.reconstruct(observe(later, x, y, defense), 5)
    inverter.reconstruct(observe(lenet, x, y, build_defense("quantize", bits=2)), 5)
    assert len(_entries(tmp_path / "cache")) == 3


def test_training_shows_a_progress_bar_or_reports_to_a_callback(lenet, data, capsys):
    x, y = _held_out(data, 0)
    inverter = LearnedInverter(**{**SMALL, "progress": True}, cache=False)
    inverter.reconstruct(observe(lenet, x, y), 3)
    assert "learned-inverter: training" in capsys.readouterr().err
    calls = []
    inverter.reconstruct(observe(lenet, x, y), 3, progress=lambda done, total, loss: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)] and "learned-inverter" not in capsys.readouterr().err


# --------------------------------------------------------------------------- auxiliary data
def test_declared_auxiliary_images_are_used_and_checked(lenet, data):
    x, y = _held_out(data, 0)
    aux = data.train_images[:40]
    obs = observe(lenet, x, y, extra={"aux_images": aux})
    rec = LearnedInverter(**SMALL).reconstruct(obs, 3)
    aux = word(rec.trace["inverter"]["aux"])
    assert aux.startswith("declared auxiliary images (40)"), aux
    assert "predicted by the audited model" in aux  # no labels declared
    assert rec.inputs.shape == x.shape and rec.labels.shape == (1,)
    bad = observe(lenet, x, y, extra={"aux_images": torch.rand(8, 3, 8, 8)})
    with pytest.raises(DataError, match="shape"):
        LearnedInverter(**SMALL).reconstruct(bad, 3)


def test_declared_auxiliary_data_is_hashed_once_and_keys_the_cache(lenet, data, monkeypatch):
    """The audit declares one auxiliary set on every observation: hashed once, one inverter."""
    import adaptive.inverter.cache as inverter_cache

    aux, aux_labels = data.train_images[:40].clone(), data.train_labels[:40].clone()
    hashed, real = [], inverter_cache.hash_tensors

    def counting(tensors, digest=None):
        tensors = list(tensors)
        hashed.extend(tuple(t.shape) for t in tensors)
        return real(tensors, digest)

    monkeypatch.setattr(inverter_cache, "hash_tensors", counting)
    inverter = LearnedInverter(**SMALL)

    def trace(i):
        x, y = _held_out(data, i)
        return inverter.reconstruct(observe(lenet, x, y, extra={"aux_images": aux, "aux_labels": aux_labels}),
                                    3).trace["inverter"]

    first, second = trace(0), trace(1)
    assert first["cache"] == "saved" and second["cache"] == "loaded"
    assert first["key"] == second["key"] and hashed.count(tuple(aux.shape)) == 1
    aux[0] = 1 - aux[0]  # changed in place: hashed again, another inverter
    third = trace(0)
    assert third["cache"] == "saved" and third["key"] != first["key"]
    assert hashed.count(tuple(aux.shape)) == 2


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="no setting"):
        ATTACKS.build("learned-inverter", width=3)
    with pytest.raises(ConfigError, match="pairs"):
        LearnedInverter(pairs=0)


def test_applies_to_every_perturbing_defense():
    flags = dict(identity=False, sign_only=True, quantized=True, sparse=False, sparsity=0.0, low_rank=False,
                 differentiable=True, stochastic=False, architectural=False)
    ok, why = applies(SimpleNamespace(**flags))
    assert ok and why.params["causes"] == ["sign-only"] and "only signs are shared" in word(why)
    assert not applies(SimpleNamespace(**{**flags, "identity": True}))[0]


def test_batched_pairs_match_the_client_round(lenet, data):
    """The vmapped path for gradient-transform defenses gives the numbers of the client's own
    calls (a plain callable: one call per batch)."""
    x, y = _held_out(data, 0)
    defense = build_defense("soft-prune", sigma=0.01)
    images, labels = data.train_images[:40], data.train_labels[:40]
    index = pair_indices(40, 12, 2, torch.Generator().manual_seed(0))
    sketch = GradientSketch(sum(p.numel() for p in lenet.parameters()), 512)
    made = {}
    for how, d in (("batched", defense), ("client", FunctionDefense(defense))):
        info = {}
        obs = observe(lenet, torch.cat([x, x]), torch.cat([y, y]), d)
        made[how] = defended_features(obs, images, labels, index, sketch, torch.Generator().manual_seed(5),
                                      progress=False, info=info)
        made[how + " path"] = info["pairs_path"]
    assert made["batched path"]["code"] == "pairs-vmap" and made["client path"]["code"] == "pairs-defense-many"
    assert torch.allclose(made["batched"], made["client"], rtol=1e-4, atol=1e-6)


def test_pairs_through_defense_many_match_the_client_rounds(lenet, data):
    """A defense with its own batched calls (CENSOR) makes the same pairs as one client round
    per batch, the generator drawn in the same order."""
    x, y = _held_out(data, 0)
    images, labels = data.train_images[:20], data.train_labels[:20]
    index = pair_indices(20, 5, 2, torch.Generator().manual_seed(0))
    obs = observe(lenet, torch.cat([x, x]), torch.cat([y, y]), build_defense("censor", trials=3))
    sketch = GradientSketch(sum(p.numel() for p in lenet.parameters()), 256)
    made = {}
    for how, run in (("many", pairs._many), ("client", pairs._per_batch)):
        out = torch.empty(len(index), sketch.out_dim)
        run(obs, images, labels, index, sketch, torch.Generator().manual_seed(5), out, SimpleNamespace(update=lambda n: None))
        made[how] = out
    assert torch.allclose(made["many"], made["client"], rtol=1e-4, atol=1e-6)
