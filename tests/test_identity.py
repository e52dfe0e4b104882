"""A defense is identified by what it does: its module's source, the values it closes over,
its default arguments, the module-level values it reads, and its output on a fixed probe.
Another defense never reuses stored results; the same one always does."""
import sys
import types

import pytest
import torch

import audit
from audit.core.types import clean_gradients
from audit.engine.audit import Audit, audit_settings
from audit.engine.compose import resolve_defense
from audit.engine.identity import defense_identity

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model="mlp", model_args={"hidden": 32}, image_size=16, budget=5, utility=False, progress=False,
            attacks=["analytic"], images=1, steps=[0])

MODULE = '''
import torch
from audit.core.types import clean_gradients

SIGMA = {sigma}


def noisy(model, inputs, labels, *, loss_fn, generator):
    return [g + SIGMA * torch.randn(g.shape, generator=generator)
            for g in clean_gradients(model, inputs, labels, loss_fn)]
'''


def make(sigma):
    """Two calls, two closures of the same code."""

    def noisy(model, inputs, labels, *, loss_fn, generator):
        return [g + sigma * torch.randn(g.shape, generator=generator)
                for g in clean_gradients(model, inputs, labels, loss_fn)]

    return noisy


def result_mtimes(out):
    return {p.relative_to(out): p.stat().st_mtime_ns for p in out.glob("runs/*/results/*.json")}


def _import_fresh(monkeypatch, folder, sigma):
    """The user module as a new process would import it, after writing ``SIGMA = sigma``."""
    (folder / "user_sigma.py").write_text(MODULE.format(sigma=sigma))
    monkeypatch.delitem(sys.modules, "user_sigma", raising=False)


def test_a_changed_module_constant_never_reuses_stored_results(tmp_path, monkeypatch):
    folder, out = tmp_path / "src", tmp_path / "out"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    _import_fresh(monkeypatch, folder, "0.0")
    quiet = audit.run(defense="user_sigma:noisy", out=out, **TINY)
    stored = result_mtimes(out)
    _import_fresh(monkeypatch, folder, "0.0")  # unchanged: resumed, nothing recomputed
    again = audit.run(defense="user_sigma:noisy", out=out, **TINY)
    assert again.data["run_key"] == quiet.data["run_key"] and result_mtimes(out) == stored
    _import_fresh(monkeypatch, folder, "10.0")
    loud = audit.run(defense="user_sigma:noisy", out=out, **TINY)
    assert loud.data["run_key"] != quiet.data["run_key"]
    assert {k: v for k, v in result_mtimes(out).items() if k in stored} == stored and len(result_mtimes(out)) == 2
    assert quiet.psnr(0, "analytic") > 60 > loud.psnr(0, "analytic")  # the new numbers are the noisy ones
    before, after = quiet.data["defense"], loud.data["defense"]
    assert before["source_sha256"] == after["source_sha256"]  # the function's own source is unchanged
    for part in ("module_sha256", "values_sha256", "probe"):
        assert before[part] != after[part], part


def test_closures_of_other_values_never_share_results(tmp_path):
    quiet = audit.run(defense=make(0.0), out=tmp_path, **TINY)
    stored = result_mtimes(tmp_path)
    loud = audit.run(defense=make(10.0), out=tmp_path, **TINY)
    assert loud.data["run_key"] != quiet.data["run_key"] and quiet.psnr(0, "analytic") > 60 > loud.psnr(0, "analytic")
    again = audit.run(defense=make(0.0), out=tmp_path, **TINY)  # another closure of the same value: resumed
    assert again.data["run_key"] == quiet.data["run_key"]
    assert {k: v for k, v in result_mtimes(tmp_path).items() if k in stored} == stored


def key(defense, tmp_path):
    return Audit(defense, **audit_settings(**TINY, out=tmp_path)).key_settings()["defense"]


