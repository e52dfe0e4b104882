"""Fault injection: a corrupt store, a failing disk, user code that exits or interrupts, a
defense that never returns, an interrupt between a group's writes, hostile names, the Flower
mod's own file writes. Each fault ends in one line naming the file and the fix, or in the
recomputation of what was lost; nothing claims more than what is stored."""
import errno
import inspect
import json
import os
import shutil
import sys

import pytest
import torch
from click.testing import CliRunner

import audit
import cli
from audit.core.types import clean_gradients
from audit.report.store import ResultStore
from test_flower import task_identity  # noqa: F401  (Flower messages made outside its runtime)
from test_sweep import local_ray  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model="mlp", model_args={"hidden": 32}, image_size=16, budget=5, utility=False, progress=False,
            defense="none", steps=[0], attacks=["analytic"], images=2)


def _psnrs(out):
    return {(r.step, r.attack_id, r.image): r.metrics.psnr for r in ResultStore.open_latest(out).records()}


def _one_line_error(result, *words):
    """A CLI result that failed with exit status 2 and one line naming ``words``, no traceback."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny audit (2 images, analytic) and its scores."""
    out = tmp_path_factory.mktemp("finished")
    audit.run(out=out, **TINY)
    return out, _psnrs(out)


# --------------------------------------------------------------------------- a corrupt store
CORRUPTIONS = {
    "truncated": lambda text: text[: len(text) // 2],
    "a list": lambda text: "[]",
    "null metrics": lambda text: json.dumps({**json.loads(text), "metrics": None}),
    "no step": lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "step"}),
    "not utf-8": lambda text: "\udcff",
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupt_result_is_reported_as_lost_then_recomputed(finished, tmp_path, kind):
    src, expected = finished
    out = tmp_path / "out"
    shutil.copytree(src, out)
    store = ResultStore.open_latest(out)
    path = store.result_path(0, "analytic", 1)
    text = path.read_text()
    path.write_bytes(CORRUPTIONS[kind](text).encode("utf-8", "surrogateescape"))

    result = CliRunner().invoke(cli.main, ["report", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["status"].startswith("incomplete"), report["status"]
    assert any(str(path) in f["error"] for f in report["failures"])
    assert report["progress"]["done"] == 1

    again = audit.run(out=out, **TINY)  # the lost result is recomputed, the other one reused
    assert again.data["status"] == "complete"
    assert _psnrs(out) == expected
    assert any(f.get("status") == "recomputed" and f.get("image") == 1 for f in again.data["failures"])


def test_a_corrupt_manifest_is_one_line_for_report_and_rebuilt_by_the_rerun(finished, tmp_path):
    src, expected = finished
    out = tmp_path / "out"
    shutil.copytree(src, out)
    manifest = ResultStore.open_latest(out).manifest_path
    manifest.write_text(manifest.read_text()[:200])
    _one_line_error(CliRunner().invoke(cli.main, ["report", str(out)]), str(manifest), "rerun")
    again = audit.run(out=out, **TINY)
    assert again.data["status"] == "complete" and _psnrs(out) == expected
    assert json.loads(manifest.read_text())["status"] == "complete"


def test_a_manifest_missing_what_the_report_needs_is_one_line(finished, tmp_path):
    src, _ = finished
    out = tmp_path / "out"
    shutil.copytree(src, out)
    manifest = ResultStore.open_latest(out).manifest_path
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items() if k != "risk_delta"}))
    _one_line_error(CliRunner().invoke(cli.main, ["report", str(out)]), str(manifest), "risk_delta", "rerun")


def test_a_truncated_checkpoint_is_retrained(tmp_path):
    settings = {**TINY, "steps": [1], "images": 1}
    first = audit.run(out=tmp_path, **settings)
    store = ResultStore.open_latest(tmp_path)
    ckpt = store.checkpoint_path(1)
    ckpt.write_bytes(ckpt.read_bytes()[:100])
    for path in store.dir.glob("results/*.json"):
        path.unlink()
    again = audit.run(out=tmp_path, **settings)
    assert again.psnr(1, "analytic") == first.psnr(1, "analytic")
    assert torch.load(ckpt, weights_only=True)  # written again, whole


