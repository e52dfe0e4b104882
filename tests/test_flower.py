"""The Flower integration: the client mod audits a real federation from inside it (per-round
reports, the federation untouched, failures read incomplete), and Flower's own privacy mods,
run here on the same update and seed, are mirrored by the audit's defenses."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from audit.core.errors import ConfigError
from audit.core.randomness import VMAP_DRAWS
from audit.core.reconstruction_bound import identification_bound
from defenses import build_defense
from defenses.dpsgd import privacy_spent

needs_flwr = pytest.mark.skipif(importlib.util.find_spec("flwr") is None,
                                reason="runs Flower's own mods and a Flower simulation: needs the [flower] extra")
JUDGED = {"leaks", "partially", "no recovered image", "inconclusive"}  # the round was attacked and judged
SMALL = dict(budget=5, attacks="ig", seed=0)


# --------------------------------------------------------------------------- helpers
def app():
    """The documented Flower app (bench/flower_app.py) and Flower's message types."""
    import bench.flower_app as flower_app
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

    return flower_app, ArrayRecord, ConfigRecord, Context, Message, RecordDict


def initial_state():
    flower_app = app()[0]
    torch.manual_seed(0)
    return flower_app.Net().state_dict()


class OneStep:
    """A client of one plain SGD step on 16 images of a model without buffers: the update
    Flower's update mods transform is then exactly the mirror's one-step gradient."""

    LR = 0.1

    @staticmethod
    def net():
        from torch import nn

        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 14 * 14, 10))

    @classmethod
    def train(cls, msg, context):
        flower_app, ArrayRecord, _, _, Message, RecordDict = app()
        model = cls.net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        images, labels = flower_app.client_data(context)
        loss = torch.nn.functional.cross_entropy(model(images[:16]), labels[:16])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= cls.LR * p.grad
        return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict())}), reply_to=msg)

    @classmethod
    def client_app(cls, mods=()):
        from flwr.clientapp import ClientApp

        client = ClientApp(mods=list(mods))
        client.train()(cls.train)
        return client

    @classmethod
    def state(cls):
        return cls.net().state_dict()


@pytest.fixture(autouse=True)
def task_identity():
    """Messages are made outside Flower's runtime here: give them the identity a runtime (as
    run_simulation does) sets for its process, and take it back after."""
    if importlib.util.find_spec("flwr") is None:
        yield
        return
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def train_message(state, round_, **config):
    _, ArrayRecord, ConfigRecord, _, Message, RecordDict = app()
    content = RecordDict({"arrays": ArrayRecord(state), "config": ConfigRecord({"server-round": round_, **config})})
    return Message(content, dst_node_id=7, message_type="train")


def context(partition=0):
    _, _, _, Context, _, RecordDict = app()
    return Context(run_id=1, node_id=7, node_config={"partition-id": partition, "num-partitions": 2},
                   state=RecordDict(), run_config={})


def arrays(reply):
    return reply.content["arrays"].to_torch_state_dict()


def one_step_gradient(before, after, lr):
    """The gradient of the client's one local SGD step: (theta_before - theta_after) / lr."""
    return [(before[k] - after[k]) / lr for k in before]


# --------------------------------------------------------------------------- the optional extra
def test_without_flwr_the_integration_names_the_extra():
    code = "import sys; sys.modules['flwr'] = None; import audit.integrations.flower"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == \
        'ImportError: the Flower integration needs flwr: pip install "gia-audit[flower]"'


def test_the_documented_app_is_the_one_that_runs():
    """docs/flower.md shows bench/flower_app.py's app verbatim (from ``class Net`` to ``main``)."""
    root = Path(__file__).resolve().parents[1]
    source = (root / "bench" / "flower_app.py").read_text()
    app_code = source[source.index("class Net"):source.index("\ndef main(")].strip()
    page = (root / "docs" / "flower.md").read_text()
    shown = page.split("<!-- app:begin -->")[1].split("<!-- app:end -->")[0].strip()
    assert shown == f"```python\n{app_code}\n```"


