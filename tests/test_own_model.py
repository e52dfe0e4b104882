"""Auditing a user's own model: by ``package.module:attr`` (factories defined here), its input
normalisation, a checkpoint, the client's BatchNorm mode, and the one-line errors that come
before any work. Data: a tiny CIFAR-10-format folder written on the fly."""
import json
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import audit
import cli
from audit.core.errors import ConfigError
from audit.core.model_source import build_audited_model, load_state
from audit.core.models import Normalize
from audit.core.reasons import Reason
from audit.core.preflight import ModelUse, check_model
from audit.engine.audit import Audit, audit_settings, planner_model
from audit.engine.settings import ModelSettings
from audit.engine.utility import measure_utility
from audit.report.reasons import word

pytestmark = pytest.mark.usefixtures("one_thread")

CALLS = []
FAST = dict(image_size=16, budget=5, utility=False, progress=False, images=1)


# --------------------------------------------------------------------------- the user's code
def small_net(num_classes, input_shape, width=4):
    """A factory naming both keywords: conv-BN-ReLU, a 4x4 pool, a linear head."""
    CALLS.append({"num_classes": num_classes, "input_shape": input_shape, "width": width})
    c = input_shape[0]
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(16 * width, num_classes))


def pooled_net(**kwargs):
    """ImageNet-style ending: global pooling then BatchNorm1d, so train mode needs batch >= 2."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.BatchNorm1d(8), nn.Linear(8, kwargs["num_classes"]))


def linear_net(num_classes):
    """An MLP whose first layer is linear: analytic inversion recovers its input exactly."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.ReLU(), nn.Linear(32, num_classes))


def no_kwargs_net():
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))


def seven_classes(num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 7))


def frozen_net(num_classes):
    return linear_net(num_classes).requires_grad_(False)


def raising_net(num_classes):
    raise RuntimeError("out of coffee")


def not_a_module(num_classes):
    return [nn.Linear(3, num_classes)]


SHARED_NET = linear_net(10)


