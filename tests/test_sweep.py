"""Sweeps on tiny settings: a small MLP on 8x8 images, one private image, steps 0 and 1, the
``ig`` attack at budget 5 and 3 utility rounds, so each cell takes about a second."""
import json

import pytest
import torch
from click.testing import CliRunner

import audit
import audit.engine.sweep as sweep_module
import cli
from audit.core.errors import ConfigError
from audit.core.data import load_dataset
from audit.core.records import UtilityResult
from audit.core.types import clean_gradients
from audit.engine.audit import Audit, audit_settings
from audit.engine.sweep import pair_options
from audit.engine.utility import measure_utility
from audit.report.sweep_report import pareto_optimal

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(model="mlp", model_args={"hidden": 16}, image_size=8, images=1, steps=[0, 1], attacks="ig", budget=5,
            utility_steps=3, progress=False)
TINY_CLI = ["--model", "mlp", "--model-arg", "hidden=16", "--image-size", "8", "--images", "1", "--steps", "0,1",
            "--attacks", "ig", "--budget", "5", "--utility-steps", "3", "--quiet"]


def halved(model, inputs, labels, *, loss_fn, generator):
    """A user's defense: half the clean gradient."""
    return [0.5 * g for g in clean_gradients(model, inputs, labels, loss_fn)]


def nan_from_round_1(model, inputs, labels, *, loss_fn, generator, round):
    """A user's defense whose update turns NaN from FL round 1 on: training diverges there."""
    grads = clean_gradients(model, inputs, labels, loss_fn)
    return [g * float("nan") for g in grads] if round >= 1 else grads


def result_files(out):
    """Every stored (step, attack, image) result of every cell, with its modification time."""
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in out.glob("cells/*/runs/*/results/*.json")}


def test_pareto_optimal_on_a_constructed_example():
    # (worst-case PSNR, accuracy): lower PSNR and higher accuracy are better
    points = [(10.0, 0.5), (12.0, 0.6), (11.0, 0.4), (None, 0.9), (10.0, 0.5), (15.0, 0.6), (9.0, 0.1)]
    assert pareto_optimal(points) == [True, True, False, False, True, False, True]


def test_a_cell_is_dominated_only_beyond_the_accuracy_noise():
    # (worst-case PSNR, mean accuracy, per-seed accuracies)
    a, b = (10.0, 0.50, [0.49, 0.50, 0.51]), (10.0, 0.55, [0.54, 0.55, 0.56])
    assert pareto_optimal([a, b]) == [False, True]  # 5 points apart, 95% interval +2.7 to +7.3
    a, b = (10.0, 0.50, [0.47, 0.50, 0.53]), (10.0, 0.55, [0.52, 0.55, 0.58])
    assert pareto_optimal([a, b]) == [True, True]  # interval -1.8 to +11.8: neither is worse beyond the noise
    assert pareto_optimal([(10.0, 0.50, [0.5]), (10.0, 0.55, [0.55])]) == [False, True]  # one seed: no noise known
    # a lower PSNR at a mean accuracy no lower dominates; a lower PSNR at a lower accuracy is a trade-off
    b, leakier, lower = ((10.0, 0.55, [0.52, 0.55, 0.58]), (12.0, 0.54, [0.51, 0.54, 0.57]),
                         (9.0, 0.53, [0.50, 0.53, 0.56]))
    assert pareto_optimal([b, leakier, lower]) == [True, False, True]


def test_grid_options_pair_in_command_line_order():
    options = [("--defense", "prune"), ("--grid", "ratio=0.5,0.9"), ("--grid", "scope=layer,global"),
               ("--defense", "censor"), ("--defense", "gaussian"), ("--grid", "sigma=0.01")]
    assert pair_options(options) == [("prune", {"ratio": [0.5, 0.9], "scope": ["layer", "global"]}),
                                     ("censor", {}), ("gaussian", {"sigma": [0.01]})]


@pytest.mark.parametrize("grid, words", [
    ({"pruen": {}}, ["unknown defense 'pruen'", "Did you mean 'prune'"]),
    ({"prune": {"rati": [0.5]}}, ["no parameter 'rati'", "valid parameters: ratio"]),
    ({"prune": {"ratio": [0.5, 1.5]}}, ["prune ratio=1.5", "ratio must be in [0, 1)"]),
    ({"gaussian": {"sigma": []}}, ["sigma has an empty value", "sigma=0.5,0.9"]),
    ({}, ["grid is empty", "--defense prune --grid ratio=0.5,0.9"]),
    ([(halved, {"scale": [1, 2]})], ["halved", "plain function takes no"]),
])
def test_bad_grid_is_rejected_before_any_work(tmp_path, grid, words):
    with pytest.raises(ConfigError) as err:
        audit.sweep(grid, out=tmp_path / "out", **TINY)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)
    assert not (tmp_path / "out").exists()


