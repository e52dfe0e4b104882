"""The whole iteration as one program (attacks.capture): the same reconstruction as the eager
batched loop, reused across groups of one shape with new weights and targets, padded groups
unchanged, and runs that cannot be captured say why."""
import os
import shutil
import threading

import pytest
import torch

from attacks import ATTACKS, capture, observe
from attacks.objectives import build_objective
from attacks.search_space import ClampBox
from audit.core.defense_call import abandoned_calls, defense_timeout, invoke_defense
from audit.core.errors import ConfigError, DefenseError
from audit.core.models import build_model
from audit.report.reasons import word

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
    assert word(captured[0].trace["capture"]).startswith("eager: capture='eager'; the whole iteration as one program "
                                                   "over 4 member(s)"), word(captured[0].trace["capture"])
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
    assert word(captured[0].trace["capture"]).endswith("program reused from an earlier run")
    _same(_run(second, capture="off"), captured)


def test_a_padded_group_gives_the_same_images(monkeypatch):
    monkeypatch.setattr(capture.ROUTES.get("eager"), "sizes", (4,))
    obs = _group(n=3)
    padded = _run(obs, capture="eager")
    assert "over 6 member(s) (padded to 8)" in word(padded[0].trace["capture"])
    _same(_run(obs, capture="off"), padded, atol=1e-5)


def test_runs_that_cannot_be_captured_say_why():
    obs = _group(n=1)
    dlg = ATTACKS.build("dlg", restarts=1, capture="eager").reconstruct(obs[0], 4, 0)
    assert word(dlg.trace["capture"]) == "off: the lbfgs line search accepts or halves each step on the host"
    gi = ATTACKS.build("ig", group=0.01, restarts=2, capture="eager").reconstruct(obs[0], 4, 0)
    assert word(gi.trace["capture"]) == "off: the group-consistency prior changes with the iteration"
    graph = ATTACKS.build("ig", capture="graph").reconstruct(obs[0], 4, 0)
    assert word(graph.trace["capture"]) == "off: route 'graph' needs a CUDA device, the run is on cpu"
    default = ATTACKS.build("ig").reconstruct(obs[0], 4, 0)
    assert word(default.trace["capture"]).startswith("off: capture='auto' captures on CUDA only")


def test_a_capture_that_fails_continues_eagerly_with_the_reason(monkeypatch):
    def broken(fn, **kw):
        def call(*a, **k):
            raise RuntimeError("no C++ compiler found")
        return call

    monkeypatch.setattr(capture.torch, "compile", broken)
    monkeypatch.setattr(capture, "FAILED", {})  # the failure is this test's own: not kept for the others
    obs = _group(seed=2)
    failed = _run(obs, capture="compiled")
    assert word(failed[0].trace["capture"]) == ("off: capture='compiled'; compiled failed: RuntimeError: "
                                          "no C++ compiler found")
    _same(_run(obs, capture="off"), failed)


def test_a_recorded_capture_replays_the_eager_loops_reconstruction(fresh_programs):
    obs = _group(seed=7, n=3)  # padded to 4 observations
    eager, recorded = _run(obs, 24, capture="off", lr=1e-9), _run(obs, 24, capture="recording", lr=1e-9)
    trace = word(recorded[0].trace["capture"])
    assert "over 6 member(s) (padded to 8), 9 iteration(s) replayed, 3 run to warm up" in trace, trace
    assert capture.STATS["captured"] == 1
    _same(eager, recorded, atol=1e-5)


def _project_with(action):
    """ClampBox.project_ doing ``action(z)`` first (the box runs outside vmap: as a GPU would see it)."""
    plain = ClampBox.project_

    def project_(self, z):
        action(z)
        plain(self, z)

    return project_


def test_a_host_sync_inside_the_capture_falls_back_with_the_refusal_and_the_stream_restored(fresh_programs,
                                                                                             monkeypatch):
    monkeypatch.setattr(ClampBox, "project_", _project_with(lambda z: float(z.max())))
    obs = _group(seed=6)
    failed = _run(obs, 24, capture="recording", lr=1e-9)
    trace = word(failed[0].trace["capture"])
    # the refusal itself, not the error of ending the invalidated capture
    assert trace.startswith("off: capture='recording'; recording failed: RuntimeError: operation not permitted "
                            "when stream is capturing (_local_scalar_dense waits for the device)"), trace
    assert "invalidated" not in trace and capture.RECORDING_STREAM == ["default"]
    _same(_run(obs, 24, capture="off", lr=1e-9), failed)


