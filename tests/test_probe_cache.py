"""A resumed audit plans from the probe it kept instead of probing the defense again; a changed
setting, a changed set of audited steps or an unreadable file probes again."""
import json

import pytest

from adaptive import DefenseTraits, plan_from_traits, probe_defense
from audit.engine import probe_cache
from audit.engine.audit import Audit
from audit.engine.settings import AttackSettings, DataSettings, OutputSettings
from defenses import build_defense

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name, params", [("prune", {"ratio": 0.9}), ("soteria", {"ratio": 0.5, "layer": "last"}),
                                          ("gaussian", {"sigma": 0.05}), ("precode", {})])
def test_traits_read_back_into_the_same_plan(name, params):
    traits = probe_defense(build_defense(name, **params), seed=0)
    back = DefenseTraits.from_dict(json.loads(json.dumps(traits.to_dict())))
    assert back.to_dict() == traits.to_dict()
    assert plan_from_traits(back).to_dict() == plan_from_traits(traits).to_dict()


def test_unknown_fields_are_refused():
    record = probe_defense(build_defense("prune", ratio=0.9), seed=0).to_dict()
    with pytest.raises(TypeError, match="no field"):
        DefenseTraits.from_dict({**record, "invented": 1})


class Calls:
    """Counts the calls of the built-in prune defense (its class patched: a counter kept on the
    defense object would change the defense's identity, and with it the run key)."""

    def __init__(self, monkeypatch):
        self.defense, self.calls = build_defense("prune", ratio=0.9), 0
        real = type(self.defense).__call__

        def counted(defense, *args, **kwargs):
            self.calls += 1
            return real(defense, *args, **kwargs)

        monkeypatch.setattr(type(self.defense), "__call__", counted)


def _audit(defense, out, steps=(0, 1)):
    return Audit(defense, "mlp", model_args={"hidden": 16}, data_settings=DataSettings(image_size=8, images=1),
                 attack_settings=AttackSettings(names=("auto",), steps=tuple(steps), budget=5),
                 output_settings=OutputSettings(out=out, progress=False))


def _planned_calls(counter, out, steps=(0, 1)):
    audit = _audit(counter.defense, out, steps)  # its identity calls the defense too: counted from here
    before = counter.calls
    specs, plan = audit.planned()
    return counter.calls - before, [s.to_dict() for s in specs], plan


def test_a_second_audit_of_the_same_settings_does_not_probe_again(tmp_path, monkeypatch):
    defense = Calls(monkeypatch)
    first, specs, plan = _planned_calls(defense, tmp_path)
    assert first > 0 and "mask-replay" in [s["name"] for s in specs]
    assert len(list((tmp_path / probe_cache.FOLDER).glob("*.json"))) == 1
    again, specs_again, plan_again = _planned_calls(defense, tmp_path)
    assert first >= 10 and again == 1  # the one observation the plan's side information reads
    assert specs_again == specs and plan_again == plan


def test_other_steps_or_an_unreadable_probe_probe_again(tmp_path, monkeypatch):
    defense = Calls(monkeypatch)
    _planned_calls(defense, tmp_path)
    other_steps, _, _ = _planned_calls(defense, tmp_path, steps=(0, 5))
    assert other_steps >= 10
    assert len(list((tmp_path / probe_cache.FOLDER).glob("*.json"))) == 2
    for path in (tmp_path / probe_cache.FOLDER).glob("*.json"):
        path.write_text("{")
    broken, _, _ = _planned_calls(defense, tmp_path)
    assert broken >= 10
    assert _planned_calls(defense, tmp_path)[0] == 1  # kept again, readable


def test_the_probe_key_leaves_out_the_budget_only():
    settings = {"defense": {"name": "prune"}, "seed": 0, "budget": {"value": 200}}
    key = probe_cache.probe_key(settings, [0, 1])
    assert probe_cache.probe_key({**settings, "budget": {"value": 400}}, [0, 1]) == key
    assert probe_cache.probe_key({**settings, "seed": 1}, [0, 1]) != key
    assert probe_cache.probe_key(settings, [0, 2]) != key
