"""The cuda path: the same attack, plan and audit numbers on a GPU as on the CPU (within
float tolerance), and the captured iteration (CUDA graphs) as the eager loop. Skipped where no
GPU is present."""
import os
import re
import shutil
import sysconfig
from collections import OrderedDict

import pytest
import torch

import adaptive
import audit
from attacks import ATTACKS, capture, observe
from attacks.search_space import ClampBox
from audit.core.metrics import psnr
from audit.core.models import build_model
from audit.report.reasons import word
from defenses import build_defense

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="compares cpu with cuda results and the captured iteration (CUDA graphs) "
                                       "with the eager loop: runs where a CUDA GPU is present")
SHAPE = (3, 16, 16)


def _batch(n=3):
    gen = torch.Generator().manual_seed(0)
    return torch.rand(n, *SHAPE, generator=gen), torch.tensor([0, 1, 2][:n])


@pytest.mark.parametrize("model_name", ["cnn"])  # (train-mode BatchNorm models diverge further: docs/performance.md)
def test_grouped_ig_on_cuda_recovers_what_it_recovers_on_cpu(model_name):
    x, y = _batch()
    scores = {}
    for device in ("cpu", "cuda"):
        model = build_model(model_name, SHAPE, 4, seed=0).to(device)
        obs = [observe(model, x[i:i + 1].to(device), y[i:i + 1].to(device), seed=i) for i in range(3)]
        recs = ATTACKS.build("ig").reconstruct_many(obs, 60, [0, 1, 2])
        assert all(r.inputs.device.type == device for r in recs)
        scores[device] = [float(psnr(r.inputs.cpu(), x[i:i + 1])) for i, r in enumerate(recs)]
    for cpu, cuda in zip(scores["cpu"], scores["cuda"]):
        assert abs(cpu - cuda) < 1.0, scores


@pytest.mark.parametrize("defense", ["prune", "gaussian", "soft-prune", "censor", "none"])
def test_the_plan_does_not_depend_on_the_device(defense):
    plans = {device: adaptive.plan(build_defense(defense), None, (3, 8, 8), 10, seed=0, device=torch.device(device))
             for device in ("cpu", "cuda")}
    assert [a.name for a in plans["cpu"].attacks] == [a.name for a in plans["cuda"].attacks]


def test_audit_on_cuda_matches_the_cpu_audit(tmp_path):
    kwargs = dict(defense="prune", steps=[0, 2], attacks="auto", images=2, model="cnn", image_size=16,
                  budget=40, utility=False, progress=False, seed=0)
    cpu = audit.run(out=tmp_path / "cpu", device="cpu", **kwargs)
    cuda = audit.run(out=tmp_path / "cuda", device="cuda", **kwargs)
    assert [a["id"] for a in cpu.data["attacks"]] == [a["id"] for a in cuda.data["attacks"]]
    for step in (0, 2):
        assert abs(cpu.psnr(step) - cuda.psnr(step)) < 1.0


@pytest.fixture(autouse=True)
def fresh_programs(monkeypatch):
    """Each test builds its own programs: none kept from another test, none of its own kept after."""
    monkeypatch.setattr(capture, "PROGRAMS", OrderedDict())
    monkeypatch.setattr(capture, "FAILED", {})
    monkeypatch.setattr(capture, "STATS", dict.fromkeys(capture.STATS, 0))


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic kernels: the eager and the captured run then add in one order."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _cuda_group(n, seed=0, model="cnn", mode="train", defense=None, **model_args):
    net = build_model(model, SHAPE, 4, seed=seed, **model_args).to("cuda")
    x = torch.rand(n, *SHAPE, generator=torch.Generator().manual_seed(seed)).to("cuda")
    return [observe(net, x[i:i + 1], torch.tensor([(i + seed) % 4], device="cuda"), defense, seed=i,
                    client_mode=mode) for i in range(n)], x.cpu()


def _ig(obs, budget, attack="ig", **settings):
    return ATTACKS.build(attack, **settings).reconstruct_many(obs, budget, list(range(len(obs))))


