"""The whole iteration as one program (attacks.capture): the same reconstruction as the eager
batched loop, reused across groups of one shape with new weights and targets, padded groups
unchanged, and runs that cannot be captured say why."""
import os
import shutil
from collections import OrderedDict

import pytest
import torch

from attacks import ATTACKS, capture, observe
from audit.core.errors import ConfigError
from audit.core.models import build_model

SHAPE = (3, 8, 8)
pytestmark = pytest.mark.usefixtures("one_thread")


def _group(seed=0, n=2):
    model = build_model("cnn", SHAPE, 4, seed=seed)
    gen = torch.Generator().manual_seed(10 + seed)
    x = torch.rand(n, *SHAPE, generator=gen)
    return [observe(model, x[i:i + 1], torch.tensor([(i + seed) % 4]), seed=i) for i in range(n)]


def _run(obs, budget=8 * 2, **settings):
    return ATTACKS.build("ig", restarts=2, **settings).reconstruct_many(obs, budget, list(range(len(obs))))


def _same(eager, captured, atol=0.0):
    for a, b in zip(eager, captured):
        torch.testing.assert_close(b.inputs, a.inputs, atol=atol, rtol=0)
        for row_a, row_b in zip(a.trace["loss_history"], b.trace["loss_history"]):
            assert row_b == pytest.approx(row_a, rel=1e-5, abs=atol)
        assert b.trace["chosen_restart"] == a.trace["chosen_restart"]
        assert b.trace["optimizer_events"] == a.trace["optimizer_events"]


@pytest.mark.parametrize("budget, settings", [(16, {}), (16, {"keep_best_after": 0.5}), (24, {"lr": 1e-9})],
                         ids=["ig", "restart-selection", "watchdog-recoveries"])
def test_the_captured_iteration_gives_the_eager_loops_reconstruction(budget, settings):
    obs = _group()
    eager = _run(obs, budget, capture="off", **settings)
    captured = _run(obs, budget, capture="eager", **settings)
    assert captured[0].trace["capture"].startswith("eager: capture='eager'; the whole iteration as one program "
                                                   "over 4 member(s)"), captured[0].trace["capture"]
    assert captured[0].trace["gradient_evaluations"] == eager[0].trace["gradient_evaluations"]
    _same(eager, captured)
    if "lr" in settings:  # a stalled loss: the watchdog recovered inside the program
        assert captured[0].trace["optimizer_events"] and "no decrease" in \
            captured[0].trace["optimizer_events"][0]["event"]


def test_the_program_updates_its_state_in_place():
    """A CUDA graph replays on fixed addresses: every buffer the iteration writes stays put."""
    _run(_group(), capture="eager", lr=1e-9)
    program = next(reversed(capture.PROGRAMS.values()))
    buffers = lambda: [*program.optimizer.state().values(), *program.variables]  # noqa: E731
    before = buffers()
    for it in range(10):  # the watchdog recovers on the way (a stalled loss)
        program(1e-9, it)
    assert all(a is b for a, b in zip(buffers(), before)) and int(program.optimizer.recoveries.sum()) > 0


def test_a_kept_program_serves_the_next_group_with_its_own_weights_and_targets():
    first, second = _group(seed=0), _group(seed=1)  # another model's weights, other images
    _run(first, capture="eager")
    built = capture.STATS["built"]
    captured = _run(second, capture="eager")
    assert capture.STATS["built"] == built, "the second group of the same shape built a new program"
    assert captured[0].trace["capture"].endswith("program reused from an earlier run")
    _same(_run(second, capture="off"), captured)


def test_a_padded_group_gives_the_same_images(monkeypatch):
    monkeypatch.setattr(capture.ROUTES.get("eager"), "sizes", (8,))
    obs = _group(n=3)
    padded = _run(obs, capture="eager")
    assert "over 6 member(s) (padded to 8)" in padded[0].trace["capture"]
    _same(_run(obs, capture="off"), padded, atol=1e-5)


def test_runs_that_cannot_be_captured_say_why():
    obs = _group(n=1)
    dlg = ATTACKS.build("dlg", restarts=1, capture="eager").reconstruct(obs[0], 4, 0)
    assert dlg.trace["capture"] == "off: the lbfgs line search accepts or halves each step on the host"
    gi = ATTACKS.build("ig", group=0.01, restarts=2, capture="eager").reconstruct(obs[0], 4, 0)
    assert gi.trace["capture"] == "off: the group-consistency prior changes with the iteration"
    graph = ATTACKS.build("ig", capture="graph").reconstruct(obs[0], 4, 0)
    assert graph.trace["capture"] == "off: route 'graph' needs a CUDA device, the run is on cpu"
    default = ATTACKS.build("ig").reconstruct(obs[0], 4, 0)
    assert default.trace["capture"].startswith("off: capture='auto' captures on CUDA only")


def test_a_capture_that_fails_continues_eagerly_with_the_reason(monkeypatch):
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("no C++ compiler found")
        return call

    monkeypatch.setattr(capture.torch, "compile", broken)
    monkeypatch.setattr(capture, "FAILED", {})  # the failure is this test's own: not kept for the others
    obs = _group(seed=2)
    failed = _run(obs, capture="compiled")
    assert failed[0].trace["capture"] == ("off: capture='compiled'; compiled failed: RuntimeError: "
                                          "no C++ compiler found")
    _same(_run(obs, capture="off"), failed)


def test_a_capture_that_fails_after_its_warm_up_keeps_the_iterations_done(monkeypatch):
    """As a CUDA graph whose capture fails: the warm-up iterations ran on the program's buffers,
    are handed back, and the loop goes on eagerly from there."""
    def refuse(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    eager_route = capture.ROUTES.get("eager")
    monkeypatch.setattr(eager_route, "warmup", 10)
    monkeypatch.setattr(eager_route, "capture", refuse)
    monkeypatch.setattr(capture, "FAILED", {})
    monkeypatch.setattr(capture, "PROGRAMS", OrderedDict())  # a program of its own, warmed up here
    obs = _group(seed=6)
    failed = _run(obs, 24, capture="eager", lr=1e-9)
    assert failed[0].trace["capture"].startswith("off: capture='eager'; eager failed: RuntimeError: operation")
    assert failed[0].trace["optimizer_events"][0]["iteration"] < 10  # logged in the program, handed back
    _same(_run(obs, 24, capture="off", lr=1e-9), failed)


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "c++", "clang++"))


@pytest.mark.slow
@pytest.mark.skipif(not _has_cxx(), reason="checks the torch.compile'd iteration against the eager loop: "
                    "torch.compile's CPU backend needs a C++ compiler (g++, c++, clang++ or $CXX)")
def test_the_compiled_iteration_matches_and_compiles_once_per_shape():
    from torch._dynamo.utils import counters

    first, second = _group(seed=3), _group(seed=4)
    _same(_run(first, capture="off"), _run(first, capture="compiled"), atol=1e-4)
    compiled, graphs = capture.STATS["compiled"], counters["stats"]["unique_graphs"]
    again = _run(second, capture="compiled")
    assert capture.STATS["compiled"] == compiled and counters["stats"]["unique_graphs"] == graphs
    _same(_run(second, capture="off"), again, atol=1e-4)


def test_the_knob_takes_on_and_off_as_the_command_line_parses_them():
    assert [ATTACKS.build("ig", capture=v).capture for v in (True, False, "graph")] == ["on", "off", "graph"]
    with pytest.raises(ConfigError, match="capture must be one of"):
        ATTACKS.build("ig", capture="sometimes")
