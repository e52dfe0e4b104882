"""The device, the data set, each resolved defense and the seeded client model are built in
one place (``audit.engine.compose``) and handed on: the planner does not wrap the model
again, and a sweep does not resolve, load or build anything per cell or per job."""
import pytest

import audit
import audit.engine.compose as compose
import audit.engine.grid as grid_module
from adaptive.planner import probe as probe_module
from audit.engine.audit import Audit
from audit.engine.settings import DataSettings, OutputSettings

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model="mlp", model_args={"hidden": 16}, image_size=8, images=1, steps=[0, 1], attacks="ig", budget=5,
            utility_steps=3, progress=False)


class Counter:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_a_sweep_builds_the_data_the_model_and_each_defense_once(tmp_path, monkeypatch):
    counters = {}
    for module, name in ((compose, "load_data"), (compose, "build_model"), (compose, "resolve_device"),
                         (grid_module, "resolve_defense"), (compose, "wrap_client_model")):
        counters[name] = Counter(getattr(module, name))
        monkeypatch.setattr(module, name, counters[name])

    def no_second_wrap(*args, **kwargs):
        raise AssertionError("the planner wrapped the client model again")

    monkeypatch.setattr(probe_module, "wrap_client_model", no_second_wrap)
    report = audit.sweep({"prune": {"ratio": [0.5, 0.9]}}, out=tmp_path, **TINY)
    assert report.data["progress"] == {"done": 3, "total": 3}
    assert counters["load_data"].calls == counters["build_model"].calls == counters["resolve_device"].calls == 1
    assert counters["resolve_defense"].calls == 3  # none, prune 0.5, prune 0.9
    # one client model per cell, plus the utility's own: each of its 3 seeds starts from its own
    # initialisation, for the shared undefended arm and the two defended cells
    assert counters["wrap_client_model"].calls == 3 + 3 * 3


def test_the_planner_probes_the_audits_client_model(tmp_path, monkeypatch):
    seen = []
    real = probe_module._architecture

    def spy(defense, model, wrapped):
        seen.append(wrapped)
        return real(defense, model, wrapped)

    monkeypatch.setattr(probe_module, "_architecture", spy)
    monkeypatch.setattr(probe_module, "wrap_client_model", lambda *a, **k: pytest.fail("wrapped again"))
    run = Audit("precode", "mlp", model_args={"hidden": 16}, data_settings=DataSettings(image_size=8, images=1),
                output_settings=OutputSettings(out=tmp_path))
    specs, plan = run.planned()
    assert plan["traits"]["architectural"] is True
    assert len(seen) == 1 and [p.shape for p in seen[0].parameters()] == [p.shape for p in run.model.parameters()]
    assert all((a == b).all() for a, b in zip(seen[0].parameters(), run.model.parameters()))