def test_an_error_inside_the_capture_is_recorded_in_full(fresh_programs, monkeypatch):
    def fail_while_capturing(z):
        if capture.RECORDING_STREAM[0] == "capture":
            raise RuntimeError("the first line\nthe second line, which names the cause")

    monkeypatch.setattr(ClampBox, "project_", _project_with(fail_while_capturing))
    obs = _group(seed=8)
    failed = _run(obs, 16, capture="recording")
    assert word(failed[0].trace["capture"]).endswith("recording failed: RuntimeError: the first line\n"
                                                "the second line, which names the cause")
    assert capture.RECORDING_STREAM == ["default"]
    _same(_run(obs, 16, capture="off"), failed)


def test_no_capture_while_an_abandoned_defense_call_runs(fresh_programs):
    release = threading.Event()

    def slow(model, inputs, labels, *, loss_fn, generator):
        release.wait(30)
        return []

    model = build_model("cnn", SHAPE, 4, seed=0)
    with defense_timeout(0.01), pytest.raises(DefenseError, match="abandoned"):
        invoke_defense(slow, model, torch.rand(1, *SHAPE), torch.tensor([0]))
    try:
        assert abandoned_calls() == ["defense-slow"]
        trace = word(_run(_group(seed=9), 16, capture="recording")[0].trace["capture"])
        assert "a defense call abandoned after its timeout still runs on a thread (defense-slow)" in trace, trace
    finally:
        release.set()
    for _ in range(1000):  # the abandoned call returns: its thread ends, and captures run again
        if not abandoned_calls():
            break
        threading.Event().wait(0.01)
    assert abandoned_calls() == []


def test_padding_wastes_at_most_a_quarter_of_a_group(fresh_programs):
    for route in ("graph", "compiled-graph", "recording"):
        sizes = capture.ROUTES.get(route).sizes
        assert sizes[0] == 1 and sizes[-1] == 256 and len(sizes) == 16  # the compilations docs/performance.md states
        for n in range(1, 257):
            padded = capture.padded_observations(n, capture.ROUTES.get(route))
            assert padded >= n and (padded - n) / padded <= 0.25, (route, n, padded)


class _Gain(torch.nn.Module):
    """A module whose constant is not in its repr."""

    def __init__(self, gain):
        super().__init__()
        self.gain = gain

    def forward(self, x):
        return self.gain * x


class _Loss:
    def __init__(self, smoothing):
        self.smoothing = smoothing

    def loss(self, logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels, label_smoothing=self.smoothing)


def _gain_group(gain=1.0, loss_fn=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 4), _Gain(gain))
    x = torch.rand(2, *SHAPE, generator=torch.Generator().manual_seed(3))
    extra = {} if loss_fn is None else {"loss_fn": loss_fn}
    return [observe(model, x[i:i + 1], torch.tensor([i]), seed=i, **extra) for i in range(2)]


def _set(path, value):
    def change(attack):
        *owners, name = path.split(".")
        target = attack
        for owner in owners:
            target = getattr(target, owner)
        setattr(target, name, value)
    return change


