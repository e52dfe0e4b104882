"""The planner probes a defense as a black box and identifies its traits."""
import pytest
import torch

from adaptive.planner.plan import _merge, plan
from adaptive.planner.rules import PlannedAttack
from adaptive.planner.probe import probe_defense
from audit.core.errors import DefenseError
from audit.core.reasons import Reason
from audit.core.types import clean_gradients, gradient_transform
from audit.engine.plan_report import plan_lines, trait_lines
from audit.report.reasons import REASONS, word
from defenses.registry import build_defense

pytestmark = pytest.mark.usefixtures("one_thread")


# defense spec -> (traits that must be on, traits that must be off)
BUILTIN = {
    "none": ({"identity", "differentiable", "analytic_linear"},
             {"stochastic", "sparse", "low_rank", "architectural"}),
    "gaussian": ({"stochastic", "differentiable", "has_log_prob"},
                 {"sparse", "orthogonal", "norm_preserving", "identity"}),
    "laplacian": ({"stochastic", "has_log_prob"}, {"sparse", "identity"}),
    "prune": ({"sparse", "differentiable"}, {"stochastic", "one_layer_changed", "low_rank"}),
    "soft-prune": ({"stochastic", "has_log_prob"}, {"identity"}),
    "quantize": ({"quantized"}, {"stochastic", "sign_only", "sparse"}),
    "clip": ({"rescaled"}, {"stochastic", "identity"}),
    "dp-sgd": ({"stochastic"}, {"sparse", "has_log_prob"}),
    "soteria": ({"one_layer_changed", "sparse"}, {"stochastic", "architectural"}),
    "precode": ({"architectural", "stochastic", "analytic_linear"}, {"one_layer_changed"}),
    # (ATS may read as sparse: its always-applied translations and crop fill pixels with zeros)
    "ats": ({"input_transform", "stochastic"}, {"architectural", "low_rank"}),
    "censor": ({"orthogonal", "norm_preserving", "stochastic"}, {"sparse", "low_rank"}),
    "svdefense": ({"low_rank"}, {"stochastic", "sparse"}),
    "refiner": ({"input_transform", "stochastic"}, {"architectural", "one_layer_changed"}),
}
# settings that keep a probe fast on CPU (the refiner's default evaluation network trains);
# a large eps keeps the refiner's projection inactive, so its gradient is exactly that of
# the refined data (with the default eps it is projected back towards the clean gradient)
FAST = {
    "refiner": lambda: {"iota": 2, "eps": 10.0,
                        "evaluator": torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 1))},
}


# defense -> adaptive attacks the plan must contain
PLANNED = {
    "none": {"analytic"}, "gaussian": {"bayes-l2", "bayes-optimal"}, "laplacian": {"bayes-l1"},
    "prune": {"mask-replay", "through-defense"}, "soft-prune": {"bayes-optimal"}, "quantize": {"through-defense"},
    "dp-sgd": {"bayes-l2"}, "soteria": {"layer-drop", "mask-replay"}, "precode": {"precode-latent", "analytic"},
    "ats": {"through-defense"}, "censor": {"censor-invariants"}, "svdefense": {"svd-subspace", "analytic"},
}


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_planner_identifies_each_builtin_defense(name):
    on, off = BUILTIN[name]
    p = plan(build_defense(name, **FAST.get(name, dict)()), seed=0)
    flags = p.traits.flags()
    assert {k for k in on if not flags[k]} == set(), flags
    assert {k for k in off if flags[k]} == set(), flags
    assert p.names()[0] == "portfolio" and PLANNED.get(name, set()) <= set(p.names()), p.names()
    assert not p.unavailable  # every proposed attack is registered


def test_noise_scale_and_family_are_estimated():
    g = probe_defense(build_defense("gaussian", sigma=0.05), seed=1)
    assert g.noise_family == "gaussian" and abs(g.noise_std - 0.05) < 0.05 * 0.05
    lap = probe_defense(build_defense("laplacian", sigma=0.05), seed=1)
    assert lap.noise_family == "laplace"
    assert abs(lap.noise_std - 0.05 * 2 ** 0.5) < 0.1 * 0.05 * 2 ** 0.5  # Laplace std = b sqrt(2)


def test_soteria_changes_exactly_its_defended_layer():
    t = probe_defense(build_defense("soteria", ratio=0.5, layer="last"), seed=0)
    assert t.changed_layers == ["10.weight"]
    assert t.layer("10.weight").zero_frac_defended == 0.5  # 16 of 32 input features pruned


def test_plain_user_callable_that_prunes_is_planned_from_probing_alone():
    def my_prune(model, inputs, labels, *, loss_fn, generator):
        grads = clean_gradients(model, inputs, labels, loss_fn)
        return [g * (g.abs() >= g.abs().flatten().quantile(0.8)) for g in grads]

    p = plan(my_prune)
    flags = p.traits.flags()
    assert flags["sparse"] and not flags["stochastic"] and flags["differentiable"]
    assert all(0.78 < p.traits.layer(n).zero_frac_defended <= 0.8 for n in ("2.weight", "8.weight"))
    assert p.traits.declared_stochastic is None and not p.traits.has_log_prob
    assert p.names()[0] == "portfolio"
    mask = next(a for a in p.attacks + p.unavailable if a.name == "mask-replay")
    assert mask.why.code == "planner-mask" and f"{p.traits.sparsity:.0%} extra exact zeros" in word(mask.why)


