"""End-to-end audits on tiny budgets: a small MLP on 16x16 embedded images, where the
analytic attack is exact for batch 1 and one optimisation attack runs a few iterations."""
import json

import pytest
import torch
from click.testing import CliRunner

import audit
import cli
from audit.engine import runner as runner_module
from audit.core.records import UtilityResult
from audit.core.types import clean_gradients

TINY = dict(model="mlp", model_args={"hidden": 32}, image_size=16, budget=5, utility=False, progress=False)


def noisy_defense(model, inputs, labels, *, loss_fn, generator):
    """A user's defense: the clean gradient plus Gaussian noise of std 0.01 (seeded)."""
    grads = clean_gradients(model, inputs, labels, loss_fn)
    return [g + 0.01 * torch.randn(g.shape, generator=generator, device=g.device) for g in grads]


def breaks_in_training(model, inputs, labels, *, loss_fn, generator):
    """Works on the private batch (1 image) and the planner's probes, raises on the FL
    training batches (4 images in these tests)."""
    if inputs.shape[0] == 4:
        raise RuntimeError("cannot handle a batch of 4")
    return clean_gradients(model, inputs, labels, loss_fn)


def nan_on_private(model, inputs, labels, *, loss_fn, generator):
    """Returns NaN for batch-1 inputs (the private batches of these tests)."""
    grads = clean_gradients(model, inputs, labels, loss_fn)
    return [g * float("nan") for g in grads] if inputs.shape[0] == 1 else grads


def test_audit_of_none_reports_leakage_at_step_0(tmp_path):
    report = audit.run(defense="none", steps=[0], attacks="auto", images=1, out=tmp_path, **TINY)
    ids = [a["id"] for a in report.data["attacks"]]
    assert "portfolio" in ids and "analytic" in ids  # base attack + the planner's pick for an MLP
    step0 = report.step(0)
    assert step0["attacks"]["analytic"]["psnr"] > 60  # exact up to float error
    assert step0["attacks"]["spear"]["psnr"] > 60  # one image: the layer's gradient has rank one
    assert step0["verdict"]["label"] == "leaks" and report.verdict == "leaks"
    assert step0["risk"]["success"] == 1.0 and step0["risk"]["strongest_attack"] in ("analytic", "spear")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["threat_model"]["labels_shared"] is False
    assert "disjoint" in data["threat_model"]["training_data"]
    assert data["threat_model"]["extras"] == ["aux_images", "aux_labels"]  # the declared auxiliary data
    assert "train split" in data["threat_model"]["attacker_auxiliary_data"]
    assert data["plan"]["traits"]["analytic_layers"]
    assert all((tmp_path / f).is_file() for f in ("report.md", "report.html", "psnr_vs_step.png"))


def test_custom_callable_from_python(tmp_path):
    report = audit.run(defense=noisy_defense, steps=[0, 1], attacks=["analytic"], images=1, out=tmp_path, **TINY)
    assert report.data["defense"]["name"] == "noisy_defense"
    assert report.data["defense"]["callable"].endswith(":noisy_defense")
    assert [s["step"] for s in report.steps] == [0, 1] and not report.failures
    # the noise really reaches the shared gradient: analytic inversion is no longer exact
    assert 0 < report.psnr(0, "analytic") < 60