# --------------------------------------------------------------------------- Flower's mods, mirrored
@needs_flwr
@pytest.mark.parametrize("clipping_norm", [0.01, 100.0])  # the update clipped, and left as it is
def test_localdp_mirror_applies_flowers_transform_to_the_same_update(clipping_norm):
    from flwr.clientapp.mod import LocalDpMod

    from audit.integrations.flower import flower_defense

    plain = OneStep
    state, ctx = plain.state(), context()
    msg = train_message(state, 1)
    after = arrays(plain.client_app()(msg, ctx))  # the client's own update, no mod
    grads = one_step_gradient(state, after, plain.LR)
    update_norm = math.sqrt(sum(float((plain.LR * g).pow(2).sum()) for g in grads))
    assert (update_norm > clipping_norm) == (clipping_norm < 1)

    dp = LocalDpMod(clipping_norm=clipping_norm, sensitivity=0.05, epsilon=10.0, delta=1e-5)
    np.random.seed(5)
    flower_out = arrays(plain.client_app([dp])(train_message(state, 1), ctx))
    spec, args = flower_defense(dp, msg, plain.LR)
    mirror = build_defense(spec, **args)
    std = 0.05 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 10.0  # LocalDpMod's noise on the update
    assert mirror.noise_std == pytest.approx(std, rel=1e-12)

    # Flower's output is the old state + our clipped update + the noise Flower drew with that seed
    clipped = build_defense("flower-fixedclipping", clipping_norm=clipping_norm, lr=plain.LR).transform(grads)
    np.random.seed(5)
    drawn = [torch.from_numpy(np.random.normal(0, std, tuple(g.shape)).astype(np.float32)) for g in grads]
    for (key, old), c, n in zip(state.items(), clipped, drawn):
        assert torch.allclose(flower_out[key], old - plain.LR * c + n, atol=2e-6, rtol=0)

    # our noise, in update units, has Flower's std; its log_prob is that Gaussian's density
    shared = mirror.transform(grads, generator=torch.Generator().manual_seed(0))
    residual = torch.cat([(plain.LR * (s - c)).flatten() for s, c in zip(shared, clipped)]).double()
    assert abs(float(residual.std()) / std - 1) < 0.02 and abs(float(residual.mean())) < 0.02 * std
    # the same draws inside a vmapped program (vmap_draws: EOT attacks batch them), independent per member
    bias = grads[1]  # the first layer's 16 biases, as a gradient of their own, 64 draws
    first = torch.func.vmap(lambda g: mirror.transform([g], generator=VMAP_DRAWS)[0], randomness="different")(
        torch.stack([bias] * 64))
    alone = build_defense("flower-fixedclipping", clipping_norm=clipping_norm, lr=plain.LR).transform([bias])
    noise = plain.LR * (first - alone[0]).double()
    assert abs(float(noise.std()) / std - 1) < 0.15 and not torch.equal(noise[0], noise[1])
    scale, shared, grads = std / plain.LR, [t.double() for t in shared], [g.double() for g in grads]
    clipped = build_defense("flower-fixedclipping", clipping_norm=clipping_norm, lr=plain.LR).transform(grads)
    expected = sum(float((-0.5 * ((s - c) / scale) ** 2 - math.log(scale * math.sqrt(2 * math.pi))).sum())
                   for s, c in zip(shared, clipped))
    assert float(mirror.log_prob(shared, grads)) == pytest.approx(expected, rel=1e-9)


@needs_flwr
@pytest.mark.parametrize("clipping_norm", [0.01, 100.0])
def test_fixedclipping_mirror_reads_the_rounds_norm_and_clips_as_flower_does(clipping_norm):
    from flwr.clientapp.mod import fixedclipping_mod

    from audit.integrations.flower import flower_defense

    plain = OneStep
    state, ctx = plain.state(), context()
    msg = train_message(state, 2, clipping_norm=clipping_norm)
    grads = one_step_gradient(state, arrays(plain.client_app()(msg, ctx)), plain.LR)
    flower_out = arrays(plain.client_app([fixedclipping_mod])(train_message(state, 2, clipping_norm=clipping_norm),
                                                                   ctx))
    spec, args = flower_defense(fixedclipping_mod, msg, plain.LR)
    assert (spec, args) == ("flower-fixedclipping", {"clipping_norm": clipping_norm, "lr": plain.LR})
    shared = build_defense(spec, **args).transform(grads)
    for (key, old), s in zip(state.items(), shared):
        assert torch.allclose(flower_out[key], old - plain.LR * s, atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="clipping_norm"):
        flower_defense(fixedclipping_mod, train_message(state, 2), plain.LR)


def test_the_cli_takes_flowers_defenses_by_name_and_an_audit_accounts_for_localdp():
    from click.testing import CliRunner

    import cli
    from audit.engine.privacy import privacy_report
    from audit.engine.settings import FLSettings

    listed = CliRunner().invoke(cli.main, ["list", "defenses"])
    assert "flower-localdp" in listed.output and "flower-fixedclipping" in listed.output
    for extra, fragment in ((["--defense-arg", "epsilon=-1"], "epsilon must be in (0, inf]"),
                            (["--local-steps", "2"], "local_steps=1")):
        done = CliRunner().invoke(cli.main, ["audit", "--defense", "flower-localdp", *extra, "--quiet", "--seed", "0",
                                             "--device", "cpu"])
        assert done.exit_code == 2 and fragment in done.output and len(done.output.strip().splitlines()) == 1

    # what `gia-audit audit --defense flower-localdp ...` reports: FedSGD on the client's 480 images, batch 8
    defense = build_defense("flower-localdp", clipping_norm=0.05, sensitivity=0.05, epsilon=2.0)
    privacy = privacy_report(defense, FLSettings(), 480, [0, 2], candidates=64)
    z, q = 0.05 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 2.0 / (2 * 0.05), 8 / 480
    assert privacy["applicable"] and privacy["noise_multiplier"] == pytest.approx(z, rel=1e-12)
    assert [p["epsilon"] for p in privacy["per_step"]] == pytest.approx(
        [0.0, privacy_spent(2, q, z, 1e-5).epsilon], rel=1e-9)
    assert privacy["identification_bound"]["bound"] == pytest.approx(identification_bound(1 / 64, z), rel=1e-9)


