"""One unit for the budget: gradient evaluations of the audited model, mapped by each attack
to its own iterations; and the audit's settings as validated dataclasses."""
import pytest
import torch

import adaptive  # noqa: F401  (registers through-defense)
from attacks import ATTACKS, observe
from audit.core.errors import ConfigError
from audit.core.models import build_model
from audit.core.types import BUDGET_UNIT, clean_gradients, iterations_for
from audit.engine.settings import AttackSettings, DataSettings, FLSettings, OutputSettings


def noisy(model, inputs, labels, *, loss_fn, generator):
    """A user's stochastic defense (a plain callable: EOT recomputes its gradient per draw)."""
    return [g + 1e-3 * torch.randn(g.shape, generator=generator) for g in clean_gradients(model, inputs, labels, loss_fn)]


@pytest.fixture(scope="module")
def obs():
    model = build_model("lenet", (3, 8, 8), 4, seed=0)
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    return observe(model, x, torch.tensor([1]), noisy, seed=0)


def test_restarts_and_draws_are_paid_from_the_same_budget(obs, one_thread):
    one = ATTACKS.build("ig").reconstruct(obs, 24, 0)
    four = ATTACKS.build("ig", restarts=4).reconstruct(obs, 24, 0)
    assert one.trace["iterations"] == 24 and four.trace["iterations"] == 6
    # EOT over 3 draws of a stochastic defense that recomputes its gradient: 3 per restart
    eot = ATTACKS.build("through-defense", samples=3).reconstruct(obs, 24, 0)
    assert eot.trace["iterations"] == 8
    for rec in (one, four, eot):  # the last evaluation picks the restart; nothing else is spent
        cost = rec.trace["gradient_evaluations"] / rec.trace["evaluations"]
        assert rec.trace["gradient_evaluations"] <= 24 + cost


def test_a_line_search_stops_within_the_budget(obs, one_thread):
    rec = ATTACKS.build("dlg").reconstruct(obs, 30, 0)
    cost = rec.trace["gradient_evaluations"] / rec.trace["evaluations"]
    backtracks = 8  # one L-BFGS step may evaluate a few times before the budget check
    assert rec.trace["gradient_evaluations"] <= 30 + backtracks * cost
    assert rec.trace["iterations"] < 30  # line searches cost more than one evaluation per iteration


def test_iterations_for_rounds_down_but_always_runs():
    assert iterations_for(200, 1) == 200 and iterations_for(200, 8) == 25 and iterations_for(3, 8) == 1
    assert BUDGET_UNIT == "gradient evaluations"


def test_settings_are_validated_when_built():
    with pytest.raises(ConfigError, match="budget must be a positive integer"):
        AttackSettings(budget=0)
    with pytest.raises(ConfigError, match="steps must be"):
        AttackSettings(steps="a,b")
    with pytest.raises(ConfigError, match="images must be a positive integer"):
        DataSettings(images=-1)
    with pytest.raises(ConfigError, match="clients must be a positive integer"):
        FLSettings(clients=0)
    assert AttackSettings(steps="5,0,5", names="auto,dlg,auto").steps == (0, 5)
    assert AttackSettings(names="auto,dlg,auto").names == ("auto", "dlg")
    assert str(OutputSettings(out="x").out) == "x"
