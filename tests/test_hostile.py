"""Hostile defenses: each behaves at step 0 and misbehaves at FL round 1 (raises, NaN, inf,
the wrong count, shapes, dtype or device, or sleeps past the per-call timeout). The audit
never crashes, names the defense and the failing step, keeps the finished step-0 result,
and its verdict is "incomplete" where evidence is missing."""
import json
import time

import pytest
import torch

import audit
from audit.core.defense_call import call_defense, defense_timeout
from audit.core.errors import ConfigError, DefenseError
from audit.core.types import clean_gradients
from audit.report.risk import INCOMPLETE, PRIVATE, RECOVERED

TINY = dict(model="mlp", model_args={"hidden": 32}, image_size=16, budget=5, utility=False, progress=False,
            attacks=["analytic"], images=1, steps=[0, 1])
SLEEP_S, TIMEOUT_S = 1.5, 0.3


def _raise(grads):
    raise RuntimeError("hostile: refuses round 1")


def _sleep(grads):
    time.sleep(SLEEP_S)
    return grads


# what a hostile defense does at round 1, and the words its failure must contain
MISBEHAVIOURS = {
    "raises": (_raise, "refuses round 1"),
    "nan": (lambda g: [x * float("nan") for x in g], "NaN"),
    "inf": (lambda g: [x + float("inf") for x in g], "NaN/inf"),
    "count": (lambda g: g[:-1], "tensors for"),
    "shapes": (lambda g: [x.flatten() for x in g], "shape"),
    "dtype": (lambda g: [x.double() for x in g], "float64"),
    "device": (lambda g: [x.to("meta") for x in g], "meta"),
    "sleeps": (_sleep, "did not return within"),
}


def hostile(kind, noise_at_round_0=False):
    """A defense: the clean gradient (or, with ``noise_at_round_0``, data-independent noise that
    keeps the images private) until round 1, where it misbehaves as ``MISBEHAVIOURS[kind]``."""
    misbehave = MISBEHAVIOURS[kind][0]

    def defense(model, inputs, labels, *, loss_fn, generator, round=None):
        grads = clean_gradients(model, inputs, labels, loss_fn)
        if round == 1:
            return misbehave(grads)
        if noise_at_round_0:
            return [torch.randn(g.shape, generator=generator, device=g.device) for g in grads]
        return grads

    defense.__name__ = defense.__qualname__ = f"hostile_{kind}"
    return defense