# --------------------------------------------------------------------------- data
def write_cifar(folder, per_split=24, seed=0):
    """CIFAR-10 python pickles (bytes keys, protocol 2, as the real files): every image a
    smooth colour ramp whose direction depends on its class."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, 32)

    def batch(n):
        labels = rng.integers(0, 10, n)
        images = []
        for y in labels:
            grid = np.outer(ramp, np.ones(32)) if y % 2 else np.outer(np.ones(32), ramp)
            colour = rng.uniform(0.2, 1.0, (3, 1, 1)) * (1 + y) / 10
            images.append((255 * np.clip(colour * grid + 0.1 * rng.random((3, 32, 32)), 0, 1)).astype(np.uint8))
        return {b"data": np.stack(images).reshape(n, -1), b"labels": [int(y) for y in labels]}

    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as fh:
            pickle.dump(batch(per_split), fh, protocol=2)
    return folder


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    return str(write_cifar(tmp_path_factory.mktemp("cifar") / "cifar-10-batches-py"))


def cifar_run(cifar, **kw):
    return {**FAST, "data": "cifar10", "data_args": {"path": cifar}, **kw}


# --------------------------------------------------------------------------- models by path
def test_a_factory_by_path_gets_classes_shape_and_model_args():
    CALLS.clear()
    model = build_audited_model(f"{__name__}:small_net", {"width": 6}, (3, 16, 16), 5, mean=(0.5,) * 3,
                                std=(0.25,) * 3, normalize="none")
    assert CALLS == [{"num_classes": 5, "input_shape": (3, 16, 16), "width": 6}]
    assert model(torch.rand(2, 3, 16, 16)).shape == (2, 5)
    # a factory without those parameters is called without them
    assert isinstance(build_audited_model(f"{__name__}:no_kwargs_net", {}, (3, 16, 16), 10, mean=(0.5,) * 3,
                                          std=(0.25,) * 3)[1], nn.Sequential)


def test_the_same_seed_builds_the_same_weights_and_another_seed_others():
    def build(seed):
        return build_audited_model(f"{__name__}:linear_net", {}, (3, 16, 16), 10, mean=(0.5,) * 3,
                                   std=(0.25,) * 3, seed=seed)

    a, b, c = build(3), build(3), build(4)
    assert torch.equal(a[1][1].weight, b[1][1].weight) and not torch.equal(a[1][1].weight, c[1][1].weight)


@pytest.mark.parametrize("side", [32, 64])
def test_torchvision_resnet18_by_path_runs_at_batch_2_in_train_mode(side):
    model = build_audited_model("torchvision.models:resnet18", {}, (3, side, side), 10, mean=(0.5,) * 3,
                                std=(0.25,) * 3)
    check_model(model, (3, side, side), 10, [ModelUse(2, "train", "the client's update", "--batch-size")],
                "'torchvision.models:resnet18'")
    assert model(torch.rand(2, 3, side, side)).shape == (2, 10)


def test_torchvision_resnet18_at_batch_1_in_train_mode_names_the_remedies():
    model = build_audited_model("torchvision.models:resnet18", {}, (3, 32, 32), 10, mean=(0.5,) * 3,
                                std=(0.25,) * 3)
    with pytest.raises(ConfigError) as err:
        check_model(model, (3, 32, 32), 10, [ModelUse(1, "train", "the client's update", "--batch-size",
                                                      "--client-mode eval")], "'torchvision.models:resnet18'")
    message = str(err.value)
    assert "\n" not in message and "more than one value per channel" in message
    assert "--batch-size" in message and "--client-mode eval" in message and "CIFAR-style" in message
    # in eval mode (running statistics) the same batch runs
    check_model(model, (3, 32, 32), 10, [ModelUse(1, "eval", "the client's update", "--batch-size")], "r")


# --------------------------------------------------------------------------- normalisation
def test_normalisation_wraps_a_factory_and_leaves_a_built_module_as_given():
    mean, std = (0.4, 0.5, 0.6), (0.2, 0.25, 0.3)
    wrapped = build_audited_model(f"{__name__}:linear_net", {}, (3, 16, 16), 10, mean=mean, std=std)
    assert isinstance(wrapped[0], Normalize) and wrapped[0].mean.flatten().tolist() == pytest.approx(mean)
    x = torch.rand(2, 3, 16, 16)
    assert torch.allclose(wrapped(x), wrapped[1]((x - torch.tensor(mean).view(1, 3, 1, 1))
                                                 / torch.tensor(std).view(1, 3, 1, 1)), atol=1e-6)
    given = build_audited_model(f"{__name__}:linear_net", {}, (3, 16, 16), 10, mean=mean, std=std,
                                normalize="0.5,0.5,0.5/0.1,0.1,0.1")
    assert given[0].std.flatten().tolist() == pytest.approx([0.1] * 3)
    plain = build_audited_model(f"{__name__}:linear_net", {}, (3, 16, 16), 10, mean=mean, std=std, normalize="none")
    assert not any(isinstance(m, Normalize) for m in plain.modules())
    module = build_audited_model(SHARED_NET, {}, (3, 16, 16), 10, mean=mean, std=std)
    assert not any(isinstance(m, Normalize) for m in module.modules()) and module is not SHARED_NET
    with pytest.raises(ConfigError, match="one mean and one std per channel"):
        build_audited_model(f"{__name__}:linear_net", {}, (3, 16, 16), 10, mean=mean, std=std, normalize=((0.5,), (0.2,)))
    with pytest.raises(ConfigError, match="'data'.*'none'"):
        ModelSettings("cnn", normalize="imagenet")


def test_attacks_see_the_normalised_model_and_are_scored_in_pixel_space(tmp_path, cifar):
    """Analytic inversion through the user's normalisation recovers the private pixels exactly:
    the reconstruction comes back in [0, 1], not in the model's normalised space."""
    report = audit.run(defense="none", model=f"{__name__}:linear_net", model_normalize="0.5,0.5,0.5/0.1,0.1,0.1",
                       steps=[0], attacks=["analytic"], out=tmp_path, **cifar_run(cifar))
    assert report.psnr(0, "analytic") > 60
    assert report.data["settings"]["model"]["normalize"] == {"mean": [0.5] * 3, "std": [0.1] * 3}
    assert ModelSettings(f"{__name__}:linear_net").describe()["normalize"] == "data"
    assert ModelSettings(SHARED_NET).describe()["normalize"] == "none"


# --------------------------------------------------------------------------- checkpoints
def _checkpoint(path, seed=7, wrap=None):
    torch.manual_seed(seed)
    state = linear_net(10).state_dict()
    torch.save(state if wrap is None else {wrap: state, "epoch": 3}, path)
    return state


@pytest.mark.parametrize("wrap", [None, "state_dict", "model"])
def test_a_checkpoint_is_the_state_of_audited_step_0(tmp_path, cifar, wrap):
    state = _checkpoint(tmp_path / "net.pt", wrap=wrap)
    a = Audit("none", ModelSettings(f"{__name__}:linear_net", checkpoint=tmp_path / "net.pt"),
              **{k: v for k, v in audit_settings(**cifar_run(cifar)).items() if k != "model"})
    inner = a.base_model[1].state_dict()
    assert all(torch.equal(inner[k], v) for k, v in state.items())
    assert "step 0 is the weights of checkpoint" in a.threat_model([])["model_state"]