@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_a_run_key_is_a_name_never_a_path(finished, tmp_path, escape):
    """``--run`` and ``latest_run`` never reach a run outside DIR/runs, here another folder's."""
    src, _ = finished
    out, other = tmp_path / "out", tmp_path / "other"
    shutil.copytree(src, out)
    shutil.copytree(src, other)
    target = ResultStore.open_latest(other).dir
    key = "../../other/runs/" + target.name if escape == "relative" else str(target)
    _one_line_error(CliRunner().invoke(cli.main, ["report", str(out), "--run", key]), "not found")
    (out / "latest_run").write_text(key)
    _one_line_error(CliRunner().invoke(cli.main, ["report", str(out)]), "not found")


# --------------------------------------------------------------------------- disk and permissions
@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="a read-only folder cannot be made as root (root writes through the permission bits): run the suite as an ordinary user to check it")
def test_a_read_only_output_folder_is_one_line(tmp_path):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        result = CliRunner().invoke(cli.main, ["audit", "--model", "mlp", "--model-arg", "hidden=32", "--image-size",
                                               "16", "--steps", "0", "--attacks", "analytic", "--images", "1",
                                               "--budget", "5", "--no-utility", "--quiet", "--out", str(out)])
    finally:
        out.chmod(0o700)
    _one_line_error(result, str(out))


def test_an_output_path_under_a_file_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(cli.main, ["audit", "--model", "mlp", "--model-arg", "hidden=32", "--image-size", "16",
                                           "--steps", "0", "--attacks", "analytic", "--images", "1", "--budget", "5",
                                           "--no-utility", "--quiet", "--out", str(blocker / "out")])
    _one_line_error(result, str(blocker))


def test_a_report_path_that_is_a_folder_is_one_line(finished, tmp_path):
    src, _ = finished
    out = tmp_path / "out"
    shutil.copytree(src, out)
    (out / "report.html").unlink()
    (out / "report.html").mkdir()
    (out / "report.html" / "x").write_text("keeps the folder non-empty")
    _one_line_error(CliRunner().invoke(cli.main, ["report", str(out)]), "report.html")


def test_a_full_disk_stops_with_one_line_no_temporary_file_and_a_manifest_not_running(tmp_path, monkeypatch):
    import audit.core.files as files

    real_open, writes = open, {"n": 0}

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".tmp") and "results" in str(path):
            writes["n"] += 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    args = ["audit", "--model", "mlp", "--model-arg", "hidden=32", "--image-size", "16", "--steps", "0", "--attacks",
            "analytic", "--images", "1", "--budget", "5", "--no-utility", "--quiet", "--out", str(tmp_path)]
    assert CliRunner().invoke(cli.main, args + ["--seed", "1"]).exit_code == 0  # an older, complete run's report
    assert (tmp_path / "report.json").is_file()
    monkeypatch.setattr(files, "open", full_disk, raising=False)
    result = CliRunner().invoke(cli.main, args)
    assert writes["n"] >= 1
    assert not (tmp_path / "report.json").exists()  # the stopped run leaves no report claiming more than is stored
    _one_line_error(result, "No space left on device", "results")
    assert not list(tmp_path.rglob("*.tmp"))
    status = json.loads(ResultStore.open_latest(tmp_path).manifest_path.read_text())["status"]
    assert status.startswith("stopped") and "No space left" in status


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path):
    from audit.core.errors import StoreError
    from audit.core.files import atomic_write_bytes

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "x").write_text("a non-empty folder cannot be replaced by a file")
    with pytest.raises(StoreError, match="target"):
        atomic_write_bytes(tmp_path / "target", b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


# --------------------------------------------------------------------------- a group cut between writes
def test_a_group_cut_between_its_writes_is_redone_whole_with_the_same_numbers(tmp_path, monkeypatch):
    from audit.engine import runner

    settings = {**TINY, "attacks": ["ig"], "images": 3}
    audit.run(out=tmp_path / "whole", **settings)
    expected = _psnrs(tmp_path / "whole")

    real_save, groups = ResultStore.save_result, []

    def cut_after_first(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(ResultStore, "save_result", cut_after_first)
    with pytest.raises(KeyboardInterrupt):
        audit.run(out=tmp_path / "cut", **settings)
    monkeypatch.setattr(ResultStore, "save_result", real_save)
    assert len(list((tmp_path / "cut").glob("runs/*/results/*.json"))) == 1

    real_group = runner.attack_group
    monkeypatch.setattr(runner, "attack_group", lambda run, spec, group, *a, **k: (
        groups.append([g[0] for g in group]), real_group(run, spec, group, *a, **k))[1])
    audit.run(out=tmp_path / "cut", **settings)
    assert groups == [[0, 1, 2]]  # the whole group again, not the two it missed
    assert _psnrs(tmp_path / "cut") == expected


# --------------------------------------------------------------------------- user code that ends things
def _ends_at_round_1(how):
    def defense(model, inputs, labels, *, loss_fn, generator, round=None):
        if round == 1:
            how()
        return clean_gradients(model, inputs, labels, loss_fn)

    defense.__name__ = defense.__qualname__ = "ends_" + how.__name__
    return defense


def _exit0():
    sys.exit(0)


def _ctrl_c():
    raise KeyboardInterrupt


def _generator_exit():
    raise GeneratorExit


@pytest.mark.parametrize("how", [_exit0, _ctrl_c, _generator_exit], ids=["sys.exit(0)", "KeyboardInterrupt",
                                                                          "GeneratorExit"])
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["inline", "worker"])
def test_a_defense_that_exits_is_its_failure_not_the_audits(tmp_path, how, timeout):
    report = audit.run(out=tmp_path, **{**TINY, "defense": _ends_at_round_1(how), "steps": [0, 1], "images": 1,
                                        "defense_timeout": timeout})
    assert report.step(0)["verdict"]["label"] == "leaks"
    assert report.step(1)["verdict"]["label"] == "incomplete"
    (failure,) = report.failures
    assert f"ends_{how.__name__}" in failure["error"] and "never end the process" in failure["error"]
    assert json.loads(ResultStore.open_latest(tmp_path).manifest_path.read_text())["status"] == "complete"


def test_a_defense_that_exits_makes_the_audit_command_exit_non_zero(tmp_path, monkeypatch):
    (tmp_path / "exiting.py").write_text(
        "import sys\nfrom audit.core.types import clean_gradients\n"
        "def defense(model, inputs, labels, *, loss_fn, generator, round=None):\n"
        "    if round == 1:\n        sys.exit(0)\n    return clean_gradients(model, inputs, labels, loss_fn)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(cli.main, ["audit", "--defense", "exiting:defense", "--model", "mlp", "--model-arg",
                                           "hidden=32", "--image-size", "16", "--steps", "0,1", "--attacks", "analytic",
                                           "--images", "1", "--no-utility", "--quiet", "--out", str(tmp_path / "out")])
    assert result.exit_code == cli.INCOMPLETE_EXIT, result.output
    assert "incomplete" in result.output and (tmp_path / "out" / "report.json").is_file()