def _close(eager, captured, atol=1e-4):
    for a, b in zip(eager, captured):
        torch.testing.assert_close(b.inputs, a.inputs, atol=atol, rtol=0)
        assert b.trace["optimizer_events"] == a.trace["optimizer_events"]


def test_the_replayed_graph_gives_the_eager_loops_images(deterministic_cudnn):
    obs, _ = _cuda_group(8)  # 8 observations: no padding, the same kernels as the eager loop
    eager, graph = _ig(obs, 40, capture="off"), _ig(obs, 40, capture="graph")
    trace = word(graph[0].trace["capture"])
    assert trace.startswith("graph: capture='graph'; the whole iteration as one program over 8 member(s)"), trace
    assert "37 iteration(s) replayed, 3 run to warm up" in trace
    _close(eager, graph)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_replayed_resnet_with_batchnorm_gives_the_eager_loops_images(deterministic_cudnn, mode):
    obs, _ = _cuda_group(4, seed=1, model="resnet18", mode=mode, width=8)
    eager, graph = _ig(obs, 20, capture="off"), _ig(obs, 20, capture="graph")
    assert word(graph[0].trace["capture"]).startswith("graph: capture='graph'"), word(graph[0].trace["capture"])
    _close(eager, graph, atol=1e-3)


def test_a_padded_graph_recovers_what_the_eager_loop_recovers(deterministic_cudnn):
    obs, x = _cuda_group(3)  # 3 observations x 2 restarts, padded to 4 x 2
    eager, graph = _ig(obs, 2 * 40, restarts=2, capture="off"), _ig(obs, 2 * 40, restarts=2, capture="graph")
    assert "over 6 member(s) (padded to 8)" in word(graph[0].trace["capture"])
    for i, (a, b) in enumerate(zip(eager, graph)):
        assert abs(float(psnr(a.inputs.cpu(), x[i:i + 1])) - float(psnr(b.inputs.cpu(), x[i:i + 1]))) < 1.0


def test_restart_selection_inside_a_replayed_run(deterministic_cudnn):
    obs, _ = _cuda_group(2, seed=4)
    settings = dict(restarts=2, keep_best_after=0.5)
    eager, graph = _ig(obs, 2 * 30, capture="off", **settings), _ig(obs, 2 * 30, capture="graph", **settings)
    for a, b in zip(eager, graph):
        assert b.trace["restart_selection"]["kept"] == a.trace["restart_selection"]["kept"]
    assert capture.STATS["built"] == 1, "the restart selection built a second program"
    _close(eager, graph)


def test_programs_over_the_reserved_memory_limit_are_dropped_and_their_memory_returned(monkeypatch):
    cuda = torch.device("cuda")
    _ig(_cuda_group(2, seed=6)[0], 20, capture="graph")  # the allocator's, cuBLAS's and cuDNN's first blocks
    capture.release(cuda)
    start = torch.cuda.memory_reserved(cuda)
    # any kept program is over the limit: each build drops the ones before and returns their pools
    monkeypatch.setattr(capture, "MEMORY_FRACTION", (start + 1) / torch.cuda.get_device_properties(cuda).total_memory)
    for n in (1, 2, 3, 5):  # padded to 1, 2, 4 and 6 observations: four programs, more than the limit holds
        trace = word(_ig(_cuda_group(n, seed=n)[0], 20, capture="graph")[0].trace["capture"])
        assert trace.startswith("graph: ") and "program built here" in trace, trace
        assert len(capture.PROGRAMS) == 1 and next(iter(capture.PROGRAMS.values())).reserved > 0
    assert capture.STATS["built"] == 5
    capture.release(cuda)
    assert torch.cuda.memory_reserved(cuda) <= start, (torch.cuda.memory_reserved(cuda), start)


def test_a_kept_graph_replays_for_the_next_group_with_its_weights_and_labels(deterministic_cudnn):
    _ig(_cuda_group(8, seed=0)[0], 20, capture="graph")
    captured = capture.STATS["captured"]
    obs, _ = _cuda_group(8, seed=1)  # another model's weights, other images and labels
    again = _ig(obs, 20, capture="graph")
    assert capture.STATS["captured"] == captured
    assert word(again[0].trace["capture"]).endswith("reused from an earlier run")
    _close(_ig(obs, 20, capture="off"), again)