# --------------------------------------------------------------------------- the mod's options
@needs_flwr
@pytest.mark.parametrize("options,fragment", [
    ({"rounds": [0]}, "rounds >= 1"),
    ({"data": "cifar"}, "data must be a callable"),
    ({"data": lambda context, round, extra: None}, "data(context, round)"),
    ({"attacks": "ig,no-such-attack"}, "no-such-attack"),
    ({"defense": "flower-localdp", "defense_args": {"epsilon": -1}}, "epsilon"),
    ({"timeout": 0}, "timeout"),
    ({"images": 2}, "unknown AuditMod option(s) images"),
    ({"lr": 0.1, "local_lr": 0.05}, "give one"),
    ({"local_steps": 2, "local_epochs": 1}, "local_steps= / local_epochs="),
    ({"local_optimizer": "sgd:momentum=2"}, "momentum"),
    ({"model_args": {"width": 3}}, "model_args="),
])
def test_bad_mod_options_are_one_line_errors_naming_the_mods_options(options, fragment):
    from audit.integrations.flower import AuditMod

    flower_app = app()[0]
    base = dict(rounds=[1], model=flower_app.Net, data=flower_app.first_client_data)
    with pytest.raises(ConfigError) as err:
        AuditMod(**{**base, **options})
    assert fragment in str(err.value) and "\n" not in str(err.value) and "--" not in str(err.value)


@needs_flwr
def test_the_model_is_built_and_checked_when_the_mod_is_built():
    from torch import nn

    from audit.integrations.flower import AuditMod

    flower_app = app()[0]
    built = []

    def factory(width=16):
        built.append(width)
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width))

    AuditMod(rounds=[1], model=factory, data=flower_app.first_client_data, model_args={"width": 10})
    assert built == [10]  # built once, at construction, with the mod's model_args

    def broken(width=16):
        raise RuntimeError("no such layer")

    with pytest.raises(ConfigError, match="no such layer") as err:
        AuditMod(rounds=[1], model=broken, data=flower_app.first_client_data)
    assert "model_args=" in str(err.value) and "--model-arg" not in str(err.value)
    with pytest.raises(ConfigError, match="input_shape=") as err:  # a forward that fails on the declared inputs
        AuditMod(rounds=[1], model=factory, data=flower_app.first_client_data, input_shape=(1, 28, 28))


@needs_flwr
def test_defense_args_do_not_apply_to_a_flower_mod_and_a_class_count_is_asked_for():
    from flwr.clientapp.mod import LocalDpMod

    from audit.integrations.flower import AuditMod

    flower_app = app()[0]
    dp = LocalDpMod(1.0, 1.0, 1.0, 1e-5)
    with pytest.raises(ConfigError, match="read from the mod itself"):
        AuditMod(rounds=[1], model=flower_app.Net, data=flower_app.first_client_data, defense=dp,
                 defense_args={"lr": 1})

    def factory(num_classes):
        return flower_app.Net()

    with pytest.raises(ConfigError, match="num_classes="):
        AuditMod(rounds=[1], model=factory, data=flower_app.first_client_data)


# --------------------------------------------------------------------------- the real reply, checked
def audited_round(tmp_path, training="momentum", round_=1, **settings):
    """Client 0 of the documented app through the mod (blocking) on a train message of ``round_``;
    the reply with and without the mod, and the round's status."""
    flower_app = app()[0]
    mod = flower_app.audit_mod(str(tmp_path / training), audited=[round_], training=training, blocking=True,
                               **{**SMALL, **settings})
    state, ctx = initial_state(), context()
    reply = flower_app.client_app([mod])(train_message(state, round_), ctx)
    plain = flower_app.client_app()(train_message(state, round_), ctx)
    folder = tmp_path / training / "partition-0" / f"round-{round_}"
    return reply, plain, folder, json.loads((folder / "audit.json").read_text())


