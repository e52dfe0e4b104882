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
JUDGED = {"leaks", "partially", "no recovered image"}
SMALL = dict(images=1, budget=20, attacks="ig", seed=0)


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

    flower_app = app()[0]
    state, ctx = initial_state(), context()
    msg = train_message(state, 1)
    after = arrays(flower_app.client_app()(msg, ctx))  # the client's own update, no mod
    grads = one_step_gradient(state, after, flower_app.LR)
    update_norm = math.sqrt(sum(float((flower_app.LR * g).pow(2).sum()) for g in grads))
    assert (update_norm > clipping_norm) == (clipping_norm < 1)

    dp = LocalDpMod(clipping_norm=clipping_norm, sensitivity=0.05, epsilon=10.0, delta=1e-5)
    np.random.seed(5)
    flower_out = arrays(flower_app.client_app([dp])(train_message(state, 1), ctx))
    spec, args = flower_defense(dp, msg, flower_app.LR)
    mirror = build_defense(spec, **args)
    std = 0.05 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 10.0  # LocalDpMod's noise on the update
    assert mirror.noise_std == pytest.approx(std, rel=1e-12)

    # Flower's output is the old state + our clipped update + the noise Flower drew with that seed
    clipped = build_defense("flower-fixedclipping", clipping_norm=clipping_norm, lr=flower_app.LR).transform(grads)
    np.random.seed(5)
    drawn = [torch.from_numpy(np.random.normal(0, std, tuple(g.shape)).astype(np.float32)) for g in grads]
    for (key, old), c, n in zip(state.items(), clipped, drawn):
        assert torch.allclose(flower_out[key], old - flower_app.LR * c + n, atol=2e-6, rtol=0)

    # our noise, in update units, has Flower's std; its log_prob is that Gaussian's density
    shared = mirror.transform(grads, generator=torch.Generator().manual_seed(0))
    residual = torch.cat([(flower_app.LR * (s - c)).flatten() for s, c in zip(shared, clipped)]).double()
    assert abs(float(residual.std()) / std - 1) < 0.02 and abs(float(residual.mean())) < 0.02 * std
    # the same draws inside a vmapped program (vmap_draws: EOT attacks batch them), independent per member
    bias = grads[1]  # the first layer's 16 biases, as a gradient of their own, 64 draws
    first = torch.func.vmap(lambda g: mirror.transform([g], generator=VMAP_DRAWS)[0], randomness="different")(
        torch.stack([bias] * 64))
    alone = build_defense("flower-fixedclipping", clipping_norm=clipping_norm, lr=flower_app.LR).transform([bias])
    noise = flower_app.LR * (first - alone[0]).double()
    assert abs(float(noise.std()) / std - 1) < 0.15 and not torch.equal(noise[0], noise[1])
    scale, shared, grads = std / flower_app.LR, [t.double() for t in shared], [g.double() for g in grads]
    clipped = build_defense("flower-fixedclipping", clipping_norm=clipping_norm, lr=flower_app.LR).transform(grads)
    expected = sum(float((-0.5 * ((s - c) / scale) ** 2 - math.log(scale * math.sqrt(2 * math.pi))).sum())
                   for s, c in zip(shared, clipped))
    assert float(mirror.log_prob(shared, grads)) == pytest.approx(expected, rel=1e-9)


@needs_flwr
@pytest.mark.parametrize("clipping_norm", [0.01, 100.0])
def test_fixedclipping_mirror_reads_the_rounds_norm_and_clips_as_flower_does(clipping_norm):
    from flwr.clientapp.mod import fixedclipping_mod

    from audit.integrations.flower import flower_defense

    flower_app = app()[0]
    state, ctx = initial_state(), context()
    msg = train_message(state, 2, clipping_norm=clipping_norm)
    grads = one_step_gradient(state, arrays(flower_app.client_app()(msg, ctx)), flower_app.LR)
    flower_out = arrays(flower_app.client_app([fixedclipping_mod])(train_message(state, 2, clipping_norm=clipping_norm),
                                                                   ctx))
    spec, args = flower_defense(fixedclipping_mod, msg, flower_app.LR)
    assert (spec, args) == ("flower-fixedclipping", {"clipping_norm": clipping_norm, "lr": flower_app.LR})
    shared = build_defense(spec, **args).transform(grads)
    for (key, old), s in zip(state.items(), shared):
        assert torch.allclose(flower_out[key], old - flower_app.LR * s, atol=1e-6, rtol=0)
    with pytest.raises(ConfigError, match="clipping_norm"):
        flower_defense(fixedclipping_mod, train_message(state, 2), flower_app.LR)


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
    ({"attacks": "ig,no-such-attack"}, "no-such-attack"),
    ({"defense": "flower-localdp", "defense_args": {"epsilon": -1}}, "epsilon"),
    ({"timeout": 0}, "timeout"),
    ({"round": 3}, "unknown AuditMod option(s) round"),
])
def test_bad_mod_options_are_one_line_errors(options, fragment):
    from audit.integrations.flower import AuditMod

    flower_app = app()[0]
    base = dict(rounds=[1], model=flower_app.Net, data=flower_app.client_data)
    with pytest.raises(ConfigError) as err:
        AuditMod(**{**base, **options})
    assert fragment in str(err.value) and "\n" not in str(err.value)