def test_utility_compares_training_with_and_without_the_defense_over_seeds(tmp_path):
    settings = {**TINY, "model": "lenet", "model_args": None, "utility": True, "utility_steps": 3}
    report = audit.run(defense=noisy_defense, steps=[0], attacks=["analytic"], images=1, out=tmp_path, **settings)
    utility = UtilityResult.from_dict(report.data["utility"])
    assert utility.setting["steps"] == 3 and len(utility.defended.runs) == 3 == len(utility.undefended.runs)
    # the noise changed training, seed by seed
    assert all(d.final_loss != u.final_loss for d, u in zip(utility.defended.runs, utility.undefended.runs))
    md = (tmp_path / "report.md").read_text()
    assert "| test accuracy: mean ± std (min-max) |" in md and "relative accuracy (mean defended" in md
    assert "difference of mean accuracies (defended - undefended)" in md and "(Welch t over 3 and 3 seeds)" in md
    assert "3 seeds" in md
    # other utility seeds: the utility is measured again, every attack result is reused
    result = next((tmp_path / "runs").glob("*/results/*.json"))
    before = result.stat().st_mtime_ns
    fewer = audit.run(defense=noisy_defense, steps=[0], attacks=["analytic"], images=1, out=tmp_path,
                      **{**settings, "utility_seeds": 2})
    assert len(UtilityResult.from_dict(fewer.data["utility"]).defended.runs) == 2
    assert result.stat().st_mtime_ns == before and fewer.data["run_key"] == report.data["run_key"]
    with_args = audit.run(defense=noisy_defense, steps=[0], attacks=["analytic"], images=1,
                          out=tmp_path / "args", **{**settings, "model_args": {"width": 4}, "utility_seeds": 1})
    measured = UtilityResult.from_dict(with_args.data["utility"])  # the model arguments reach the utility runs
    assert measured.setting["model_args"] == {"width": 4} and measured.defended.std is None  # one seed: no spread
    assert measured.undefended.runs[0].final_loss != utility.undefended.runs[0].final_loss  # a narrower model


def test_custom_callable_through_module_attr_on_the_cli(tmp_path):
    runner = CliRunner()
    args = ["audit", "--model", "mlp", "--model-arg", "hidden=32", "--steps", "0", "--images", "1",
            "--attacks", "analytic", "--budget", "5", "--no-utility", "--quiet", "--out", str(tmp_path)]
    result = runner.invoke(cli.main, args + ["--defense", f"{__name__}:noisy_defense"])
    assert result.exit_code == 0, result.output
    assert "verdict:" in result.output
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["defense"]["name"] == "noisy_defense" and data["results"][0]["status"] == "ok"
    rerender = runner.invoke(cli.main, ["report", str(tmp_path)])
    assert rerender.exit_code == 0 and "step     0" in rerender.output
    bad = runner.invoke(cli.main, args + ["--defense", "no_such_pkg.mod:fn"])
    assert bad.exit_code == 2 and "cannot import module 'no_such_pkg.mod'" in bad.output
    missing = runner.invoke(cli.main, args + ["--defense", f"{__name__}:no_such_defense"])
    assert missing.exit_code == 2 and "has no attribute 'no_such_defense'" in missing.output


def test_rerun_resumes_and_changed_settings_start_fresh(tmp_path, monkeypatch):
    kwargs = dict(defense="none", steps=[0], attacks=["analytic", "ig"], out=tmp_path, **TINY)
    first = audit.run(images=1, **kwargs)
    calls = []
    original = runner_module.attack_one

    def counting(run, spec, obs, images, labels, step, image, **kw):
        calls.append((step, spec.id, image))
        return original(run, spec, obs, images, labels, step, image, **kw)

    monkeypatch.setattr(runner_module, "attack_one", counting)
    again = audit.run(images=1, **kwargs)
    assert calls == [] and again.data["results"] == first.data["results"]
    more = audit.run(images=2, **kwargs)  # one more private image: only it is attacked
    assert sorted(calls) == [(0, "analytic", 1), (0, "ig", 1)]
    assert more.data["progress"] == {"done": 4, "total": 4}
    assert more.data["results"][0] == first.data["results"][0]
    fewer = audit.run(images=1, **kwargs)  # back to one image: the report holds only what it asked for
    assert fewer.data["results"] == first.data["results"] and fewer.data["progress"] == {"done": 2, "total": 2}
    assert fewer.data["status"] == first.data["status"]
    audit.run(images=1, **{**kwargs, "budget": 6})  # a changed setting: a fresh run, nothing reused
    assert len(calls) == 4 and len(list((tmp_path / "runs").iterdir())) == 2