def test_plain_callable_that_transforms_inputs_is_detected_by_consistency():
    def flip(model, inputs, labels, *, loss_fn, generator):
        return clean_gradients(model, inputs.flip(-1), labels, loss_fn)

    t = probe_defense(flip, seed=0)
    assert t.input_transform and t.input_transform_source == Reason("transform-probed-other-input")
    assert not t.stochastic and t.changed_layers


def test_orthogonal_norm_preserving_callable_gets_invariant_matching():
    @gradient_transform(stochastic=True)
    def rotate(grads, generator=None):
        out = []
        for g in grads:
            r = torch.randn(g.shape, generator=generator)
            o = r - (r * g).sum() / (g * g).sum() * g
            out.append(o * g.norm() / o.norm())
        return out

    p = plan(rotate)
    assert p.traits.orthogonal and p.traits.norm_preserving and p.traits.stochastic
    proposed = {a.name: a for a in p.attacks + p.unavailable}
    assert "censor-invariants" in proposed
    assert proposed["through-defense"].settings["samples"] > 1


def test_global_randomness_is_flagged_and_broken_defenses_are_named():
    @gradient_transform(stochastic=True)
    def global_noise(grads):
        return [g + 0.01 * torch.randn(g.shape) for g in grads]

    t = probe_defense(global_noise, seed=0)
    assert t.stochastic and not t.reproducible
    assert Reason("defense-global-randomness") in t.notes
    assert "draws from global randomness" in "\n".join(trait_lines(t))

    def wrong(model, inputs, labels, *, loss_fn, generator):
        return clean_gradients(model, inputs, labels, loss_fn)[:-1]

    with pytest.raises(DefenseError, match="wrong"):
        plan(wrong)


def test_plan_reasons_appear_in_the_summary():
    p = plan(build_defense("prune", ratio=0.9))
    text = "\n".join(plan_lines(p))
    assert "sparse" in text and "the mask is read from the zeros" in text
    assert p.to_dict()["traits"]["flags"]["sparse"] is True
    assert p.to_dict()["attacks"][0]["why"] == {"code": "planner-naive-baseline", "params": {}}


@pytest.mark.parametrize("defense, args", [("none", {}), ("prune", {"ratio": 0.9}), ("gaussian", {}), ("laplacian", {}),
                                           ("soteria", {}), ("censor", {"trials": 2, "active_rounds": 1}),
                                           ("svdefense", {}), ("clip", {"bound": 0.01}), ("precode", {}),
                                           ("ats", {}), ("quantize", {"bits": 2})])
def test_every_planned_attacks_reason_is_a_code_the_report_words(defense, args):
    p = plan(build_defense(defense, **args), rounds=(2,))
    whys = [(a.name, a.why) for a in p.attacks + p.unavailable]
    for name, why in whys + [("traits", p.traits.input_transform_source)] + [("traits", n) for n in p.traits.notes]:
        assert why.code in REASONS, (defense, name, why)
        sentence = word(why)
        assert sentence != str(why) and "{" not in sentence, (defense, name, sentence)


def test_a_defense_that_detaches_its_output_is_noted_not_differentiable_in_words():
    def detached(model, inputs, labels, *, loss_fn, generator):
        return [g.detach() for g in clean_gradients(model, inputs, labels, loss_fn)]

    t = plan(detached).traits
    assert not t.differentiable
    assert Reason("defense-not-differentiable", why=Reason("defense-detached").to_dict()) in t.notes
    assert "not differentiable: its output is detached from the inputs" in trait_lines(t)


def test_reasons_of_rules_proposing_the_same_attack_are_kept_together():
    merged = _merge([PlannedAttack("ig", {}, Reason("planner-rescaled"), adaptive=False),
                     PlannedAttack("ig", {"restarts": 2}, Reason("planner-input-transform", source="declared"),
                                   adaptive=False),
                     PlannedAttack("ig", {}, Reason("planner-rescaled"), adaptive=False)])
    assert len(merged) == 1 and merged[0].settings == {"restarts": 2}
    assert merged[0].why.code == "planner-several" and len(merged[0].why.params["reasons"]) == 2
    assert word(merged[0].why) == ("only the norm changes (clipping): cosine matching ignores it; input transform "
                                   "(declared): the gradient is that of the transformed image, which plain matching "
                                   "recovers early in training")


def test_plan_command_prints_traits_and_reasons():
    from click.testing import CliRunner

    from cli import main

    result = CliRunner().invoke(main, ["plan", "--defense", "prune", "--defense-arg", "ratio=0.9"])
    assert result.exit_code == 0, result.output
    assert "traits: differentiable, sparse" in result.output and "- mask-replay [adaptive]" in result.output
    bad = CliRunner().invoke(main, ["plan", "--defense", "prunee"])
    assert bad.exit_code == 2 and "Did you mean 'prune'" in bad.output
