"""A run key and a defense's fingerprint are the same on another kernel path of the same CPU
(generic kernels instead of the vectorised ones, another thread count): a stored result resumes,
and the papers page renders as committed, on any x86-64 machine with the same code and torch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CALLS = [{}, {"defense": "refiner", "model": "resnet18"}]



def identities(out):
    """The fingerprint of every built-in defense and the run key of each of :data:`CALLS`."""
    from audit.engine.audit import Audit
    from audit.engine.config import AuditConfig
    from audit.engine.identity import probe_fingerprint
    from audit.report.store import settings_key
    from defenses import DEFENSES

    keys = [settings_key(Audit.from_config(AuditConfig(out=str(out), device="cpu", **call)).key_settings())
            for call in CALLS]
    return {"probes": {n: probe_fingerprint(DEFENSES.build(n)) for n in DEFENSES.names()}, "keys": keys}


def _identities_elsewhere(out, env):
    script = ("import importlib.util, json; spec = importlib.util.spec_from_file_location('keys', "
              f"{__file__!r}); t = importlib.util.module_from_spec(spec); spec.loader.exec_module(t); "
              f"print(json.dumps(t.identities({str(out)!r})))")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    out = tmp_path_factory.mktemp("keys")
    return out, identities(out)


@pytest.mark.parametrize("path", [{"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                                  {"OMP_NUM_THREADS": "2"}], ids=["generic-kernels", "two-threads"])
def test_run_keys_and_defense_fingerprints_do_not_depend_on_the_kernel_path(here, path):
    out, mine = here
    assert _identities_elsewhere(out, path) == mine
    assert len(set(mine["keys"])) == len(CALLS)  # each call has its own key


def test_a_defense_that_trains_before_it_answers_is_keyed_by_its_code_and_parameters():
    from audit.engine.identity import defense_identity
    from defenses import DEFENSES

    first = defense_identity(DEFENSES.build("refiner"), "refiner")
    assert first["probe"].startswith("not probed") and first == defense_identity(DEFENSES.build("refiner"), "refiner")
    other = defense_identity(DEFENSES.build("refiner", d_epochs=5), "refiner")
    assert other["params"] != first["params"]  # so another setting never reuses its results