def test_default_values_and_values_the_probe_does_not_reach_change_the_key(tmp_path):
    def scaled(model, inputs, labels, *, loss_fn, generator, scale=1.0):
        return [scale * g for g in clean_gradients(model, inputs, labels, loss_fn)]

    other = types.FunctionType(scaled.__code__, scaled.__globals__, "scaled", None, scaled.__closure__)
    other.__kwdefaults__ = {"scale": 2.0}
    a, b = key(scaled, tmp_path), key(other, tmp_path)
    assert a["values_sha256"] != b["values_sha256"] and a["probe"] != b["probe"]

    def late(start):  # differs only from round `start` on: the probe (round 0) sees the same output
        def defense(model, inputs, labels, *, loss_fn, generator, round=0):
            grads = clean_gradients(model, inputs, labels, loss_fn)
            return [0 * g for g in grads] if round >= start else grads
        return defense

    a, b = key(late(5), tmp_path), key(late(50), tmp_path)
    assert a["probe"] == b["probe"] and a["values_sha256"] != b["values_sha256"]


def test_a_defense_that_fails_the_probe_is_fingerprinted_by_its_failure(tmp_path):
    def needs_16px(model, inputs, labels, *, loss_fn, generator):
        if inputs.shape[-1] != 16:
            raise ValueError(f"needs 16 px images, got {inputs.shape[-1]}")
        return clean_gradients(model, inputs, labels, loss_fn)

    ident = key(needs_16px, tmp_path)
    assert ident["probe"] == "failed: DefenseError: defense 'needs_16px' raised ValueError: needs 16 px images, got 8"
    report = audit.run(defense=needs_16px, out=tmp_path, **TINY)  # the audit itself runs
    assert report.data["status"] == "complete" and report.psnr(0, "analytic") > 60


def test_built_in_defenses_are_identified_by_parameters_and_probe():
    a = defense_identity(resolve_defense("prune", {"ratio": 0.5}), "prune")
    assert a == defense_identity(resolve_defense("prune", {"ratio": 0.5}), "prune")  # stable
    b = defense_identity(resolve_defense("prune", {"ratio": 0.9}), "prune")
    assert a["params"]["ratio"] == 0.5 and a["probe"] != b["probe"] and a["probe"].startswith("sha256:")
    assert a["module_sha256"] == b["module_sha256"] and a["callable"] == "defenses.prune:Prune"
    noisy = [defense_identity(resolve_defense("gaussian", {"sigma": 0.1}), "gaussian")["probe"] for _ in range(2)]
    assert noisy[0] == noisy[1]  # a random defense: a seeded generator on the probe


KEY_ON_THIS_CPU = '''
import json
import torch
from audit.core.models import build_model
from audit.engine.audit import Audit, audit_settings
from audit.engine.identity import model_identity
from audit.report.store import settings_key

keys = {{}}
for defense in ("ats", "precode"):  # a stochastic defense of torchvision ops; one that adds layers of its own
    run = Audit(defense, **audit_settings(model="convnet9", image_size=16, budget=5, utility=False, progress=False,
                                          attacks=["analytic"], images=1, steps=[0], out="{out}"))
    keys[defense] = {{"key": settings_key(run.key_settings()), "probe": run.key_settings()["defense"]["probe"]}}
print(json.dumps({{"capability": torch.backends.cpu.get_cpu_capability(), "keys": keys,
                   "weights": model_identity(build_model("convnet9", seed=0), {{}})["state_sha256"]}}))
'''


@pytest.mark.slow
def test_a_stored_run_keeps_its_key_on_a_cpu_whose_kernels_round_otherwise(tmp_path):
    """Torch's float32 initialisation and a float32 probe differ in the last bit between CPUs'
    kernels (ATEN_CPU_CAPABILITY picks them here); the key, and so the stored results a bench
    commits, must not: weights drawn from the seed are keyed by the seed, the probe runs in float64."""
    import json
    import os
    import subprocess

    def keys_with(capability):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("ATEN_CPU_CAPABILITY", None)
        if capability:
            env["ATEN_CPU_CAPABILITY"] = capability
        script = KEY_ON_THIS_CPU.format(out=tmp_path / (capability or "native"))
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    native, plain = keys_with(None), keys_with("default")
    if native["capability"] == plain["capability"]:
        pytest.skip(f"checks that a run key holds across two CPU kernel sets: this CPU runs torch's plain kernels "
                    f"already ({native['capability']}), so there is no second set to compare with")
    assert native["weights"] != plain["weights"]  # the same seed, other bytes: why weights are not the key
    for defense, key in native["keys"].items():
        assert key["probe"] == plain["keys"][defense]["probe"] and key["probe"].startswith("sha256:"), defense
        assert key["key"] == plain["keys"][defense]["key"], defense