@pytest.mark.parametrize("kind", sorted(MISBEHAVIOURS))
def test_hostile_defense_is_named_with_its_step_and_finished_results_kept(tmp_path, kind):
    defense = hostile(kind)
    report = audit.run(defense=defense, out=tmp_path, defense_timeout=TIMEOUT_S, **TINY)
    name, words = defense.__name__, MISBEHAVIOURS[kind][1]
    step0, step1 = report.step(0), report.step(1)
    assert step0["attacks"]["analytic"]["status"] == "ok" and step0["verdict"]["label"] == RECOVERED
    assert step1["verdict"]["label"] == INCOMPLETE and "analytic failed" in step1["verdict"]["reason"]
    (failure,) = [f for f in report.failures if f["step"] == 1]
    assert failure["defense"] == name and name in failure["error"] and words in failure["error"]
    assert report.data["status"] == "incomplete (analytic failed)"
    assert report.verdict == RECOVERED  # the worst judged step; step 1 is listed as incomplete
    assert report.data["verdict"]["incomplete_steps"] == [1]
    stored = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/results/*.json")]
    assert {(r["step"], r["status"]) for r in stored} == {(0, "ok"), (1, "error")}
    md = (tmp_path / "report.md").read_text()
    assert name in md and "incomplete" in md


def test_missing_evidence_makes_the_overall_verdict_incomplete_not_private(tmp_path):
    report = audit.run(defense=hostile("raises", noise_at_round_0=True), out=tmp_path, **TINY)
    assert report.step(0)["verdict"]["label"] == PRIVATE  # noise: nothing recovered at step 0
    assert report.verdict == INCOMPLETE and "analytic failed" in report.data["verdict"]["reason"]
    assert "Verdict: incomplete" in (tmp_path / "report.md").read_text()


def test_a_defense_sharing_the_raw_gradient_is_found_out(tmp_path):
    def raw(model, inputs, labels, *, loss_fn, generator):
        return clean_gradients(model, inputs, labels, loss_fn)

    report = audit.run(defense=raw, out=tmp_path, **{**TINY, "attacks": "auto", "steps": [0]})
    assert report.data["plan"]["traits"]["flags"]["identity"]
    assert report.verdict == RECOVERED and report.step(0)["worst_case"]["psnr"] > 60


def test_rerun_retries_the_stored_errors(tmp_path):
    broken = tmp_path / "broken"  # outside the defense's code and values: the same defense
    broken.touch()

    def flaky(model, inputs, labels, *, loss_fn, generator, round=None):
        """Fails at round 1 while ``broken`` exists (a transient failure: a timeout, a full disk, ...)."""
        if round == 1 and broken.exists():
            raise RuntimeError("transient")
        return clean_gradients(model, inputs, labels, loss_fn)

    settings = {**TINY, "steps": [1]}
    assert audit.run(defense=flaky, out=tmp_path / "out", **settings).verdict == INCOMPLETE
    broken.unlink()
    kept = audit.run(defense=flaky, out=tmp_path / "out", retry_errors=False, **settings)
    assert kept.verdict == INCOMPLETE  # told not to retry: the stored error stands
    again = audit.run(defense=flaky, out=tmp_path / "out", **settings)
    assert again.data["status"] == "complete" and again.verdict == RECOVERED


def test_timeout_abandons_the_call_and_names_the_defense():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    x, y = torch.rand(1, 1, 2, 2), torch.tensor([1])

    def slow(model, inputs, labels, *, loss_fn, generator):
        time.sleep(SLEEP_S)
        return clean_gradients(model, inputs, labels, loss_fn)

    start = time.perf_counter()
    with defense_timeout(TIMEOUT_S), pytest.raises(DefenseError, match="'slow' did not return within 0.3 s"):
        call_defense(slow, model, x, y)
    assert time.perf_counter() - start < SLEEP_S  # abandoned, not waited for
    with defense_timeout(5.0):  # within the limit: the result (with its autograd graph) comes back
        grads = call_defense(hostile("raises"), model, x, y)
    assert len(grads) == 2 and grads[0].shape == (2, 4)
    with pytest.raises(ConfigError, match="positive number of seconds"):
        with defense_timeout(0):
            pass
    with pytest.raises(ConfigError, match="defense_timeout"):
        audit.run(defense="none", defense_timeout=-1, **TINY)


def test_a_defense_call_under_a_timeout_computes_on_its_callers_thread_count():
    """The timeout's worker thread keeps its own torch thread count once it has run torch; a call
    must run on the caller's count (float sums, and with them a defended training's accuracy,
    depend on it: a Ray task's worker starts single-threaded, a local process's does not)."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2))
    x, y = torch.rand(1, 1, 2, 2), torch.tensor([1])
    seen = []

    def counting(model, inputs, labels, *, loss_fn, generator):
        seen.append(torch.get_num_threads())
        return clean_gradients(model, inputs, labels, loss_fn)

    before = torch.get_num_threads()
    first, second = (1, 2) if before != 1 else (2, 1)
    try:
        with defense_timeout(5.0):
            torch.set_num_threads(first)  # the worker starts (and runs torch) at `first` threads
            call_defense(counting, model, x, y)
            torch.set_num_threads(second)  # the caller changes its count, the worker lives on
            call_defense(counting, model, x, y)
    finally:
        torch.set_num_threads(before)
    assert seen == [first, second]


sleeps_at_round_1 = hostile("sleeps")  # importable as tests' module:attr for the CLI


def test_cli_defense_timeout(tmp_path):
    from click.testing import CliRunner

    import cli

    args = ["audit", "--defense", f"{__name__}:sleeps_at_round_1", "--model", "mlp", "--model-arg", "hidden=32",
            "--steps", "0,1", "--images", "1", "--attacks", "analytic", "--budget", "5", "--no-utility", "--quiet",
            "--out", str(tmp_path)]
    result = CliRunner().invoke(cli.main, args + ["--defense-timeout", str(TIMEOUT_S)])
    assert result.exit_code == cli.INCOMPLETE_EXIT, result.output  # it ran, but lacks evidence: not finished
    assert "[incomplete (analytic failed)" in result.output and "verdict: leaks" in result.output
    bad = CliRunner().invoke(cli.main, args + ["--defense-timeout", "-1"])
    assert bad.exit_code == 2 and "defense_timeout (seconds) must be a positive number" in bad.output