@pytest.fixture
def ctrl_c_delivered():
    """Ctrl-C reaches the process as a terminal delivers it: Python's own handler, whatever an
    earlier test's libraries left installed in this worker (an ignored SIGINT is inherited by the
    audit's subprocess too); the previous handler restored afterwards."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_users_own_ctrl_c_still_stops_a_defense_call(ctrl_c_delivered):
    import signal
    import time

    from audit.core.defense_call import user_code

    with pytest.raises(KeyboardInterrupt):
        with user_code("slow"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_during_a_defense_call_interrupts_the_audit_command(tmp_path, ctrl_c_delivered):
    """A real SIGINT to ``gia-audit audit`` while its defense runs: the audit stops (not a
    defense failure), status 'interrupted', the finished step-0 result kept."""
    import signal
    import subprocess
    import time

    marker = tmp_path / "in-round-1"
    (tmp_path / "slowdef.py").write_text(
        "import pathlib, time\nfrom audit.core.types import clean_gradients\n"
        "def slow(model, inputs, labels, *, loss_fn, generator, round=None):\n"
        f"    if round == 1:\n        pathlib.Path({str(marker)!r}).touch()\n        time.sleep(60)\n"
        "    return clean_gradients(model, inputs, labels, loss_fn)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "cli.py", "audit", "--defense", "slowdef:slow", "--model", "mlp",
                             "--model-arg", "hidden=32", "--image-size", "16", "--steps", "0,1", "--attacks",
                             "analytic", "--images", "1", "--no-utility", "--quiet", "--out", str(tmp_path / "out")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate()[0]
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode != 0, output
    manifest = json.loads(ResultStore.open_latest(tmp_path / "out").manifest_path.read_text())
    assert manifest["status"] == "interrupted"


# --------------------------------------------------------------------------- a defense that never returns
def test_the_default_defense_timeout_is_finite_and_far_above_the_slowest_built_in_call():
    import re

    from audit.core.defense_call import DEFAULT_DEFENSE_TIMEOUT
    from audit.engine.config import AuditConfig
    from audit.engine.settings import OutputSettings

    assert OutputSettings().defense_timeout == DEFAULT_DEFENSE_TIMEOUT < float("inf")
    assert AuditConfig().defense_timeout == DEFAULT_DEFENSE_TIMEOUT
    page = open(os.path.join(os.path.dirname(__file__), "..", "docs", "performance.md")).read()
    table = page.split("<!-- bench:defenses:begin -->")[1].split("<!-- bench:defenses:end -->")[0]
    header = next(line for line in table.splitlines() if line.startswith("| defense"))
    ms_columns = [i for i, cell in enumerate(header.split("|")) if cell.strip().endswith(" ms")]
    slowest = max(float(line.split("|")[i]) for line in table.splitlines()
                  if line.startswith("| ") and not line.startswith("| defense") for i in ms_columns)
    assert slowest > 1000  # the table was read (SOTERIA on ResNet-18 takes seconds)
    assert DEFAULT_DEFENSE_TIMEOUT >= 10 * slowest / 1000
    help_text = CliRunner().invoke(cli.main, ["audit", "--help"]).output
    assert re.search(rf"default:\s+{DEFAULT_DEFENSE_TIMEOUT:g}\b", help_text), help_text


# --------------------------------------------------------------------------- the Flower mod
def test_no_file_write_of_the_flower_mod_can_fail_the_clients_round(tmp_path, monkeypatch):
    """A full disk from the k-th file write of the mod on, for every k: the client's reply
    comes back unchanged (the round goes on); what could not be recorded is a log line."""
    pytest.importorskip("flwr", reason="runs the Flower client mod on a full disk: needs the [flower] extra "
                                       "(pip install -e \".[flower]\")")
    from pathlib import Path

    import audit.core.files as files
    from test_flower import app, context, initial_state, train_message

    flower_app = app()[0]
    real_open, real_mkdir = open, Path.mkdir
    writes = {"n": 0, "fail_from": None}

    def count(path):
        writes["n"] += 1
        if writes["fail_from"] is not None and writes["n"] >= writes["fail_from"]:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

    def write_open(path, mode="r", *args, **kwargs):
        if "w" in mode or "a" in mode:
            count(path)
        return real_open(path, mode, *args, **kwargs)

    def mkdir(self, *args, **kwargs):
        count(self)
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(files, "open", write_open, raising=False)
    monkeypatch.setattr(Path, "mkdir", mkdir)

    def one_round(out, round_):
        mod = flower_app.AuditMod(rounds=[1, 2], model=flower_app.Net, data=flower_app.client_data, out=str(out),
                                  blocking=True, budget=5, attacks="ig", seed=0)
        client = flower_app.client_app([mod])
        return client(train_message(initial_state(), round_), context())

    one_round(tmp_path / "clean", 2)  # the data lacks the trained rows: a failed round, recorded and logged
    writes["n"] = 0
    clean = one_round(tmp_path / "clean", 2)
    total = writes["n"]
    assert total >= 4 and not clean.has_error()
    writes["n"] = 0
    one_round(tmp_path / "earlier", 2)  # an earlier failed round, its outcome to log
    for k in range(1, total + 1):
        out = tmp_path / f"fail-{k}"
        shutil.copytree(tmp_path / "earlier", out)
        writes["n"], writes["fail_from"] = 0, k
        reply = one_round(out, 2)
        assert not reply.has_error(), (k, reply.error)
        assert set(reply.content["arrays"].to_torch_state_dict()) == set(initial_state())


# --------------------------------------------------------------------------- hostile names
def test_math_text_in_a_defense_name_does_not_break_the_report(tmp_path):
    def defense(model, inputs, labels, *, loss_fn, generator):
        return clean_gradients(model, inputs, labels, loss_fn)

    defense.__name__ = defense.__qualname__ = r"my$\frac{$defense"
    report = audit.run(out=tmp_path, **{**TINY, "defense": defense, "images": 1})
    assert report.data["defense"]["name"] == r"my$\frac{$defense"
    png = (tmp_path / "psnr_vs_step.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
    result = CliRunner().invoke(cli.main, ["report", str(tmp_path)])
    assert result.exit_code == 0, result.output


def test_user_strings_in_report_md_are_text_not_html(tmp_path):
    def defense(model, inputs, labels, *, loss_fn, generator):
        return clean_gradients(model, inputs, labels, loss_fn)

    defense.__name__ = defense.__qualname__ = "<img src=x onerror=alert(1)>"
    audit.run(out=tmp_path, **{**TINY, "defense": defense, "images": 1})
    text = (tmp_path / "report.md").read_text()
    assert "&lt;img src=x onerror=alert(1)>" in text and "<img" not in text


# --------------------------------------------------------------------------- concurrent writers
def _add_fields(root, key, tag, n):
    store = ResultStore(root, key)
    for i in range(n):
        store.update_manifest(**{f"{tag}{i}": i})


def test_processes_updating_one_manifest_lose_no_field(tmp_path):
    import multiprocessing

    store = ResultStore.create(tmp_path, {"x": 1})
    store.update_manifest(status="running")
    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_add_fields, args=(tmp_path, store.key, tag, 60)) for tag in "ab"]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    manifest = json.loads(store.manifest_path.read_text())
    assert {f"{t}{i}" for t in "ab" for i in range(60)} <= set(manifest)


def _add_status_fields(folder, tag, n):
    from audit.integrations.flower.job import write_status

    for i in range(n):
        write_status(folder, **{f"{tag}{i}": i})


def test_processes_updating_one_flower_status_lose_no_field(tmp_path):
    """The mod and a round's own process both merge fields into the round's status file."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    workers = [ctx.Process(target=_add_status_fields, args=(tmp_path, tag, 60)) for tag in "ab"]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    status = json.loads((tmp_path / "audit.json").read_text())
    assert {f"{t}{i}" for t in "ab" for i in range(60)} <= set(status)


