"""Attacks store codes and numbers in their traces, never sentences: the report words them
(audit.report.reasons), so a trace can be read in any format and a wording changed in one place."""
import pytest
import torch

import adaptive  # noqa: F401  (registers the adaptive attacks)
from attacks import ATTACKS
from audit.core.data import load_dataset
from audit.core.models import build_model
from audit.client.observe import observe
from audit.core.errors import NotApplicable
from audit.core.reasons import Reason
from audit.report.reasons import REASONS, trace_words, word
from test_generators import TEST_SHAPE, session_generator

#: each attack's settings here: the generative ones get the test generator; the inverter trains briefly, uncached
SETTINGS = {"learned-inverter": {"cache": False, "train_steps": 10, "pairs": 64}}
GENERATIVE = ("ggl", "gias", "gifd")
#: what a trace may hold as text: the attack's own settings and the simulator as they describe
#: themselves, and the generator's checkpoint record (written with the generator's file)
DESCRIPTIONS = {"settings", "simulator", "generator"}


def _sentences(value, path=""):
    """(path, text) of every string with a space in ``value``, outside a reason's object."""
    if isinstance(value, dict):
        if "code" in value and set(value) <= {"code", "params"}:
            return []
        return [s for k, v in value.items() if k not in DESCRIPTIONS for s in _sentences(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _sentences(v, path + "[]")]
    return [(path, value)] if isinstance(value, str) and " " in value else []


def _codes(value):
    """Every reason code in ``value``, nested ones included."""
    if isinstance(value, dict):
        if "code" in value and set(value) <= {"code", "params"}:
            return [value["code"]] + _codes(value.get("params") or {})
        return [c for v in value.values() for c in _codes(v)]
    if isinstance(value, (list, tuple)):
        return [c for v in value for c in _codes(v)]
    return []


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    data = load_dataset("embedded", size=TEST_SHAPE[-1])
    x, y = data.train_images[3:4], data.train_labels[3:4]
    models = {"cnn": {}, "resnet18": {"width": 8}}
    out = {}
    for name, kw in models.items():
        model = build_model(name, data.input_shape, data.num_classes, mean=data.mean, std=data.std, seed=0, **kw)
        out[name] = observe(model, x, y)
    return out, session_generator(tmp_path_factory)


@pytest.mark.parametrize("model", ["cnn", "resnet18"])
def test_every_attacks_trace_holds_codes_the_report_words(cases, model):
    observations, generator = cases
    seen = 0
    for name in ATTACKS.names():
        if name in GENERATIVE + ("learned-inverter",) and model != "cnn":
            continue
        attack = ATTACKS.build(name, **({"generator": generator} if name in GENERATIVE else SETTINGS.get(name, {})))
        torch.manual_seed(0)
        try:
            rec = attack.reconstruct(observations[model], 4, 0)
        except NotApplicable as err:  # gi on a model without BatchNorm: a code too
            assert err.reason.code in REASONS, (name, err.reason)
            continue
        trace = rec.trace.to_dict()
        assert _sentences(trace) == [], (name, _sentences(trace))
        for code in _codes(trace):  # each code has its words: none falls back to "code (values)"
            assert code in REASONS, (name, code)
        if name == "ig":  # the words: how it ran, on a CPU, and how it picked its restart
            words = trace_words(trace)
            assert words["capture"].startswith("off: capture='auto' captures on CUDA only (on a cpu"), words
            assert words["execution"].startswith(("batched (vmap over", "single restart")), words
            assert words["selection"].endswith("ground truth unused"), words
        seen += 1
    assert seen >= 19 if model == "cnn" else seen >= 16


def test_execution_and_capture_read_as_before():
    """The words of the execution and capture codes, nested reasons included."""
    unvmappable = Reason("run-sequential", why=Reason("not-vmappable", simulator="defense prune",
                                                      why=Reason("labels-optimised").to_dict()).to_dict())
    assert word(unvmappable) == "sequential (defense prune is not vmappable; the labels are optimised with the images)"
    unused = Reason("compile-unused", route=Reason("run-batched", observations=3, restarts=2).to_dict(),
                    why=Reason("group-mean-changes", per="step").to_dict())
    assert word(unused) == ("batched (vmap over 3 observations x 2 restarts; compile=true not used: the "
                            "group-consistency prior changes with the step)")
    fell = Reason("capture-off", why=[Reason("capture-setting", setting="graph").to_dict(),
                                      Reason("route-failed", route="graph", error="RuntimeError: boom").to_dict()],
                  replayed=3)
    assert word(fell) == "off: capture='graph'; graph failed: RuntimeError: boom; 3 iteration(s) replayed before"


def test_a_sequential_run_names_why_it_neither_compiles_nor_captures(cases):
    """One list of reasons keeps a run from being one traced program, compiled or captured: a
    sequential run says so under both."""
    observations, _ = cases
    trace = ATTACKS.build("ig", compile=True, execution="sequential", capture="on").reconstruct(
        observations["cnn"], 2, 0).trace.to_dict()
    execution, capture = trace["execution"], trace["capture"]
    assert execution["code"] == "compile-unused", execution
    assert execution["params"]["why"] == {"code": "sequential-requested", "params": {}}, execution
    assert capture["code"] == "capture-off", capture
    assert {"code": "sequential-requested", "params": {}} in capture["params"]["why"], capture