def test_a_changed_attack_default_redoes_its_results_only(tmp_path, monkeypatch):
    from attacks.presets import ATTACKS

    kwargs = dict(defense="none", steps=[0], attacks=["analytic", "ig"], images=1, out=tmp_path, **TINY)
    audit.run(**kwargs)
    calls = []
    original = runner_module.attack_one

    def counting(run, spec, obs, images, labels, step, image, **kw):
        calls.append(spec.id)
        return original(run, spec, obs, images, labels, step, image, **kw)

    monkeypatch.setattr(runner_module, "attack_one", counting)
    # a release whose ig preset defaults to another TV weight: the stored ig result is stale
    monkeypatch.setattr(ATTACKS.get("ig"), "defaults", {**ATTACKS.get("ig").defaults, "tv": 0.3})
    audit.run(**kwargs)
    assert calls == ["ig"] and len(list((tmp_path / "runs").iterdir())) == 1


def test_the_server_optimizer_trains_between_steps_and_is_declared(tmp_path):
    runs = {}
    for name, spec in (("plain", "sgd"), ("momentum", "sgd:momentum=0.9,nesterov=1,weight_decay=5e-4")):
        report = audit.run(defense="none", steps=[0, 3], attacks=["analytic"], images=1, server_optimizer=spec,
                           out=tmp_path / name, **TINY)
        runs[name] = torch.load(next((tmp_path / name / "runs").iterdir()) / "checkpoints" / "s3.pt")
        declared = report.data["threat_model"]["client_training"]
        assert ("the server steps with sgd(momentum=0.9" in declared) == (name == "momentum"), declared
    assert not torch.equal(runs["plain"]["2.weight"], runs["momentum"]["2.weight"])  # the momentum moved the model


def test_fedavg_with_several_clients_is_simulated_and_declared(tmp_path):
    report = audit.run(defense="none", steps=[0, 2], attacks=["analytic"], images=1, clients=3, local_steps=2,
                       local_lr=0.05, out=tmp_path, **TINY)
    threat = report.data["threat_model"]
    assert threat["local_steps"] == 2 and threat["local_lr"] == 0.05 and "3 client(s)" in threat["training_data"]
    fl = dict(report.data["settings"]["fl"])
    assert fl.pop("local_optimizer")["name"] == "sgd"
    assert fl.pop("server_optimizer")["momentum"] == 0.0  # the server applies the mean update as is
    client = fl.pop("client")  # the client's training as one record: the local lr decided there
    assert (client["lr"], client["steps"], client["shares"], client["mode"]) == (0.05, 2, "update", "train")
    assert fl == {"lr": 0.1, "batch_size": 8, "clients": 3, "local_steps": 2, "local_lr": 0.05, "client_mode": "train",
                  "local_batch_size": None, "local_epochs": None, "shares": "update"}
    assert report.step(2)["attacks"]["analytic"]["status"] in ("ok", "not applicable")
    run_dir = next((tmp_path / "runs").iterdir())
    first, later = (torch.load(run_dir / "checkpoints" / f"s{s}.pt") for s in (0, 2))
    assert not torch.equal(first["2.weight"], later["2.weight"])  # the model was trained between checkpoints


def test_defense_failing_in_training_is_reported_and_earlier_steps_audited(tmp_path):
    report = audit.run(defense=breaks_in_training, steps=[0, 2], attacks=["analytic"], images=1,
                       train_batch_size=4, out=tmp_path, **TINY)
    assert report.step(0)["attacks"]["analytic"]["status"] == "ok"
    assert report.step(2)["attacks"]["analytic"]["status"] == "error"
    (training,) = [f for f in report.failures if f.get("phase") == "training"]
    assert training["step"] == 0 and training["defense"] == "breaks_in_training"
    assert "cannot handle a batch of 4" in training["error"]
    assert "breaks_in_training" in (tmp_path / "report.md").read_text()


def wrong_shapes_on_private(model, inputs, labels, *, loss_fn, generator):
    """Drops the last gradient tensor for batch-1 inputs."""
    grads = clean_gradients(model, inputs, labels, loss_fn)
    return grads[:-1] if inputs.shape[0] == 1 else grads


@pytest.mark.parametrize("defense, problem", [(nan_on_private, "NaN"), (wrong_shapes_on_private, "tensors for")])
def test_defense_returning_nan_or_wrong_shapes_is_reported_not_crashed_on(tmp_path, defense, problem):
    report = audit.run(defense=defense, steps=[0], attacks=["analytic", "ig"], images=1, out=tmp_path, **TINY)
    assert report.data["status"] == "incomplete (analytic, ig failed)" and report.verdict == "incomplete"
    failures = report.failures
    assert {f["attack"] for f in failures} == {"analytic", "ig"} and all(f["step"] == 0 for f in failures)
    assert all(defense.__name__ in f["error"] and problem in f["error"] for f in failures)
    assert "probing the defense failed" in report.data["plan"]["error"]
    assert defense.__name__ in (tmp_path / "report.html").read_text()