_CHANGES = {  # each constant a program bakes in
    "adam betas": (_set("optimizer.inner.betas", (0.8, 0.999)), None),
    "adam eps": (_set("optimizer.inner.eps", 1e-6), None),
    "signed adam": (_set("optimizer.inner.signed", False), None),
    "watchdog tolerance": (_set("optimizer.tolerance", 1e-3), None),
    "watchdog patience": (_set("optimizer.patience", 3), None),
    "tv weight": (lambda a: a.priors.__setitem__(0, (*a.priors[0][:2], 0.5)), None),
    "objective": (_set("objective", build_objective("l2")), None),
    "masked layers": (_set("objective", build_objective("cosine", masks="observed")), None),
    "module constant": (None, lambda: _gain_group(gain=2.0)),
    "loss method's object": (None, lambda: _gain_group(loss_fn=_Loss(0.1).loss)),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_changed_constant_builds_a_new_program(change, fresh_programs):
    alter, group = _CHANGES[change]

    def run(alter=None, obs=None):
        attack = ATTACKS.build("ig", capture="eager")
        if alter is not None:
            alter(attack)
        return attack.reconstruct_many(obs or _gain_group(loss_fn=_Loss(0.0).loss), 4, [0, 1])

    run()
    assert capture.STATS["built"] == 1
    run()  # the same constants in other objects: the same program
    assert (capture.STATS["built"], capture.STATS["reused"]) == (1, 1)
    changed = run(alter, group() if group else None)
    assert capture.STATS["built"] == 2, change
    assert "program built here" in word(changed[0].trace["capture"])


def test_layer_weights_and_masks_are_inputs_of_one_program(fresh_programs):
    obs = _group(seed=5)
    layers = len(obs[0].gradients)
    for drop in range(layers):
        weights = [0.0 if i == drop else None for i in range(layers)]
        masks = [torch.rand(g.shape, generator=torch.Generator().manual_seed(drop)) > 0.3 for g in obs[0].gradients]
        captured = _run(obs, capture="eager", weights=weights, masks=masks)
        assert capture.STATS["built"] == 1, f"layer {drop} built another program"
        _same(_run(obs, capture="off", weights=weights, masks=masks), captured)


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


def test_a_multi_step_audit_builds_each_program_once_and_reuses_it_at_the_next_step(fresh_programs, monkeypatch,
                                                                                    tmp_path):
    import audit

    loads = []
    load = capture.Program.load

    def logged(self, run, *args):
        loads.append((self, run.attack.name, run.obs.step))
        load(self, run, *args)

    monkeypatch.setattr(capture.Program, "load", logged)
    recorded = {"capture": "recording"}
    attacks = {"ig": recorded, "mask-replay": recorded, "through-defense": recorded,
               "layer-drop": {**recorded, "layers": "search"}}  # a search: one run per candidate layer
    audit.run(defense="prune", model="cnn", image_size=8, steps=[0, 10], images=2, budget=12,
              attacks=list(attacks), attack_args=attacks, utility=False, progress=False, seed=0, out=tmp_path)
    programs = {p for p, _, _ in loads}
    assert {name for _, name, _ in loads} == set(attacks)
    assert capture.STATS["built"] == len(programs) == len(capture.PROGRAMS), "a program was built twice"
    for program in programs:
        steps = [step for p, _, step in loads if p is program]
        assert 0 in steps and 10 in steps, (program.template.attack.name, steps)
    layer_drop = [p for p, name, _ in loads if name == "layer-drop"]
    assert len(set(layer_drop)) == 1 and len(layer_drop) > 2  # every candidate layer, both steps, one program
    assert all(p.replay is not None for p in programs)  # captured and replayed


def test_the_restart_selection_keeps_the_runs_one_program(fresh_programs):
    obs = _group(seed=11)
    eager = _run(obs, 24, capture="off", keep_best_after=0.5)
    captured = _run(obs, 24, capture="eager", keep_best_after=0.5)
    assert captured[0].trace["restart_selection"]["iteration"] < captured[0].trace["iterations"] - 1
    assert capture.STATS["built"] == len(capture.PROGRAMS) == 1, "the restart selection built a second program"
    assert "programs: 1 built, 0 reused" in word(captured[0].trace["capture"]), word(captured[0].trace["capture"])
    _same(eager, captured, atol=1e-5)


def test_eviction_drops_the_oldest_beyond_the_count_then_while_reserved_memory_is_over_the_limit():
    entries = [("a", 30), ("b", 20), ("c", 40), ("d", 10)]  # oldest first
    assert capture.evictions(50, 100, entries, max_entries=4) == []
    assert capture.evictions(50, 100, entries, max_entries=2) == ["a", "b"]
    # reserved memory counts the freed blocks of every graph's private pool: over the limit, the
    # oldest go until what is left fits
    assert capture.evictions(160, 110, entries, max_entries=4) == ["a", "b"]
    assert capture.evictions(160, 100, entries, max_entries=4) == ["a", "b", "c"]
    assert capture.evictions(160, 100, entries, max_entries=1) == ["a", "b", "c"]
    assert capture.evictions(500, 100, entries, max_entries=4) == ["a", "b", "c", "d"]  # an estimate short: all go
    assert capture.evictions(500, 100, [], max_entries=4) == []


def test_more_shapes_than_the_cache_holds_keep_the_newest(fresh_programs, monkeypatch):
    monkeypatch.setattr(capture, "MAX_PROGRAMS", 2)
    keys = []
    for n in (1, 2, 3, 4):  # a program per group size
        _run(_group(seed=n, n=n), 8, capture="eager")
        keys.append(next(reversed(capture.PROGRAMS)))
    assert capture.STATS["built"] == 4 and list(capture.PROGRAMS) == keys[2:]
    capture.release(torch.device("cpu"))
    assert not capture.PROGRAMS
