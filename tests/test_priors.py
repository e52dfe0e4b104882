"""Image priors: values on known images, vmap compatibility, registry errors."""
import pytest
import torch

from audit.core.errors import ConfigError, NotApplicable
from priors import PRIORS, PriorContext


pytestmark = pytest.mark.usefixtures("one_thread")


def ctx(**kw):
    return PriorContext(**kw)


def test_registry_lists_the_priors_and_rejects_unknown_names():
    assert {"tv", "l2", "range", "bn", "group"} <= set(PRIORS.names())
    with pytest.raises(ConfigError, match="Valid priors"):
        PRIORS.build("totalvariation")
    with pytest.raises(ConfigError, match="anisotropic"):
        PRIORS.build("tv", kind="diagonal")


def test_tv_is_zero_on_constant_images_and_known_on_a_step_edge():
    flat = torch.full((1, 3, 8, 8), 0.3)
    edge = torch.zeros(1, 1, 4, 4)
    edge[..., :, 2:] = 1.0  # one vertical edge: |dx| = 1 on 4 of the 12 horizontal pairs
    aniso, iso = PRIORS.build("tv"), PRIORS.build("tv", kind="isotropic")
    assert float(aniso(flat, ctx())) == 0.0
    assert float(iso(flat, ctx())) == pytest.approx(0.0, abs=1e-3)
    assert float(aniso(edge, ctx())) == pytest.approx(4 / 12)
    assert float(iso(edge, ctx())) == pytest.approx(3 / 9, abs=1e-3)  # interior 3x3: one column of 1s


def test_pixel_priors():
    x = torch.tensor([[[[-0.5, 0.5], [1.0, 2.0]]]])
    assert float(PRIORS.build("range")(x, ctx())) == pytest.approx((0.25 + 1.0) / 4)
    assert float(PRIORS.build("l2")(x, ctx())) == pytest.approx((1 + 0 + 0.25 + 2.25) / 4)
    assert float(PRIORS.build("l2", center=0.0)(x, ctx())) == pytest.approx((0.25 + 0.25 + 1 + 4) / 4)


def test_bn_prior_matches_running_statistics():
    x = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    stats = [(x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False))]
    prior = PRIORS.build("bn")
    assert "bn_stats" in prior.requires
    assert float(prior(x, ctx(features={"bn": stats}, bn_running=stats))) == 0.0
    shifted = [(m + 1, v) for m, v in stats]
    assert float(prior(x, ctx(features={"bn": stats}, bn_running=shifted))) == pytest.approx(3 ** 0.5)
    with pytest.raises(NotApplicable, match="running statistics"):
        prior(x, ctx(features={"bn": stats}, bn_running=None))


def test_group_consistency_switches_on_at_start():
    x, mean = torch.ones(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)
    prior = PRIORS.build("group", start=5)
    assert float(prior(x, ctx(iteration=4, group_mean=mean))) == 0.0
    assert float(prior(x, ctx(iteration=5, group_mean=mean))) == 1.0
    with pytest.raises(ConfigError):
        PRIORS.build("group", start=-1)


def test_priors_run_under_vmap_like_a_loop():
    xs = torch.rand(3, 2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    mean = xs.mean(0)
    for name in ("tv", "l2", "range", "group"):
        prior = PRIORS.build(name)
        batched = torch.func.vmap(lambda x: prior(x, ctx(group_mean=mean)))(xs)
        looped = torch.stack([prior(x, ctx(group_mean=mean)) for x in xs])
        torch.testing.assert_close(batched, looped)