def test_attack_settings_override_the_planner_and_are_checked(tmp_path):
    from audit.engine.settings import parse_attack_args

    args = parse_attack_args(["ig.restarts=2", "ig.tv=0.001", "learned-inverter.pairs=8"])
    assert args == {"ig": {"restarts": 2, "tv": 0.001}, "learned-inverter": {"pairs": 8}}
    report = audit.run(defense="none", steps=[0], attacks=["ig"], attack_args={"ig": {"restarts": 2}}, images=1,
                       out=tmp_path, **TINY)
    assert report.data["attacks"][0]["settings"] == {"restarts": 2}
    assert report.data["results"][0]["trace"]["restarts"] == 2


def test_bad_options_name_the_fix(tmp_path):
    from audit.engine.settings import parse_attack_args
    from audit.core.errors import ConfigError

    with pytest.raises(ConfigError, match="attack.setting=value"):
        parse_attack_args(["restarts=2"])
    with pytest.raises(ConfigError, match="no parameter 'nope'"):
        audit.run(defense="none", steps=[0], attacks=["ig"], attack_args={"ig": {"nope": 1}}, out=tmp_path, **TINY)

    with pytest.raises(ConfigError, match="steps"):
        audit.run(defense="none", steps="0,x", out=tmp_path, **TINY)
    with pytest.raises(ConfigError, match="unknown attack 'nope'"):
        audit.run(defense="none", steps=[0], attacks=["nope"], out=tmp_path, **TINY)
    with pytest.raises(ConfigError, match="test split has"):
        audit.run(defense="none", steps=[0], images=10_000, out=tmp_path, **TINY)


def test_ctrl_c_keeps_finished_results_and_the_rerun_completes(tmp_path, monkeypatch):
    kwargs = dict(defense="none", steps=[0, 1], attacks=["analytic"], images=1, out=tmp_path, **TINY)
    original = runner_module.attack_one
    calls = []

    def interrupted_second(run, spec, obs, images, labels, step, image, **kw):
        calls.append(step)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(run, spec, obs, images, labels, step, image, **kw)

    monkeypatch.setattr(runner_module, "attack_one", interrupted_second)
    with pytest.raises(KeyboardInterrupt):
        audit.run(**kwargs)
    partial = json.loads((tmp_path / "report.json").read_text())
    assert partial["status"] == "interrupted" and partial["progress"] == {"done": 1, "total": 2}
    monkeypatch.setattr(runner_module, "attack_one", original)
    report = audit.run(**kwargs)
    assert report.data["status"] == "complete" and report.data["progress"]["done"] == 2
    assert report.data["results"][0] == partial["results"][0]


def test_run_key_covers_the_data_and_the_model_arguments(tmp_path):
    kwargs = dict(defense="none", steps=[0], attacks=["analytic"], images=1, out=tmp_path, **TINY)
    audit.run(**kwargs)
    audit.run(**kwargs)  # the same data: resumed
    audit.run(**kwargs, data_args={"grid": 6})  # other private images: a fresh run
    audit.run(**{**kwargs, "model_args": {"hidden": 16}})
    runs = [json.loads((p / "manifest.json").read_text()) for p in (tmp_path / "runs").iterdir()]
    assert len(runs) == 3
    grids = sorted(str(r["settings"]["data"]["args"].get("grid")) for r in runs)
    assert grids == ["6", "None", "None"] and all(len(r["settings"]["data"]["content_sha256"]) == 16 for r in runs)


