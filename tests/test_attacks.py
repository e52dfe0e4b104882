"""The optimisation attack: reconstruction quality, batched restarts, determinism, the simulator
hook, FedAvg unrolling, objectives, presets and the CLI."""
import json

import pytest
import torch
from click.testing import CliRunner

from attacks import ATTACKS, OBJECTIVES, OPTIMIZERS, GradientSimulator, OptimizationAttack, SimContext, observe
from attacks.simulator import DefenseSimulator
from audit.core.errors import ConfigError, NotApplicable
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.core.types import Observation, gradient_transform
from audit.report.reasons import word


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data32():
    from audit.core.data import load_dataset

    return load_dataset("embedded", size=32)


@pytest.fixture(scope="module")
def data16():
    from audit.core.data import load_dataset

    return load_dataset("embedded", size=16)


def _model(name, data, **kw):
    return build_model(name, data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=0, **kw)


def _obs(name, data, index=3, batch=1, model_kw=None, **kw):
    model = _model(name, data, **(model_kw or {}))
    return observe(model, data.train_images[index:index + batch], data.train_labels[index:index + batch], **kw)


def _psnr(rec, data, index=3, batch=1):
    return float(psnr(rec.inputs, data.train_images[index:index + batch]).mean())


# --------------------------------------------------------------------------- quality
def test_ig_reconstructs_an_embedded_image_from_a_convnet(data32):
    obs = _obs("convnet", data32, client_mode="eval")
    rec = ATTACKS.build("ig").reconstruct(obs, 300, 0)
    value = _psnr(rec, data32)
    print(f"IG ConvNet-16 32x32 batch 1 (eval-mode BN), 300 iterations: {value:.2f} dB")
    assert value >= 20.0
    assert rec.labels.tolist() == data32.train_labels[3:4].tolist()


@pytest.mark.parametrize("name", ["dlg", "idlg"])
def test_dlg_and_idlg_reconstruct_on_lenet(data16, name):
    obs = _obs("lenet", data16, index=200)
    rec = ATTACKS.build(name).reconstruct(obs, 1200, 0)  # 4 restarts x 300 evaluations
    value = _psnr(rec, data16, index=200)
    print(f"{name} LeNet 16x16 batch 1, 4 x 300 L-BFGS evaluations: {value:.2f} dB, "
          f"{rec.trace['evaluations']} evaluations")
    assert value >= 30.0
    assert rec.labels.tolist() == data16.train_labels[200:201].tolist()


# --------------------------------------------------------------------------- restarts and seeds
def test_same_seed_same_result(data16):
    obs = _obs("convnet", data16, model_kw={"width": 8})
    runs = [ATTACKS.build("ig", restarts=3).reconstruct(obs, 6, seed) for seed in (0, 0, 1)]
    assert word(runs[0].trace["execution"]).startswith("batched")
    assert torch.equal(runs[0].inputs, runs[1].inputs)
    assert runs[0].trace["loss_history"] == runs[1].trace["loss_history"]
    assert not torch.equal(runs[0].inputs, runs[2].inputs)


def test_batched_and_sequential_restarts_compute_the_same_loss_and_gradient(data16):
    obs = _obs("convnet", data16, batch=2, model_kw={"width": 8})
    images = torch.rand(3, 2, *data16.input_shape, generator=torch.Generator().manual_seed(0))
    images[0] = data16.train_images[3:5]
    out = {mode: ATTACKS.build("gi", restarts=3, execution=mode).evaluate(obs, images)
           for mode in ("batched", "sequential")}
    assert word(out["batched"]["execution"]).startswith("batched")
    assert word(out["sequential"]["execution"]).startswith("sequential")
    torch.testing.assert_close(out["batched"]["loss"], out["sequential"]["loss"], rtol=1e-4, atol=1e-6)
    batched, sequential = out["batched"]["grad"], out["sequential"]["grad"]
    assert float((batched - sequential).norm() / sequential.norm()) < 1e-4  # float32 summation order
    assert out["batched"]["terms"]["match"][0] < 1e-8  # the truth matches exactly (labels inferred)


def _has_cxx() -> bool:
    import os
    import shutil

    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++"))


@pytest.mark.skipif(not _has_cxx(), reason="checks a torch.compile'd attack against eager: torch.compile's CPU "
                    "backend needs a C++ compiler (g++, c++, clang++ or $CXX)")