@needs_flwr
def test_defense_args_do_not_apply_to_a_flower_mod_and_a_class_count_is_asked_for():
    from flwr.clientapp.mod import LocalDpMod

    from audit.integrations.flower import AuditMod

    flower_app = app()[0]
    dp = LocalDpMod(1.0, 1.0, 1.0, 1e-5)
    with pytest.raises(ConfigError, match="read from the mod itself"):
        AuditMod(rounds=[1], model=flower_app.Net, data=flower_app.client_data, defense=dp, defense_args={"lr": 1})

    def factory(num_classes):
        return flower_app.Net()

    with pytest.raises(ConfigError, match="num_classes="):
        AuditMod(rounds=[1], model=factory, data=flower_app.client_data)


# --------------------------------------------------------------------------- one round, inline
@needs_flwr
def test_an_inline_round_audits_the_deployments_localdp_and_reports_its_privacy(tmp_path):
    from flwr.clientapp.mod import LocalDpMod

    flower_app = app()[0]
    dp = LocalDpMod(clipping_norm=0.05, sensitivity=0.05, epsilon=2.0, delta=1e-5)
    mod = flower_app.audit_mod(str(tmp_path), audited=[2], localdp=dp, blocking=True, **SMALL)
    state, ctx = initial_state(), context()
    np.random.seed(3)
    audited_reply = flower_app.client_app([mod, dp])(train_message(state, 2), ctx)
    np.random.seed(3)
    plain_reply = flower_app.client_app([dp])(train_message(state, 2), ctx)
    assert all(torch.equal(a, b) for a, b in zip(arrays(audited_reply).values(), arrays(plain_reply).values()))

    folder = tmp_path / "partition-0" / "round-2"
    assert json.loads((folder / "audit.json").read_text())["state"] == "finished"
    report = json.loads((folder / "report.json").read_text())
    assert report["step_name"] == "round" and [s["step"] for s in report["steps"]] == [2]
    assert report["defense"]["params"]["clipping_norm"] == 0.05 and report["defense"]["name"] == "flower-localdp"
    z = 0.05 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 2.0 / (2 * 0.05)  # noise std / (2 x clipping norm)
    privacy = report["privacy"]
    assert privacy["applicable"] and privacy["noise_multiplier"] == pytest.approx(z)
    assert privacy["per_step"][0]["rounds"] == 2
    assert privacy["per_step"][0]["epsilon"] == pytest.approx(privacy_spent(2, 1.0, z, 1e-5).epsilon, rel=1e-9)
    assert privacy["identification_bound"]["bound"] == pytest.approx(identification_bound(1 / 64, z), rel=1e-9)
    combined = (tmp_path / "partition-0" / "report.md").read_text()
    assert "| audited round | noised updates spent |" in combined and "## Leakage per federation round" in combined


# --------------------------------------------------------------------------- failures read incomplete
@needs_flwr
def test_a_failed_round_is_incomplete_and_the_client_round_goes_on(tmp_path):
    flower_app = app()[0]

    def too_few(context):
        images, labels = flower_app.client_data(context)
        return images[:10], labels[:10]

    mod = flower_app.AuditMod(rounds=[1], model=flower_app.Net, data=too_few, lr=flower_app.LR, out=str(tmp_path),
                              blocking=True, **SMALL)
    state, ctx = initial_state(), context()
    reply = flower_app.client_app([mod])(train_message(state, 1), ctx)
    plain = flower_app.client_app()(train_message(state, 1), ctx)
    assert all(torch.equal(a, b) for a, b in zip(arrays(reply).values(), arrays(plain).values()))
    status = json.loads((tmp_path / "partition-0" / "round-1" / "audit.json").read_text())
    assert status["state"] == "failed" and "10 images" in status["reason"]
    report = json.loads((tmp_path / "partition-0" / "report.json").read_text())
    assert report["verdict"]["label"] == "incomplete" and "10 images" in report["verdict"]["reason"]
    assert report["status"].startswith("incomplete (round 1: failed")


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
def test_a_flower_simulation_is_audited_per_round_and_its_weights_are_unchanged(tmp_path):
    """Client 0 is audited at rounds 1 and 3; client 1's audit of round 1 runs past a 1 s timeout."""
    from click.testing import CliRunner
    from flwr.simulation import run_simulation

    import cli
    from audit.integrations.flower import wait_for_audits

    flower_app = app()[0]
    out = tmp_path / "audits"

    def client(partition):
        return lambda context: (flower_app.client_data(context) if context.node_config["partition-id"] == partition
                                else None)

    common = dict(model=flower_app.Net, lr=flower_app.LR, out=str(out), **SMALL)
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
    assert [r["round"] for r in report["rounds"]] == [1, 3]
    for step in report["steps"]:  # each round's images are in its own folder, linked from the report
        assert (out / "partition-0" / step["originals"] / "i0.png").is_file()
    assert "## Leakage per federation round" in (out / "partition-0" / "report.md").read_text()
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