# --------------------------------------------------------------------------- a sweep on Ray
def test_ray_tasks_compute_on_the_drivers_thread_count(local_ray):
    """A Ray task's float sums (and the ties magnitude pruning breaks by them) match a local
    run's only on the same intra-op thread count: a task runs on the driver's, whatever CPUs it
    requests (a local sweep on 2 threads and a Ray one on 1 gave prune 0.5's mask-replay 26.44
    vs 26.28 dB)."""
    from audit.engine.executors import RayExecutor

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = {}
        executor = RayExecutor(cpus=1)
        executor.map(lambda job, shared: __import__("torch").get_num_threads(), [0, 1],  # pickled by value
                     lambda index, value: got.update({index: value}))
    finally:
        torch.set_num_threads(threads)
    assert got == {0: 2, 1: 2}
    assert RayExecutor(threads=3).threads == 3


def test_an_abandoned_defense_call_ends_its_thread_when_it_returns():
    """A call past its timeout is abandoned; once it returns its worker thread ends (a thread
    still alive would refuse every later CUDA graph capture), and the next call gets a new one."""
    import time

    from audit.core.defense_call import _with_timeout, abandoned_calls
    from audit.core.errors import DefenseError

    with pytest.raises(DefenseError, match="did not return within"):
        _with_timeout(lambda: time.sleep(0.4), "late", 0.05)
    assert abandoned_calls() == ["defense-late"]
    assert _with_timeout(lambda: 7, "next", 5.0) == 7
    deadline = time.time() + 10
    while abandoned_calls() and time.time() < deadline:
        time.sleep(0.05)
    assert abandoned_calls() == []