@needs_flwr
def test_the_real_reply_is_audited_and_reproduced_by_the_declared_training(tmp_path):
    from audit.integrations.flower.reply import named_arrays

    flower_app = app()[0]
    reply, plain, folder, status = audited_round(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(arrays(reply).values(), arrays(plain).values()))
    assert status["state"] == "finished", status
    fidelity = status["fidelity"]
    assert fidelity["reproduces"] and set(fidelity["groups"]) == {"update", "buffers"}
    for group in fidelity["groups"].values():  # 2 momentum steps with BatchNorm, replayed to float tolerance
        assert group["cosine"] > 1 - 1e-9 and abs(group["ratio"] - 1) < 1e-5 and group["real_norm"] > 0

    # the attacked observation is the reply: the update in gradient units and the uploaded buffers
    report = json.loads((folder / "report.json").read_text())
    threat = report["threat_model"]
    assert threat["shares"] == "state" and threat["local_steps"] == 2 and threat["local_lr"] == flower_app.LR
    assert threat["local_optimizer"] == "sgd(momentum=0.9)" and "reproduces the reply" in threat["fidelity"]
    assert "training_step" not in threat and "splits" not in report["data"]
    net = flower_app.Net()
    sent = named_arrays(arrays(reply), net, "the reply")
    assert set(sent.buffers) == {n for n, _ in net.named_buffers()}  # the client sends its BatchNorm statistics
    assert report["data"]["private_labels"] == [flower_app.client_data(context())[1][
        flower_app.round_batch(context(), 1)].tolist()]  # the 4 images the round trained on
    page = (folder.parent / "report.md").read_text()
    assert "per-round report: none" not in page and "partition-0: no defense" in page
    assert "fidelity, round 1" in page and "- **local_lr**: 0.05\n" in page and "training_step" not in page


@needs_flwr
def test_a_wrong_description_of_the_training_is_not_judged_and_logged_once(tmp_path, caplog):
    caplog.set_level("WARNING", logger="flwr")
    _, _, folder, status = audited_round(tmp_path, training="one-step")
    assert status["state"] == "not judged"
    assert status["reason"].startswith("not judged: the declared training does not reproduce the client's update")
    assert status["fidelity"]["differs"] == ["update", "buffers"]
    assert 1.5 < status["fidelity"]["groups"]["update"]["ratio"]  # two momentum steps move about twice as far
    assert not list(folder.glob("runs/*/results/*"))  # no attack ran
    report = json.loads((folder.parent / "report.json").read_text())
    assert report["steps"][0]["verdict"]["label"] == "not judged" and report["verdict"]["label"] == "not judged"
    assert "**Verdict: not judged: " in (folder.parent / "report.md").read_text()
    lines = [r for r in caplog.records if "gia-audit" in r.getMessage() and r.name == "flwr"]
    assert len(lines) == 1 and "not judged" in lines[0].getMessage()


@needs_flwr
def test_under_localdp_the_check_clips_the_whole_update_then_finds_its_noise(tmp_path):
    from flwr.clientapp.mod import LocalDpMod

    flower_app = app()[0]
    state = initial_state()
    plain = arrays(flower_app.client_app()(train_message(state, 1), context()))
    dp = LocalDpMod(clipping_norm=1.0, sensitivity=1e-5, epsilon=1.0, delta=1e-5)
    # Flower clips the update over every array of the reply, BatchNorm's num_batches_tracked included
    update_norm = math.sqrt(sum(float((plain[k].double() - v.double()).pow(2).sum()) for k, v in state.items()))
    assert update_norm > 2 * dp.clipping_norm  # clipping is active, also at twice the norm

    def audited(name, declared, training="momentum"):
        mod = flower_app.audit_mod(str(tmp_path / name), audited=[1], localdp=declared, training=training,
                                   blocking=True, **SMALL)
        reply = flower_app.client_app([mod, dp])(train_message(state, 1), context())
        return reply, json.loads((tmp_path / name / "partition-0" / "round-1" / "audit.json").read_text())

    reply, status = audited("declared", dp)
    assert not reply.has_error()
    sent = arrays(reply)  # a 0-d integer array (num_batches_tracked) is left as the client trained it
    assert all(torch.equal(sent[k], v) for k, v in plain.items() if not v.is_floating_point())
    assert status["state"] == "finished" and status["fidelity"]["reproduces"], status
    noise = status["fidelity"]["noise"]
    assert noise["noise_std"] == pytest.approx(1e-5 * math.sqrt(2 * math.log(1.25e5)), rel=1e-12)
    assert abs(noise["energy_ratio"] - 1) <= noise["band"] < 0.05  # the residual is Flower's noise
    # a clipping norm the client does not run, or one plain step: the residual is more than the noise
    for name, declared, training in (("norm", LocalDpMod(2.0, 1e-5, 1.0, 1e-5), "momentum"),
                                     ("one-step", dp, "one-step")):
        _, status = audited(name, declared, training)
        noise = status["fidelity"]["noise"]
        assert status["state"] == "not judged" and status["fidelity"]["reproduces"] is False, name
        assert noise["energy_ratio"] > 1 + noise["band"], name