def test_eot_noise_is_drawn_afresh_at_each_replay():
    """Through a noise defense with 4 draws in the program, at a standstill (lr ~ 0): the
    loss moves only with the noise, and moves as much replayed as in the eager loop."""
    obs, _ = _cuda_group(2, seed=2, defense=build_defense("gaussian", sigma=0.05))
    losses = {}
    for route in ("off", "graph"):
        recs = _ig(obs, 30, "through-defense", samples=4, lr=1e-12, capture=route)
        assert "draws in program" in recs[0].trace["settings"]["simulator"]
        losses[route] = torch.tensor(recs[0].trace["loss_history"][0][4:])
    assert len(set(losses["graph"].tolist())) == len(losses["graph"]), "a replay drew the same noise again"
    spread = losses["off"].std()
    assert abs(losses["graph"].std() - spread) < spread and abs(losses["graph"].mean() - losses["off"].mean()) < spread


def test_the_rule_captures_on_cuda_and_says_why_not():
    obs, _ = _cuda_group(2)
    assert word(_ig(obs, 40)[0].trace["capture"]).startswith("graph: 80 member-iterations < ")
    assert word(_ig(obs, 4)[0].trace["capture"]).startswith("off: 4 iteration(s) < ")
    dlg = ATTACKS.build("dlg", restarts=1).reconstruct(obs[0], 20, 0)
    assert word(dlg.trace["capture"]) == "off: the lbfgs line search accepts or halves each step on the host"


def test_a_host_sync_inside_a_capture_falls_back_with_the_stream_restored(monkeypatch, deterministic_cudnn):
    plain = ClampBox.project_

    def project_(self, z):
        float(z.max())  # waits for the device: not permitted while a stream captures
        plain(self, z)

    monkeypatch.setattr(ClampBox, "project_", project_)
    obs, _ = _cuda_group(2, seed=5)
    recs = _ig(obs, 20, capture="graph")
    trace = word(recs[0].trace["capture"])
    # torch names the error RuntimeError or, from 2.9 on, its subclass AcceleratorError
    assert re.match(r"off: capture='graph'; graph failed: (RuntimeError|AcceleratorError): ", trace), trace
    assert "operation not permitted when stream is capturing" in trace, trace
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.randn(4, device="cuda")  # the generator left capture mode: a later random draw works
    assert recs[0].trace["iterations"] == 20
    _close(_ig(obs, 20, capture="off"), recs)


def _triton_cannot_build() -> str:
    """What Triton lacks to build its kernels' launchers here ('' when nothing)."""
    missing = [] if any(shutil.which(c) for c in (os.environ.get("CC") or "cc", "gcc", "clang")) else \
        ["a C compiler (cc, gcc, clang or $CC)"]
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        missing.append("Python's headers (Python.h)")
    return " and ".join(missing)


@pytest.mark.skipif(bool(_triton_cannot_build()), reason="the compiled graph needs Triton to build its kernels, "
                    f"which needs {_triton_cannot_build()}")
def test_the_compiled_graph_matches_and_compiles_once_per_shape(deterministic_cudnn):
    shape = (3, 8, 8)
    model = build_model("cnn", shape, 4, seed=2).to("cuda")
    x = torch.rand(4, *shape, generator=torch.Generator().manual_seed(2)).to("cuda")

    def group(offset):
        return [observe(model, x[i:i + 1], torch.tensor([(i + offset) % 4], device="cuda"), seed=i) for i in range(2)]

    first = group(0)
    eager, built = _ig(first, 12, capture="off"), _ig(first, 12, capture="compiled-graph")
    said = word(built[0].trace["capture"])
    assert said.startswith("compiled-graph: "), said  # the whole reason
    _close(eager, built, atol=1e-3)
    compiled = capture.STATS["compiled"]
    second = group(1)  # other labels
    again = _ig(second, 12, capture="compiled-graph")
    assert word(again[0].trace["capture"]).startswith("compiled-graph: "), word(again[0].trace["capture"])
    assert capture.STATS["compiled"] == compiled
    _close(_ig(second, 12, capture="off"), again, atol=1e-3)