def test_the_run_key_follows_the_checkpoint_content_not_its_path(tmp_path, cifar):
    def key(path):
        return Audit("none", ModelSettings(f"{__name__}:linear_net", checkpoint=path),
                     **{k: v for k, v in audit_settings(**cifar_run(cifar)).items() if k != "model"}).key_settings()

    _checkpoint(tmp_path / "a.pt", seed=1)
    _checkpoint(tmp_path / "b.pt", seed=1)
    _checkpoint(tmp_path / "c.pt", seed=2)
    assert key(tmp_path / "a.pt") == key(tmp_path / "b.pt") != key(tmp_path / "c.pt")


def test_a_data_parallel_prefix_is_dropped(tmp_path):
    state = _checkpoint(tmp_path / "plain.pt")
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "dp.pt")
    model = build_audited_model(f"{__name__}:linear_net", {}, (3, 16, 16), 10, mean=(0.5,) * 3, std=(0.2,) * 3,
                                checkpoint=tmp_path / "dp.pt", normalize="none")
    assert torch.equal(model[1].weight, state["1.weight"])


def test_the_utility_trains_from_the_checkpoint(tmp_path, cifar):
    """One round at a negligible learning rate leaves the checkpoint's accuracy, which differs
    from a fresh initialisation's."""
    from audit.core.data import load_dataset

    data = load_dataset("cifar10", cifar, size=16)
    torch.manual_seed(0)
    trained = linear_net(10)
    opt = torch.optim.SGD(trained.parameters(), lr=0.5)
    for _ in range(30):
        opt.zero_grad()
        nn.functional.cross_entropy(trained(data.train_images), data.train_labels).backward()
        opt.step()
    torch.save(trained.state_dict(), tmp_path / "trained.pt")
    with torch.no_grad():
        expected = float((trained(data.test_images).argmax(1) == data.test_labels).float().mean())
    settings = dict(dataset=data, steps=1, lr=1e-12, batch_size=4)
    from_checkpoint = measure_utility("none", ModelSettings(f"{__name__}:linear_net", normalize="none",
                                                            checkpoint=tmp_path / "trained.pt"), **settings)
    fresh = measure_utility("none", ModelSettings(f"{__name__}:linear_net", normalize="none"), **settings)
    # every seed starts from the checkpoint (a learning rate of 1e-12 keeps it)
    assert from_checkpoint.undefended.accuracies == pytest.approx([expected] * 3) and expected > 0.25  # chance: 0.1
    assert fresh.undefended.mean != pytest.approx(expected)


# --------------------------------------------------------------------------- client mode
def test_client_mode_eval_reaches_the_observation_the_key_and_the_threat_model(cifar):
    def built(mode):
        return Audit("none", f"{__name__}:small_net",
                     **{k: v for k, v in audit_settings(**cifar_run(cifar, client_mode=mode, batch_size=2)).items()
                        if k != "model"})

    train, evaluation = built("train"), built("eval")
    x, y = train.private[0]
    obs_train, obs_eval = train.observe(train.model, x, y, 0, 0), evaluation.observe(evaluation.model, x, y, 0, 0)
    assert (obs_train.client_mode, obs_eval.client_mode) == ("train", "eval")
    # BatchNorm with the batch's statistics vs the running ones: different shared gradients
    assert not torch.allclose(obs_train.gradients[0], obs_eval.gradients[0])
    assert train.key_settings() != evaluation.key_settings()
    assert evaluation.threat_model([])["client_mode"].startswith("eval: ")


def test_the_planner_probes_a_model_that_cannot_run_one_image_in_train_mode_in_eval_mode(tmp_path, cifar):
    report = audit.run(defense="prune", model=f"{__name__}:pooled_net", steps=[0], attacks=["ig"], out=tmp_path,
                       **cifar_run(cifar, batch_size=2))
    assert "error" not in report.data["plan"] and report.data["plan"]["model_mode"].startswith("eval")
    assert report.data["threat_model"]["client_mode"].startswith("train")
    assert isinstance(report.step(0)["attacks"]["ig"]["psnr"], float) and not report.failures
    shape = SimpleNamespace(input_shape=(3, 16, 16), num_classes=10)
    pooled = build_audited_model(f"{__name__}:pooled_net", {}, (3, 16, 16), 10, mean=(0.5,) * 3, std=(0.2,) * 3)
    probe, note = planner_model(pooled, shape)
    assert not probe.training and pooled.training and note == Reason("planner-probe-eval-mode")
    assert "1x1" in word(note)
    small = build_audited_model(f"{__name__}:small_net", {}, (3, 16, 16), 10, mean=(0.5,) * 3, std=(0.2,) * 3)
    probe, note = planner_model(small, shape)
    assert probe.training and note is None