RACER = """
import os, sys, time
from pathlib import Path
import audit
from audit.engine import runner
folder = Path(sys.argv[1])
real = runner.attack_group

def logged(run, spec, group, step, *args, **kwargs):
    with open(folder / "groups.log", "a") as fh:
        fh.write(f"{os.getpid()} {step} {spec.id}\\n")
    time.sleep(1.5)  # long enough for the other process to reach the same group
    return real(run, spec, group, step, *args, **kwargs)

runner.attack_group = logged
(folder / f"ready-{os.getpid()}").touch()
while not (folder / "go").exists():
    time.sleep(0.02)
audit.run(out=folder / "out", model="mlp", model_args={"hidden": 32}, image_size=16, budget=5, utility=False,
          progress=False, defense="none", steps=[0], attacks=["ig", "analytic"], images=2)
"""


def test_two_identical_audits_into_one_folder_attack_each_group_once(tmp_path):
    import subprocess
    import time

    (tmp_path / "racer.py").write_text(RACER)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "racer.py"), str(tmp_path)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    deadline = time.time() + 120
    while len(list(tmp_path.glob("ready-*"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    for proc in procs:
        assert proc.wait(180) == 0, proc.stdout.read().decode()[-2000:]
    groups = [line.split()[1:] for line in (tmp_path / "groups.log").read_text().splitlines()]
    assert sorted(map(tuple, groups)) == [("0", "analytic"), ("0", "ig")]  # each group once, by either process
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["progress"] == {"done": 4, "total": 4}