class Counting(torch.nn.Module):
    """A linear model with a 1-d integer buffer (forward passes per head) it sends in its state."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))
        self.register_buffer("passes", torch.zeros(2, dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.passes += 1
        return self.body(x)

    @staticmethod
    def train_round(msg, context):
        flower_app, ArrayRecord, _, _, Message, RecordDict = app()
        model = Counting()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        images, labels = flower_app.client_data(context)
        torch.nn.functional.cross_entropy(model(images[:4]), labels[:4]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict())}), reply_to=msg)


@needs_flwr
def test_a_reply_flowers_clipping_cannot_scale_is_an_error_reply_naming_the_fix(tmp_path, caplog):
    from flwr.clientapp import ClientApp
    from flwr.clientapp.mod import LocalDpMod

    from audit.integrations.flower import AuditMod

    flower_app = app()[0]
    caplog.set_level("WARNING", logger="flwr")

    def client_app(mods):
        client = ClientApp(mods=mods)
        client.train()(Counting.train_round)
        return client

    def data(context, round_):
        images, labels = flower_app.client_data(context)
        return images, labels, torch.arange(4)

    dp = LocalDpMod(clipping_norm=1e-3, sensitivity=1e-3, epsilon=1.0, delta=1e-5)
    torch.manual_seed(0)
    state = Counting().state_dict()
    with pytest.raises(TypeError, match="Cannot cast ufunc 'multiply'"):  # Flower's own failure, without the mod
        client_app([dp])(train_message(state, 1), context())
    mod = AuditMod(rounds=[1], model=Counting, data=data, local_lr=0.1, defense=dp, out=str(tmp_path), blocking=True,
                   **SMALL)
    reply = client_app([mod, dp])(train_message(state, 1), context())
    assert reply.has_error() and "\n" not in reply.error.reason
    assert "integer array" in reply.error.reason and "is_floating_point()" in reply.error.reason
    status = json.loads((tmp_path / "partition-0" / "round-1" / "audit.json").read_text())
    assert status["state"] == "failed" and reply.error.reason in status["reason"]
    assert json.loads((tmp_path / "partition-0" / "report.json").read_text())["verdict"]["label"] == "incomplete"
    lines = [r.getMessage() for r in caplog.records if r.name == "flwr" and "gia-audit" in r.getMessage()]
    assert len(lines) == 1 and "is_floating_point()" in lines[0]
    client_app([mod])(train_message(state, 2), context())  # a later train message: logged once only
    assert len([r for r in caplog.records if r.name == "flwr" and "gia-audit" in r.getMessage()]) == 1


@needs_flwr
@pytest.mark.parametrize("blocking", [True, False])
def test_the_mod_leaves_the_clients_global_random_states_as_they_were(tmp_path, blocking):
    import random

    from audit.integrations.flower import wait_for_audits

    flower_app = app()[0]

    def draws(mods):
        state, ctx = initial_state(), context()
        torch.manual_seed(11), np.random.seed(11), random.seed(11)
        flower_app.client_app(mods)(train_message(state, 1), ctx)
        return torch.rand(4), np.random.rand(4), random.random()

    mod = flower_app.audit_mod(str(tmp_path), audited=[1], blocking=blocking, **SMALL)
    audited, plain = draws([mod]), draws([])
    assert torch.equal(audited[0], plain[0]) and np.array_equal(audited[1], plain[1]) and audited[2] == plain[2]
    assert wait_for_audits(tmp_path, timeout=300) == {str(tmp_path / "partition-0" / "round-1"): "finished"}


@needs_flwr
def test_a_timed_out_inline_audit_stops_and_leaves_no_report_contradicting_its_status(tmp_path):
    import threading

    _, _, folder, status = audited_round(tmp_path, timeout=0.5, budget=2000)
    assert status["state"] == "timed out" and "timeout of 0.5 s" in status["reason"]
    assert not any(t.name.startswith("gia-audit round") for t in threading.enumerate())  # stopped, not abandoned
    assert not (folder / "report.md").exists()  # the cancelled audit's late result is discarded
    combined = json.loads((folder.parent / "report.json").read_text())
    assert combined["verdict"]["label"] == "incomplete" and combined["status"].startswith("incomplete")
    page = (folder.parent / "report.md").read_text()
    assert "Run `None`" not in page and "delta = 0.000" not in page and "delta = nan" not in page


@needs_flwr
def test_a_failure_in_the_background_is_reported_outside_the_round(tmp_path):
    from audit.integrations.flower import wait_for_audits

    flower_app = app()[0]

    def too_few(context, round_):  # 16 images besides the 4 trained: too few for the null's 64 candidates
        images, labels = flower_app.client_data(context)
        return images[:20], labels[:20], torch.arange(4)

    mod = flower_app.AuditMod(rounds=[1], model=flower_app.Net, data=too_few, local_lr=flower_app.LR,
                              out=str(tmp_path), **SMALL)
    flower_app.client_app([mod])(train_message(initial_state(), 1), context())
    folder = tmp_path / "partition-0" / "round-1"
    status = json.loads((folder / "audit.json").read_text())
    assert status["state"] == "failed" and "images besides" in status["reason"]
    assert not (folder.parent / "report.json").exists()  # built by the background process, not in the round
    assert wait_for_audits(tmp_path, timeout=120) == {str(folder): "failed"}
    report = json.loads((folder.parent / "report.json").read_text())
    assert report["verdict"]["label"] == "incomplete" and "images besides" in report["verdict"]["reason"]


@needs_flwr
def test_data_without_the_trained_rows_is_a_failed_round_naming_them(tmp_path):
    flower_app = app()[0]
    mod = flower_app.AuditMod(rounds=[2], model=flower_app.Net, data=flower_app.client_data, out=str(tmp_path),
                              blocking=True, **SMALL)
    flower_app.client_app([mod])(train_message(initial_state(), 2), context())
    status = json.loads((tmp_path / "partition-0" / "round-2" / "audit.json").read_text())
    assert status["state"] == "failed" and "(images, labels, trained)" in status["reason"]


@needs_flwr
def test_the_hold_includes_the_launch(tmp_path, monkeypatch):
    import time

    from audit.integrations.flower import wait_for_audits
    from audit.integrations.flower import mod as mod_module

    flower_app = app()[0]
    launch = mod_module.AuditMod._spawn
    monkeypatch.setattr(mod_module.AuditMod, "_spawn", lambda self, folder: (time.sleep(0.3), launch(self, folder)))
    mod = flower_app.audit_mod(str(tmp_path), audited=[1], **SMALL)
    flower_app.client_app([mod])(train_message(initial_state(), 1), context())
    status = json.loads((tmp_path / "partition-0" / "round-1" / "audit.json").read_text())
    assert status["prepared_s"] >= 0.3
    assert wait_for_audits(tmp_path, timeout=300) == {str(tmp_path / "partition-0" / "round-1"): "finished"}


@needs_flwr
def test_a_round_whose_audit_process_died_without_a_status_reads_incomplete(tmp_path):
    from audit.integrations.flower import wait_for_audits
    from audit.integrations.flower.job import PID_FILE, write_status

    folder = tmp_path / "node-7" / "round-4"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process that ended (killed, out of memory) before writing its final status
    write_status(folder, state="running", round=4, client="node-7", defense="none")
    (folder / PID_FILE).write_text(str(gone.pid))
    assert wait_for_audits(tmp_path, timeout=60) == {str(folder): "failed"}
    report = json.loads((tmp_path / "node-7" / "report.json").read_text())
    assert report["verdict"]["label"] == "incomplete" and "without a final status" in report["verdict"]["reason"]


@needs_flwr
def test_the_per_round_report_reads_an_attack_that_does_not_apply_as_not_applicable(tmp_path):
    from test_report import _ok, _rec, _report

    from audit.integrations.flower.job import FINISHED
    from audit.integrations.flower.rounds import RoundPart, merge_rounds
    from audit.report.audit_report import AuditReport

    why = "analytic inversion needs a fully connected first layer; the model starts with Conv2d"
    parts = [RoundPart(r, tmp_path / f"round-{r}", FINISHED, "", key=f"run{r}", data=_report(
        [_ok(r, "ig", 0, 12.0, 0.1), _rec(r, "analytic", 0, "not_applicable", reason=why)], steps=(r,),
        attacks=("ig", "analytic")).data) for r in (1, 3)]
    merged = merge_rounds(parts, defense="none", client="partition-0")
    assert merged["progress"] == {"done": 2, "total": 2, "not_applicable": 2} and merged["status"] == "complete"
    assert merged["not_applicable"] == [{"attack": "analytic", "steps": [1, 3], "reason": why}]
    assert merged["verdict"]["label"] == "no recovered image"
    md = AuditReport(merged).to_markdown()
    assert f"Status: complete, 2/2 (round, attack, image) results; not applicable: analytic at round 1, 3 ({why})" in md
    assert f"| 3 | 12.00 | not applicable ({why}) |" in md


@needs_flwr
def test_the_per_round_figure_draws_each_rounds_chance_level_in_the_curves_psnr(tmp_path):
    from test_report import _evidence, _null, _ok, _report

    from audit.integrations.flower.job import FINISHED
    from audit.integrations.flower.rounds import RoundPart, merge_rounds
    from audit.report.plots import psnr_vs_step_series

    def round_part(r, chance, raw, value):  # each round audits other images, with a chance level of their own
        rec = _ok(r, "ig", 0, raw, 0.1)
        rec["metrics"]["evidence"] = [_evidence(value, 1)]
        null = {"images": [[_null(chance)]], "description": {}}
        return RoundPart(r, tmp_path / f"round-{r}", FINISHED, "", key=f"run{r}",
                         data=_report([rec], steps=(r,), attacks=("ig",), null=null).data)

    merged = merge_rounds([round_part(1, 15.0, 9.0, 14.0), round_part(3, 20.0, 12.0, 21.5)], defense="none")
    series = psnr_vs_step_series(merged)
    assert series["quantity"] == "aligned PSNR"
    assert series["curves"] == {"ig": [(1, 14.0), (3, 21.5)]} and series["worst"] == [(1, 14.0), (3, 21.5)]
    assert series["chance"] == [(1, 15.0), (3, 20.0)]  # not one line at the rounds' mean (17.5)
    assert [s["verdict"]["label"] for s in merged["steps"]] == ["no recovered image", "leaks"]


def test_flower_report_takes_no_unused_options_and_names_the_client_folders(tmp_path):
    from click.testing import CliRunner

    import cli
    from audit.integrations.flower.job import write_status

    write_status(tmp_path / "partition-3" / "round-1", state="failed", round=1, reason="x")
    unused = CliRunner().invoke(cli.main, ["flower-report", str(tmp_path), "--seed", "1"])
    assert unused.exit_code == 2 and "No such option" in unused.output and "--seed" in unused.output
    pointed = CliRunner().invoke(cli.main, ["flower-report", str(tmp_path)])
    assert pointed.exit_code == 2 and str(tmp_path / "partition-3") in pointed.output


# --------------------------------------------------------------------------- a real federation
def two_federations(mods, rounds, result):
    """One simulation, two federations of the same clients from the same initial model: FedAvg
    on the ``train`` function with the ``mods`` on ``@app.train()``, then FedAvg on the same
    function registered without them (``train.plain``); their final global states land in ``result``."""
    from flwr.app import Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    flower_app = app()[0]

    class Plain(FedAvg):
        def configure_train(self, server_round, arrays, config, grid):
            return [Message(m.content, dst_node_id=m.metadata.dst_node_id, message_type="train.plain")
                    for m in super().configure_train(server_round, arrays, config, grid)]

    client = ClientApp()
    client.train(mods=list(mods))(flower_app.train)
    client.train("plain")(flower_app.train)
    server = ServerApp()

    @server.main()
    def main(grid, context):
        for name, strategy in (("audited", FedAvg), ("plain", Plain)):
            torch.manual_seed(0)
            initial = app()[1](flower_app.Net().state_dict())
            run = strategy(fraction_evaluate=0.0, min_train_nodes=2, min_available_nodes=2)
            result[name] = run.start(grid=grid, initial_arrays=initial, num_rounds=rounds).arrays.to_torch_state_dict()

    return server, client


@needs_flwr
def test_a_flower_simulation_is_audited_per_round_on_its_real_replies_and_its_weights_are_unchanged(tmp_path):
    """Client 0 is audited at rounds 1 and 3; client 1's audit of round 1 runs past a 1 s timeout."""
    from click.testing import CliRunner
    from flwr.simulation import run_simulation

    import cli
    from audit.integrations.flower import wait_for_audits

    flower_app = app()[0]
    out = tmp_path / "audits"

    def client(partition):
        def data(context, round_):
            if context.node_config["partition-id"] != partition:
                return None
            images, labels = flower_app.client_data(context)
            return images, labels, flower_app.round_batch(context, round_)
        return data

    common = dict(model=flower_app.Net, local_lr=flower_app.LR, out=str(out), **flower_app.TRAINING["momentum"],
                  **SMALL)
    mods = [flower_app.AuditMod(rounds=[1, 3], data=client(0), timeout=400, **common),
            flower_app.AuditMod(rounds=[1], data=client(1), timeout=1, **common)]
    result = {}
    server, client_app = two_federations(mods, 3, result)
    run_simulation(server_app=server, client_app=client_app, num_supernodes=2,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    audited, plain = result["audited"], result["plain"]
    assert list(audited) == list(plain) and all(torch.equal(audited[k], plain[k]) for k in plain)
    assert not all(torch.equal(plain[k], v) for k, v in initial_state().items())  # the federations trained

    states = wait_for_audits(out, timeout=400)
    assert states == {str(out / "partition-0" / "round-1"): "finished", str(out / "partition-0" / "round-3"): "finished",
                      str(out / "partition-1" / "round-1"): "timed out"}, states
    stopped = json.loads((out / "partition-1" / "report.json").read_text())
    assert stopped["verdict"]["label"] == "incomplete" and "timeout of 1 s" in stopped["verdict"]["reason"]
    report = json.loads((out / "partition-0" / "report.json").read_text())
    assert report["step_name"] == "round" and [s["step"] for s in report["steps"]] == [1, 3]
    assert {s["verdict"]["label"] for s in report["steps"]} <= JUDGED and report["status"] == "complete"
    for r in report["rounds"]:  # the replies of a real simulation, reproduced by the declared training
        groups = r["fidelity"]["groups"]
        assert r["fidelity"]["reproduces"] and all(g["cosine"] > 1 - 1e-6 for g in groups.values()), r
    # what was audited is what the client received: round 1, the server's initial arrays; round 3, a trained state
    round1 = torch.load(out / "partition-0" / "round-1" / "global_model.pt")
    round3 = torch.load(out / "partition-0" / "round-3" / "global_model.pt")
    assert all(torch.equal(v, round1[k]) for k, v in initial_state().items())
    assert not all(torch.equal(round1[k], round3[k]) for k in round1)

    rerun = CliRunner().invoke(cli.main, ["flower-report", str(out / "partition-0"), "--thresholds", "margin_db=200"])
    assert rerun.exit_code == 0, rerun.output
    strict = json.loads((out / "partition-0" / "report.json").read_text())
    assert strict["thresholds"]["margin_db"] == 200
    assert all(s["verdict"]["recovered"] == 0 for s in strict["steps"])


@needs_flwr
def test_a_round_not_judged_beside_a_private_round_makes_the_client_not_judged(tmp_path):
    from test_report import _ok, _report

    from audit.integrations.flower.job import FINISHED, NOT_JUDGED
    from audit.integrations.flower.rounds import RoundPart, merge_rounds

    judged = RoundPart(1, tmp_path / "round-1", FINISHED, "", key="run1",
                       data=_report([_ok(1, "ig", 0, 12.0, 0.1)], steps=(1,), attacks=("ig",)).data)
    unreproduced = RoundPart(2, tmp_path / "round-2", NOT_JUDGED, "the declared training does not reproduce the reply")
    merged = merge_rounds([judged, unreproduced], defense="none", client="partition-0")
    assert [s["verdict"]["label"] for s in merged["steps"]] == ["no recovered image", "not judged"]
    assert merged["verdict"]["label"] == "not judged" and [n["step"] for n in merged["verdict"]["not_judged_steps"]] == [2]


def test_fidelity_under_noise_that_drowns_the_update_is_not_checkable_never_reproduced():
    """A wrong training description (the reply trained another way) under noise far above the
    whole update: the residual has the noise's energy either way, so the check cannot see it."""
    from audit.integrations.flower.fidelity import compare
    from audit.integrations.flower.reply import NamedArrays

    g = torch.Generator().manual_seed(0)
    n, noise = 20_000, 0.05
    before = NamedArrays({"w": torch.zeros(n)}, {}, {})
    declared = torch.randn(n, generator=g) * 1e-4  # the replayed update: norm about 0.014
    trained = torch.randn(n, generator=g) * 1e-4  # what the client really ran: another update of that size
    real = NamedArrays({"w": trained + noise * torch.randn(n, generator=g)}, {}, {})
    check = compare(before, real, NamedArrays({"w": declared}, {}, {}), noise_std=noise)
    assert check.reproduces is None and check.reason.startswith("fidelity not checkable under this noise")
    assert abs(check.noise["energy_ratio"] - 1) <= check.noise["band"]  # the old test alone would pass it
    # the same wrong description under noise small against the update is caught
    big_declared, big_trained = declared * 1e3, trained * 1e3
    real = NamedArrays({"w": big_trained + noise * torch.randn(n, generator=g)}, {}, {})
    caught = compare(before, real, NamedArrays({"w": big_declared}, {}, {}), noise_std=noise)
    assert caught.reproduces is False
    right = NamedArrays({"w": big_declared + noise * torch.randn(n, generator=g)}, {}, {})
    assert compare(before, right, NamedArrays({"w": big_declared}, {}, {}), noise_std=noise).reproduces is True


def test_the_mods_settings_are_an_audit_config_that_differs_only_where_a_federation_does():
    from dataclasses import fields

    from torch import nn

    from audit.engine.config import AuditConfig
    from audit.integrations.flower.settings import MOD_DEFAULTS, mod_settings

    def net(num_classes=10):
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, num_classes))

    settings = mod_settings(rounds=[2], model=net, data=lambda context: None, num_classes=10, local_lr=0.05,
                            local_steps=3, attacks="ig")
    assert settings.config == AuditConfig(**MOD_DEFAULTS, model=net, lr=0.05, local_steps=3, attacks="ig")
    default = AuditConfig()
    changed = {f.name for f in fields(AuditConfig) if getattr(settings.config, f.name) != getattr(default, f.name)}
    assert changed == set(MOD_DEFAULTS) | {"model", "lr", "local_steps", "attacks"}  # no default written twice
    assert settings.fl == settings.config.sections().fl_settings and settings.fl.client.steps == 3
    assert (settings.attacks.budget, settings.output.defense_timeout, settings.lr) == (200, None, 0.05)