def test_bad_grid_on_the_command_line_is_one_line_before_any_work(tmp_path):
    for args, words in [(["--grid", "ratio=0.5", "--defense", "prune"], "comes before any --defense"),
                        (["--defense", "prune", "--grid", "ratio=0.5,1.5"], "ratio must be in [0, 1)"),
                        (["--defense", "prune", "--frontier-step", "3"], "step 3 is not an audited step"),
                        (["--defense", "prune", "--executor", "dask"], "Valid executors: local, ray")]:
        result = CliRunner().invoke(cli.main, ["sweep", *args, *TINY_CLI, "--out", str(tmp_path / "out")])
        assert result.exit_code == 2 and words in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_sweep_report_resume_and_a_new_grid_value(tmp_path):
    out = tmp_path / "sweep"
    # the README's sweep command line, on tiny settings
    result = CliRunner().invoke(cli.main, ["sweep", "--defense", "prune", "--grid", "ratio=0.5",
                                           "--defense", "gaussian", "--grid", "sigma=0.1", *TINY_CLI,
                                           "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "sweep.json").read_text())
    names = [c["name"] for c in data["cells"]]
    assert names == ["none", "prune-ratio=0.5", "gaussian-sigma=0.1"]
    assert data["defenses"] == ["prune", "gaussian"] and data["undefended"]["name"] == "none"
    assert data["pareto"] == [c["name"] for c, p in zip(data["cells"], pareto_optimal(
        [(c["psnr"], c["accuracy"], c["accuracies"]) for c in data["cells"]])) if p]
    baseline = UtilityResult.from_dict(json.loads((out / "cells/none/report.json").read_text())["utility"])
    for cell in data["cells"]:  # each row holds its cell's own audit numbers, at its worst step
        report = json.loads((out / cell["dir"] / "report.json").read_text())
        utility = UtilityResult.from_dict(report["utility"])
        assert cell["psnr"] == max(s["worst_case"]["psnr"] for s in report["steps"])
        assert (cell["accuracy"], cell["accuracy_std"]) == (utility.defended.mean, utility.defended.std)
        assert len(utility.defended.runs) == 3 and cell["accuracy_text"].endswith("3 seeds)")
        assert utility.undefended == baseline.defended  # one shared set of undefended runs
        assert (out / cell["report"]).is_file()
    html = (out / "sweep.html").read_text()
    assert "data:image/png;base64," in html and 'href="cells/prune-ratio=0.5/report.html"' in html
    assert (out / "frontier.png").read_bytes()[:4] == b"\x89PNG" and "| prune | ratio=0.5 |" in (out / "sweep.md").read_text()

    # the same sweep from Python recomputes nothing
    grid = {"prune": {"ratio": [0.5]}, "gaussian": {"sigma": [0.1]}}
    before, baseline_mtime = result_files(out), (out / "baseline.json").stat().st_mtime_ns
    again = audit.sweep(grid, out=out, **TINY)
    assert again.data["invocation"]["computed"] == [] and result_files(out) == before
    assert [c["psnr"] for c in again.cells] == [c["psnr"] for c in data["cells"]]

    # a new grid value and a user callable: exactly those two cells are computed
    grid = [("prune", {"ratio": [0.5, 0.9]}), ("gaussian", {"sigma": 0.1}), halved]
    grown = audit.sweep(grid, out=out, step=0, **TINY)
    assert grown.data["invocation"]["computed"] == ["prune-ratio=0.9", "halved"]
    assert {k: v for k, v in result_files(out).items() if k in before} == before
    assert (out / "baseline.json").stat().st_mtime_ns == baseline_mtime
    assert all(c["step"] == 0 for c in grown.cells) and grown.data["step"] == 0
    assert grown.cell("halved")["defense"] == "halved"


def test_a_diverged_cell_is_scored_on_what_it_left_and_stays_on_the_frontier(tmp_path):
    report = audit.sweep([nan_from_round_1], out=tmp_path, **{**TINY, "steps": [0], "utility_seeds": 2})
    cell = report.cell("nan_from_round_1")
    assert cell["diverged_runs"] == 2 and cell["diverged"].count("at round 1") == 2
    # what training left is the model after round 0, i.e. one undefended round of the utility recipe (not
    # the sweep's FL settings), seed by seed
    left = measure_utility("none", "mlp", load_dataset("embedded", size=8), 1, model_args={"hidden": 16}, seeds=2)
    assert cell["accuracy"] == left.defended.mean and cell["accuracy_std"] == left.defended.std
    assert cell["pareto"] == pareto_optimal([(c["psnr"], c["accuracy"], c["accuracies"]) for c in report.cells])[1]
    assert "| nan_from_round_1 | defaults |" in (tmp_path / "sweep.md").read_text()
    assert "at round 1" in (tmp_path / "sweep.md").read_text()


def test_an_interrupted_sweep_keeps_its_finished_cells(tmp_path, monkeypatch):
    grid = {"prune": {"ratio": [0.5]}, "gaussian": {"sigma": [0.1]}}
    real = sweep_module.run_cell

    def interrupted(job, shared):
        if job.cell.name == "gaussian-sigma=0.1":
            raise KeyboardInterrupt
        return real(job, shared)

    monkeypatch.setattr(sweep_module, "run_cell", interrupted)
    with pytest.raises(KeyboardInterrupt):
        audit.sweep(grid, out=tmp_path, **{**TINY, "utility": False})
    monkeypatch.setattr(sweep_module, "run_cell", real)
    resumed = audit.sweep(grid, out=tmp_path, **{**TINY, "utility": False})
    assert resumed.data["invocation"]["computed"] == ["gaussian-sigma=0.1"]
    assert resumed.data["progress"] == {"done": 3, "total": 3}


@pytest.fixture
def local_ray():
    """A local Ray instance with 2 CPUs (the sweep uses it as it is), or a skip where Ray cannot start."""
    ray = pytest.importorskip("ray", reason="runs the sweep on Ray: needs the optional [ray] extra "
                                           "(pip install -e '.[ray]')")
    try:
        ray.init(num_cpus=2, include_dashboard=False)
    except Exception as err:  # e.g. no shared memory or sockets in this environment
        pytest.skip(f"runs the sweep on Ray, which cannot start here (shared memory and local sockets "
                    f"needed): {type(err).__name__}: {err}")
    yield
    ray.shutdown()


def test_ray_executor_gives_the_local_numbers(tmp_path, local_ray):
    """Prune and gaussian at one setting each: every attack and utility number of every cell is
    the same on Ray as locally, and as an audit's in a process on more threads."""
    grid = {"prune": {"ratio": [0.9]}, "gaussian": {"sigma": [0.1]}}
    # (step, attack) groups of two private images; LeNet at 16 px: its training loss depends on the thread count
    settings = {**TINY, "model": "lenet", "model_args": {"width": 4}, "image_size": 16, "images": 2,
                "utility_seeds": 2}
    local = audit.sweep(grid, out=tmp_path / "local", **settings)
    ray_run = audit.sweep(grid, out=tmp_path / "ray", executor="ray", executor_args={"num_cpus": 2}, **settings)
    names = ["gaussian-sigma=0.1", "none", "prune-ratio=0.9"]
    assert sorted(ray_run.data["invocation"]["computed"]) == names
    assert ray_run.data["invocation"]["group_jobs"] == 6  # 3 cells x 2 steps x ig, each a Ray task
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # an audit in a process on more threads than a Ray task: the same utility
    try:
        wide = [Audit(spec, defense_args=args, **audit_settings(**settings, out=tmp_path / "wide")).utility()
                for spec, args in (("none", {}), ("prune", {"ratio": 0.9}), ("gaussian", {"sigma": 0.1}))]
    finally:
        torch.set_num_threads(threads)

    def numbers(utility):  # every per-seed number, defended and undefended (the run times aside)
        return [(r.seed, r.accuracy, r.final_loss) for r in utility.defended.runs + utility.undefended.runs]

    assert [c["name"] for c in local.cells] == ["none", "prune-ratio=0.9", "gaussian-sigma=0.1"]
    for a, b, c in zip(local.cells, ray_run.cells, wide):
        assert (a["name"], a["psnr"], a["ssim"]) == (b["name"], b["psnr"], b["ssim"])
        results = [json.loads((tmp_path / run / a["dir"] / "report.json").read_text()) for run in ("local", "ray")]
        assert [r["metrics"] for r in results[0]["results"]] == [r["metrics"] for r in results[1]["results"]]
        utility = [UtilityResult.from_dict(r["utility"]) for r in results]
        assert len(numbers(utility[0])) == 4 and None not in numbers(utility[0])[0]
        assert numbers(utility[0]) == numbers(utility[1]) == numbers(c)