def _conv_bn(data, seed):
    """One strided conv-BatchNorm-ReLU and a linear head: a train-mode graph small enough to compile fast."""
    torch.manual_seed(seed)
    c, h, w = data.input_shape
    return torch.nn.Sequential(torch.nn.Conv2d(c, 4, 3, 2, 1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * (h // 2) * (w // 2), data.num_classes))


def test_compiled_attack_matches_eager_and_compiles_once(data16):
    from torch._dynamo.utils import counters

    obs = observe(_conv_bn(data16, 0), data16.train_images[3:5], data16.train_labels[3:5], client_mode="train")
    images = torch.rand(1, 2, *data16.input_shape, generator=torch.Generator().manual_seed(0))  # one graph
    eager = ATTACKS.build("ig", tv=0.1).evaluate(obs, images)
    compiled = ATTACKS.build("ig", tv=0.1, compile=True).evaluate(obs, images)
    assert word(compiled["execution"]).startswith("compiled"), word(compiled["execution"])
    torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-4, atol=1e-6)
    assert float((compiled["grad"] - eager["grad"]).norm() / eager["grad"].norm()) < 1e-4
    # the step changes every iteration and the model every audited step: the compiled loss is
    # specialised on neither (it is reused, and it reads the new model's weights)
    before = counters["stats"]["unique_graphs"]
    rec = ATTACKS.build("ig", tv=0.1, compile=True).reconstruct(obs, 12, 0)
    assert rec.trace["iterations"] == 12 and word(rec.trace["execution"]).startswith("compiled")
    obs = observe(_conv_bn(data16, 1), data16.train_images[5:7], data16.train_labels[5:7], client_mode="train")
    eager = ATTACKS.build("ig", tv=0.1).evaluate(obs, images)
    compiled = ATTACKS.build("ig", tv=0.1, compile=True).evaluate(obs, images)
    torch.testing.assert_close(compiled["loss"], eager["loss"], rtol=1e-4, atol=1e-6)
    assert float((compiled["grad"] - eager["grad"]).norm() / eager["grad"].norm()) < 1e-4
    assert counters["stats"]["unique_graphs"] - before <= 1


def test_compile_failure_falls_back_to_the_batched_path(data16, monkeypatch):
    import attacks.optimization as optimization

    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("no C++ compiler found")
        return call

    monkeypatch.setattr(optimization.torch, "compile", broken)
    obs = _obs("convnet", data16, model_kw={"width": 8})
    rec = ATTACKS.build("ig", compile=True).reconstruct(obs, 5, 0)
    assert word(rec.trace["execution"]) == "batched (torch.compile failed: RuntimeError: no C++ compiler found)"
    assert rec.trace["iterations"] == 5
    gi = ATTACKS.build("gi", compile=True).reconstruct(obs, 2, 0)
    assert word(gi.trace["execution"]).endswith(
        "compile=true not used: the group-consistency prior changes with the step)")


def test_best_restart_is_chosen_by_the_attack_loss(data16):
    obs = _obs("lenet", data16)
    rec = ATTACKS.build("ig", restarts=4, tv=0.05, features=0).reconstruct(obs, 15, 0)
    final = rec.trace["final_losses"]
    assert len(final) == 4 and len(rec.trace["loss_history"]) == 4
    assert rec.trace["chosen_restart"] == min(range(4), key=final.__getitem__)
    terms = rec.trace["final_terms"]
    assert final[rec.trace["chosen_restart"]] == pytest.approx(terms["match"] + 0.05 * terms["tv"], rel=1e-5)
    assert "ground truth unused" in word(rec.trace["selection"])


def test_gi_runs_bn_and_group_priors_batched(data16):
    obs = _obs("convnet", data16, model_kw={"width": 8})
    rec = ATTACKS.build("gi", group_start=5).reconstruct(obs, 4 * 12, 0)  # 4 restarts x 12 iterations
    assert word(rec.trace["execution"]).startswith("batched")
    assert {"match", "tv", "l2", "bn", "group"} <= set(rec.trace["final_terms"])
    assert rec.trace["final_terms"]["group"] > 0
    history = rec.trace["loss_history"][rec.trace["chosen_restart"]]
    assert history[-1] < history[0]


def test_bn_prior_needs_batchnorm(data16):
    with pytest.raises(NotApplicable, match="prior-needs-running-statistics"):
        ATTACKS.build("gi").reconstruct(_obs("lenet", data16), 2, 0)


def test_observation_model_is_not_mutated(data16):
    obs = _obs("convnet", data16, model_kw={"width": 8})
    before = {k: v.clone() for k, v in obs.model.state_dict().items()}
    ATTACKS.build("ig", restarts=2).reconstruct(obs, 3, 0)
    for k, v in obs.model.state_dict().items():
        assert torch.equal(v, before[k]), k


# --------------------------------------------------------------------------- the simulator hook
def test_simulator_reproduces_fedavg_updates_on_both_paths(data16):
    obs = _obs("convnet", data16, batch=4, model_kw={"width": 8}, local_steps=3, local_lr=0.1,
               local_batch_size=2)
    x, y = data16.train_images[3:7], data16.train_labels[3:7]
    sim = GradientSimulator()
    replica, ctx = sim.prepare(obs), SimContext(obs)
    eager, _ = sim(replica, x, y, functional=False, context=ctx)
    batched, _ = torch.func.vmap(lambda xr: sim(replica, xr, y, functional=True, context=ctx))(x.expand(2, *x.shape))
    for e, b, g in zip(eager, batched, obs.gradients):
        torch.testing.assert_close(e, g)
        torch.testing.assert_close(b[1], g, atol=1e-5, rtol=1e-4)


def test_fedavg_attack_unrolls_local_steps(data16):
    obs = _obs("lenet", data16, local_steps=3, local_lr=0.1)
    rec = ATTACKS.build("ig", tv=0.01).reconstruct(obs, 40, 0)
    history = rec.trace["loss_history"][0]
    assert history[-1] < 0.5 * history[0]
    assert rec.labels.tolist() == data16.train_labels[3:4].tolist()


def _scale_half(grads, context):
    return [0.5 * g for g in grads]


def _not_vmappable(grads, context):
    if float(grads[0].detach().sum()) > 1e30:  # .item() on a batched tensor fails under vmap
        raise AssertionError
    return grads


def test_transforms_and_automatic_sequential_fallback(data16):
    obs = _obs("lenet", data16)
    obs.gradients = [0.5 * g for g in obs.gradients]  # e.g. a known deterministic defense
    sim = GradientSimulator([_scale_half])
    replica = sim.prepare(obs)
    x, y = data16.train_images[3:4], data16.train_labels[3:4]
    for a, b in zip(sim(replica, x, y, functional=True, context=SimContext(obs))[0], obs.gradients):
        torch.testing.assert_close(a, b)
    fallback = OptimizationAttack("cosine", [("tv", 0.01)], restarts=2,
                                  simulator=GradientSimulator([_scale_half, _not_vmappable]))
    rec = fallback.reconstruct(obs, 3, 0)
    assert word(rec.trace["execution"]).startswith("sequential (vmap failed")
    sequential = OptimizationAttack("cosine", [("tv", 0.01)], restarts=2, execution="sequential",
                                    simulator=GradientSimulator([_scale_half])).reconstruct(obs, 3, 0)
    torch.testing.assert_close(rec.inputs, sequential.inputs)


def test_defense_simulator_passes_the_dummy_through_the_defense(data16):
    @gradient_transform(name="double")
    def double(grads):
        return [2 * g for g in grads]

    obs = _obs("lenet", data16, defense=double)
    x, y = data16.train_images[3:4], data16.train_labels[3:4]
    sim = DefenseSimulator()
    grads, _ = sim(sim.prepare(obs), x.clone().requires_grad_(True), y, functional=False,
                   context=SimContext(obs, generator=torch.Generator().manual_seed(0)))
    for a, b in zip(grads, obs.gradients):
        torch.testing.assert_close(a, b)
    rec = ATTACKS.build("ig", restarts=2, simulator=sim).reconstruct(obs, 2, 0)
    # both restarts go through one batched call of the defense (Defense.many), with the same
    # images as the restarts run one after another
    assert word(rec.trace["execution"]).startswith("stacked (one call of the defense over 2 member(s)")
    one_by_one = ATTACKS.build("ig", restarts=2, simulator=sim, execution="sequential").reconstruct(obs, 2, 0)
    assert word(one_by_one.trace["execution"]).startswith("sequential")
    torch.testing.assert_close(rec.inputs, one_by_one.inputs, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------- objectives
def test_objectives_with_weights_masks_and_likelihoods():
    g = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    t = [torch.tensor([0.0, 2.0]), torch.tensor([[1.0]])]
    assert float(OBJECTIVES.build("l2")(g, t)) == 5.0
    assert float(OBJECTIVES.build("l1")(g, t)) == 3.0
    assert float(OBJECTIVES.build("l2", weights=[1.0, 0.0])(g, t)) == 1.0
    assert float(OBJECTIVES.build("l2", masks=[torch.tensor([0.0, 1.0]), None])(g, t)) == 4.0
    assert float(OBJECTIVES.build("cosine")(g, g)) == pytest.approx(0.0, abs=1e-6)
    assert float(OBJECTIVES.build("cosine")(g, [-x for x in g])) == pytest.approx(2.0)
    assert float(OBJECTIVES.build("gaussian", sigma=0.5)(g, t)) == pytest.approx(5.0 / (2 * 0.25))
    assert float(OBJECTIVES.build("laplacian", b=0.5)(g, t)) == pytest.approx(6.0)


def test_defense_likelihood_objective(data16):
    obs = _obs("lenet", data16)
    with pytest.raises(NotApplicable, match="objective-needs-log-prob"):
        OBJECTIVES.build("defense").bind(obs)

    class Gaussian:
        name = "gauss"

        @staticmethod
        def log_prob(shared, clean):
            return -sum(((s - c) ** 2).sum() for s, c in zip(shared, clean)) / 2

    obs.defense = Gaussian()
    bound = OBJECTIVES.build("defense").bind(obs)
    assert float(bound([torch.ones(2)], [torch.zeros(2)])) == pytest.approx(1.0)


def test_batched_lbfgs_minimises_each_restart_independently():
    target = torch.tensor([[1.0, -2.0], [3.0, 0.5], [0.0, 0.0]])
    scales = torch.tensor([[1.0, 10.0], [100.0, 1.0], [1.0, 1.0]])

    def closure(variables):
        (z,) = variables
        return (scales * (z - target) ** 2).sum(1), [2 * scales * (z - target)]

    for name in ("lbfgs", "adam"):
        opt = OPTIMIZERS.build(name, lr=1.0 if name == "lbfgs" else 0.1, schedule="constant")
        z = [torch.zeros(3, 2)]
        opt.start(z, 200)
        for it in range(200 if name == "adam" else 20):
            opt.step(z, closure, it)
        torch.testing.assert_close(z[0], target, atol=1e-2, rtol=0)


# --------------------------------------------------------------------------- presets and errors
def test_presets_and_settings():
    assert {"dlg", "idlg", "ig", "gi", "bayes-l2", "bayes-l1", "bayes-cos", "analytic"} <= set(ATTACKS.names())
    attack = ATTACKS.build("ig", restarts=4, tv=1e-3)
    described = attack.describe()
    assert described["restarts"] == 4 and described["priors"]["tv"] == 1e-3
    assert described["priors"]["features"].startswith("auto") and set(described["priors"]) == {"tv", "features"}
    assert set(ATTACKS.build("ig", features=0).describe()["priors"]) == {"tv"}  # 0: no term
    assert described["objective"] == "cosine" and described["optimizer"] == "adam"
    assert ATTACKS.build("bayes-l1").describe()["objective"] == "l1"
    with pytest.raises(ConfigError, match="valid parameters"):
        ATTACKS.build("ig", total_variation=1e-3)
    with pytest.raises(ConfigError, match="sigma= does not apply"):
        ATTACKS.build("ig", sigma=0.1)
    with pytest.raises(ConfigError, match="signed"):
        ATTACKS.build("dlg", signed=True)
    # a preset's own optimiser settings give way when the user swaps the optimiser; the user's do not
    assert ATTACKS.build("dlg", optimizer="adam").describe()["optimizer"] == "adam"
    assert ATTACKS.build("ig", optimizer="lbfgs").describe()["optimizer"] == "lbfgs"
    with pytest.raises(ConfigError, match="history=50 applies to the lbfgs optimizer only"):
        ATTACKS.build("dlg", optimizer="adam", history=50)
    with pytest.raises(ConfigError, match="signed=True applies to the adam optimizer only"):
        ATTACKS.build("ig", optimizer="lbfgs", signed=True)
    assert repr(ATTACKS.build("ig", objective="gaussian", sigma=0.1).objective) == "gaussian(sigma=0.1)"


def test_inconsistent_observations_are_rejected(data16):
    obs = _obs("lenet", data16)
    bad = Observation(obs.model, obs.gradients[:-1], obs.input_shape, obs.num_classes)
    with pytest.raises(ConfigError, match="one tensor per parameter"):
        ATTACKS.build("ig").reconstruct(bad, 1, 0)
    with pytest.raises(ConfigError, match="mask 0 has shape"):
        ATTACKS.build("ig", masks=[torch.ones(3)] + [None] * (len(obs.gradients) - 1)).reconstruct(obs, 1, 0)


def test_progress_callback():
    model = build_model("lenet", (1, 8, 8), 3)
    obs = observe(model, torch.rand(1, 1, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([2]))
    calls = []
    ATTACKS.build("ig").reconstruct(obs, 4, 0, progress=lambda done, total, loss: calls.append((done, total)))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]


# --------------------------------------------------------------------------- CLI
def test_cli_attack_writes_images_and_metrics(tmp_path):
    from cli import main

    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["attack", "--attack", "ig", "--model", "lenet", "--size", "16",
                                       "--index", "3", "--attack-budget", "5", "--restarts", "2", "--quiet",
                                       "--attack-arg", "ig.tv=0.01", "--defense", "none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "psnr" in result.output
    for name in ("original.png", "reconstruction.png", "comparison.png", "metrics.json", "trace.json"):
        assert (out / name).is_file(), name
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["scores"]["psnr"]["value"] > 0 and metrics["trace"]["restarts"] == 2
    assert metrics["threat_model"]["labels_shared"] is False

    bad = CliRunner().invoke(main, ["attack", "--attack", "ig", "--attack-arg", "ig.tvv=1", "--out", str(out)])
    assert bad.exit_code == 2 and "valid parameters" in bad.output and "Traceback" not in bad.output
    for arg, words in (("dlg.lr=0.5", "--attack-arg sets dlg, not the attack 'ig'"), ("tv=0.01", "attack.setting=value")):
        other = CliRunner().invoke(main, ["attack", "--attack", "ig", "--attack-arg", arg, "--out", str(out)])
        assert other.exit_code == 2 and words in other.output and "Traceback" not in other.output, other.output


def test_cli_attack_on_an_image_file(tmp_path, data16):
    from PIL import Image

    from cli import main

    path = tmp_path / "private.png"
    Image.fromarray((data16.train_images[3].permute(1, 2, 0).numpy() * 255).round().astype("uint8")).save(path)
    out = tmp_path / "img"
    result = CliRunner().invoke(main, ["attack", "--attack", "analytic", "--model", "mlp", "--model-arg",
                                       "hidden=32", "--size", "16", "--image", str(path), "--label", "4",
                                       "--defense", "none", "--quiet", "--out", str(out)])
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["scores"]["psnr"]["value"] > 40  # 8-bit PNG, exact inversion
    assert metrics["recovered_labels"] == [4] and metrics["image"] == str(path)


def test_compiled_kernels_are_cached_apart_per_cpu_kernel_set(tmp_path, monkeypatch):
    """Inductor does not key its cached C++ by the kernel set: code generated with vector
    instructions, built under ``ATEN_CPU_CAPABILITY=default``, fails to build. Each set gets its folder."""
    import os
    import subprocess
    import sys

    from attacks import kernel_cache

    probe = "from attacks.kernel_cache import kernel_cache; print(kernel_cache())"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    generic = subprocess.run([sys.executable, "-c", probe], env={**env, "ATEN_CPU_CAPABILITY": "default"},
                             capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.dirname(__file__))).stdout.strip()
    monkeypatch.setattr(kernel_cache, "USERS", None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    here = kernel_cache.kernel_cache()
    assert os.path.basename(generic) == "default" and os.path.dirname(here) == os.path.dirname(generic)
    assert os.path.basename(here) == torch.backends.cpu.get_cpu_capability().lower()
    monkeypatch.setattr(kernel_cache, "USERS", str(tmp_path))  # the user's own folder is kept
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert kernel_cache.kernel_cache() == str(tmp_path)