# --------------------------------------------------------------------------- bad input: one line, nothing written
BAD_MODELS = [
    (["--model", "no_such_pkg.models:net"], "cannot import module 'no_such_pkg.models'"),
    (["--model", f"{__name__}:raising_net"], "raised RuntimeError: out of coffee"),
    (["--model", f"{__name__}:not_a_module"], "returned list, not an nn.Module"),
    (["--model", f"{__name__}:seven_classes"], "to shape (1, 7); expected (1, 10)"),
    (["--model", f"{__name__}:frozen_net"], "has no trainable parameters"),
    (["--model", f"{__name__}:pooled_net"], "--client-mode eval"),
    (["--model", f"{__name__}:pooled_net", "--batch-size", "2", "--train-batch-size", "1"], "--train-batch-size"),
    (["--model", f"{__name__}:linear_net", "--checkpoint", "missing.pt"], "missing.pt does not exist"),
    (["--model", f"{__name__}:linear_net", "--model-normalize", "imagenet"], "model normalisation must be"),
]


@pytest.mark.parametrize("args,expected", BAD_MODELS)
def test_a_bad_model_is_one_line_before_any_work(tmp_path, cifar, args, expected):
    out = tmp_path / "out"
    result = CliRunner().invoke(cli.main, ["audit", "--dataset", "cifar10", "--data-path", cifar, "--image-size", "16",
                                           "--images", "1", "--steps", "0,1", "--quiet", "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert expected in result.output and result.output.count("\n") == 1 and "Traceback" not in result.output
    assert not out.exists()


def test_bad_checkpoints_name_what_is_wrong(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    torch.save({"weights": [1, 2]}, tmp_path / "no_state.pt")
    state = _checkpoint(tmp_path / "net.pt")
    torch.save({k: v for k, v in state.items() if k != "3.bias"}, tmp_path / "missing_key.pt")
    torch.manual_seed(0)
    torch.save(nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64), nn.ReLU(), nn.Linear(64, 10),
                             nn.Linear(10, 10)).state_dict(), tmp_path / "other.pt")
    cases = [("garbage.pt", "is not readable as a torch state_dict"), ("no_state.pt", "holds no state_dict"),
             ("missing_key.pt", "1 missing: 3.bias"),
             ("other.pt", "2 unexpected: 4.weight, 4.bias; 3 shape: 1.weight (64, 768) vs the model's (32, 768)")]
    for name, expected in cases:
        with pytest.raises(ConfigError) as err:
            build_audited_model(f"{__name__}:linear_net", {}, (3, 16, 16), 10, mean=(0.5,) * 3, std=(0.2,) * 3,
                                checkpoint=tmp_path / name)
        assert expected in str(err.value) and "\n" not in str(err.value)
    assert load_state(tmp_path / "other.pt")["1.weight"].shape == (64, 768)


# --------------------------------------------------------------------------- the sweep
def test_the_sweep_passes_the_model_checkpoint_and_client_mode_to_every_cell(tmp_path, cifar):
    _checkpoint(tmp_path / "net.pt")
    report = audit.sweep({"gaussian": {"sigma": [0.01]}}, out=tmp_path / "sweep",
                         **cifar_run(cifar, model=f"{__name__}:linear_net", checkpoint=str(tmp_path / "net.pt"),
                                     client_mode="eval", steps=[0], attacks=["analytic"]))
    cells = sorted((tmp_path / "sweep" / "cells").iterdir())
    assert len(cells) == 2 and report.data["settings"]["model"]["model"] == f"{__name__}:linear_net"
    for cell in cells:
        data = json.loads((cell / "report.json").read_text())
        assert data["threat_model"]["client_mode"].startswith("eval")
        assert data["settings"]["checkpoint"].endswith("net.pt")
        assert data["settings"]["model"]["state_sha256"] == report.data["settings"]["model"]["state_sha256"]


def test_the_sweep_command_takes_the_model_options(tmp_path, cifar):
    out = tmp_path / "sweep"
    result = CliRunner().invoke(cli.main, ["sweep", "--defense", "gaussian", "--grid", "sigma=0.01",
                                           "--dataset", "cifar10", "--data-path", cifar, "--image-size", "16",
                                           "--model", f"{__name__}:pooled_net", "--client-mode", "train",
                                           "--quiet", "--out", str(out)])
    assert result.exit_code == 2 and "--client-mode eval" in result.output and not out.exists()