def test_dp_sgd_audit_reports_the_epsilon_its_steps_spend(tmp_path):
    from defenses.dpsgd import privacy_spent

    report = audit.run(defense="dp-sgd", defense_args={"noise_multiplier": 1.0}, steps=[0, 2], attacks=["analytic"],
                       images=1, out=tmp_path, **TINY)
    privacy = report.data["privacy"]
    assert privacy["applicable"] and privacy["sample_rate"] == pytest.approx(8 / 480)
    spent = {p["step"]: p["epsilon"] for p in privacy["per_step"]}
    assert spent[0] == 0 and spent[2] == pytest.approx(privacy_spent(2, 8 / 480, 1.0).epsilon)
    assert "## Privacy spent" in (tmp_path / "report.md").read_text()
    assert any("Poisson" in d for d in report.data["differences"])  # the defense's declared differences
    none = audit.run(defense="none", steps=[0], attacks=["analytic"], images=1, out=tmp_path / "none", **TINY)
    assert not none.data["privacy"]["applicable"] and "no (epsilon, delta)" in none.data["privacy"]["reason"]


def test_input_transform_is_scored_against_what_the_client_trained_on(tmp_path):
    report = audit.run(defense="ats", steps=[0], attacks=["analytic"], images=1, out=tmp_path, **TINY)
    (record,) = report.data["results"]
    # analytic inversion recovers the transformed batch exactly, not the original
    assert record["metrics_trained"]["psnr"] > 60 > 30 > record["metrics"]["psnr"]
    assert report.verdict == "leaks" and report.step(0)["attacks"]["analytic"]["psnr_trained"] > 60
    md = (tmp_path / "report.md").read_text()
    assert "PSNR vs trained-on batch" in md and "Follows the ATS code" in md


def test_rounds_sharing_the_clean_gradient_are_found_and_attacked(tmp_path):
    report = audit.run(defense="censor", defense_args={"trials": 2, "active_rounds": 1}, steps=[0, 2],
                       attacks=["analytic"], images=1, out=tmp_path, **TINY)
    probe = report.data["plan"]["traits"]["rounds_probe"]
    assert 0 not in probe["clean_rounds"] and {1, 2, 5} <= set(probe["clean_rounds"])
    assert probe["clean_calls"] == 3 * len(probe["clean_rounds"]) < probe["calls"]
    assert "shared the clean gradient" in report.data["attacks"][0]["reason"]
    assert report.psnr(2, "analytic") > 60 and report.psnr(0, "analytic") < 30  # CENSOR off from round 1
    assert report.step(2)["verdict"]["label"] == "leaks"
    assert "clean gradient shared" in (tmp_path / "report.md").read_text()


def test_progress_counts_image_iterations_for_the_whole_audit(tmp_path, monkeypatch):
    """The bar's unit is the image-iteration (gradient evaluations x private images), its
    total covers every (step, attack, image) of the audit (so tqdm's rate and ETA are for the
    whole audit), it moves while an attack iterates, and it ends exactly at the total."""
    from audit.engine import schedule

    bars = []

    class Recorder:
        def __init__(self, total, initial):
            self.total, self.n, self.moves = total, initial, []
            bars.append(self)

        def update(self, k):
            self.n += k
            self.moves.append(k)

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

    monkeypatch.setattr(schedule, "_progress", lambda total, initial, enabled, label="audit": Recorder(total, initial))
    settings = {**TINY, "budget": 20, "batch_size": 2}
    audit.run(defense="none", steps=[0, 1], attacks=["ig", "analytic"], images=2, out=tmp_path, **settings)
    bar, = bars
    assert bar.total == 2 * 2 * 2 * 20 * 2          # steps x attacks x images x budget x batch size
    assert bar.n == bar.total and bar.moves
    assert len(bar.moves) > 2 * 2 * 2                 # ig moved the bar while it iterated, not once per result
    bars.clear()
    audit.run(defense="none", steps=[0, 1, 2], attacks=["ig", "analytic"], images=2, out=tmp_path, **settings)
    assert bars[0].total == 3 * 2 * 2 * 20 * 2 and bars[0].n == bars[0].total  # resumed: starts at the 2 done steps
    assert sum(bars[0].moves) == 1 * 2 * 2 * 20 * 2


def test_the_settings_object_trains_the_utility_recipe_by_default():
    from audit.engine.settings import OutputSettings
    from audit.engine.utility import PROTOCOL

    assert OutputSettings().utility_steps == PROTOCOL.rounds
