"""The evidence behind a verdict: scores blind to gain and offset, identification among
candidates, exact intervals, the DP-SGD identification bound, the null of an audit, and
negative controls (decoy defenses) that must not be judged to leak."""
import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

import audit
from audit.core.data import load_dataset
from audit.core.evidence import (aligned_psnr, clopper_pearson, excluded_rate, images_to_exclude, lpips_embedding,
                                 mean_difference, ssim_matrix)
from audit.core.metrics import MetricUnavailable, lpips_distance, lpips_model, ssim
from audit.core.reconstruction_bound import identification_bound
from audit.core.records import ImageClass
from audit.engine.null import Null
from audit.report.rule import LeakRule

pytestmark = pytest.mark.usefixtures("one_thread")


def test_aligned_psnr_forgives_gain_and_offset_but_not_a_flat_guess():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 8, 8, generator=gen)
    shifted = x * torch.tensor([0.3, 0.6, 0.4]).view(1, 3, 1, 1) + torch.tensor([0.2, 0.3, 0.5]).view(1, 3, 1, 1)
    plain = 10 * torch.log10(1 / (shifted - x).pow(2).flatten(1).mean(1))
    assert (plain < 15).all() and (aligned_psnr(shifted, x) > 100).all()  # the fit undoes it exactly
    noisy = (shifted + 0.05 * torch.randn(x.shape, generator=gen)).clamp(0, 1)
    assert (aligned_psnr(noisy, x) > plain + 5).all()
    # a flat guess fits each channel's mean: its score is the image's own variance, nothing more
    flat = torch.full_like(x, 0.5)
    expected = -10 * np.log10(x.double().var((2, 3), unbiased=False).mean(1).numpy())
    assert np.allclose(aligned_psnr(flat, x).numpy(), expected)
    # an inverted image gets no credit through a negative gain
    assert np.allclose(aligned_psnr(1 - x, x).numpy(), expected)


def test_similarity_matrices_equal_the_pairwise_metrics():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.rand(3, 3, 32, 32, generator=gen), torch.rand(4, 3, 32, 32, generator=gen)
    pairwise_ssim = torch.stack([ssim(a[i:i + 1].expand(4, -1, -1, -1), b) for i in range(3)])
    assert torch.allclose(ssim_matrix(a, b), pairwise_ssim, atol=1e-10)
    try:
        model = lpips_model()
    except MetricUnavailable as err:
        pytest.skip(f"checks the LPIPS similarity matrix against pairwise LPIPS: needs the backbone weights "
                    f"(`gia-audit weights lpips`; {err})")
    ea, eb = lpips_embedding(a, model), lpips_embedding(b, model)
    pairwise = torch.stack([lpips_distance(a[i:i + 1].expand(4, -1, -1, -1), b) for i in range(3)])
    assert torch.allclose((ea[:, None] - eb[None]).pow(2).sum(-1), pairwise, atol=1e-6)


def test_exact_binomial_statements():
    low, high = clopper_pearson(0, 4)
    assert low == 0 and high == pytest.approx(1 - 0.025 ** 0.25)  # 60.2%
    assert clopper_pearson(2, 2)[0] == pytest.approx(math.sqrt(0.025))
    low, high = clopper_pearson(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.1871, 0.8129)  # the textbook Clopper-Pearson interval
    assert excluded_rate(4) == pytest.approx(0.5271, abs=1e-4)  # "0 of 4" is consistent with up to 53%
    assert excluded_rate(8) == pytest.approx(0.3123, abs=1e-4)
    assert images_to_exclude(0.05) == 59 and excluded_rate(59) <= 0.05 < excluded_rate(58)


def test_identification_bound_against_dp_sgd():
    kappa = 1 / 64
    # full participation: the Gaussian trade-off, Phi(Phi^-1(kappa) + sqrt(T) / sigma)
    assert identification_bound(kappa, 1.0) == pytest.approx(norm.cdf(norm.ppf(kappa) + 1.0))
    assert identification_bound(kappa, 2.0, steps=4) == pytest.approx(norm.cdf(norm.ppf(kappa) + 1.0))
    # the Monte Carlo Neyman-Pearson test agrees with it as the sampling rate tends to 1
    assert identification_bound(kappa, 1.0, sample_rate=0.99999, samples=400_000) == pytest.approx(0.124, abs=0.006)
    # more noise, fewer steps or rarer sampling: closer to chance
    assert kappa < identification_bound(kappa, 4.0) < identification_bound(kappa, 1.0) < identification_bound(kappa, 0.5)
    assert identification_bound(kappa, 1.0, steps=1, sample_rate=0.01) < 0.02
    assert identification_bound(kappa, 0.0) == 1.0 and identification_bound(kappa, 1.0, steps=0) == kappa


@pytest.fixture(scope="module")
def embedded_null():
    data = load_dataset("embedded", size=32)
    return data, Null.build(data, seed=0)


def test_the_null_on_embedded_data_judges_guesses_as_chance_and_the_truth_as_recovered(embedded_null):
    data, null = embedded_null
    rule = LeakRule()
    private = data.test_images[:12]
    nulls = [null.evidence(x) for x in private]
    assert null.pool_size == 127 and null.candidates == 64 and len(nulls[0].scores) == 130
    recovered, partial = rule.false_positives(nulls)
    assert recovered.n == 12 * 130 and recovered.rate <= 0.01  # the rule's false-positive rate
    truth = null.score(private, private)
    contrast = null.score((private * 0.4 + 0.3), private)  # what train-mode BatchNorm leaves free
    others = null.score(data.test_images[80:92], private)  # unrelated images of the same data set
    flat = null.score(private.mean((2, 3), keepdim=True).expand_as(private), private)
    judge = [lambda e, n=n: rule.classify(e.aligned_psnr, e.rank, n.chance_level) for n in nulls]
    assert all(j(e) is ImageClass.RECOVERED for j, e in zip(judge, truth))
    assert all(j(e) is ImageClass.RECOVERED for j, e in zip(judge, contrast))
    assert sum(j(e) is ImageClass.RECOVERED for j, e in zip(judge, others)) == 0
    assert all(j(e) is ImageClass.NOT_RECOVERED for j, e in zip(judge, flat))


TINY = dict(model="mlp", model_args={"hidden": 32}, image_size=16, budget=5, utility=False, progress=False)


def _similarity(monkeypatch, tmp_path, which):
    """LPIPS where its weights are installed (else skip), or the 1 - SSIM fallback a user without them gets."""
    from audit.core import lpips_weights

    if which == "lpips" and not lpips_weights.weights_available()[0]:
        pytest.skip("checks the decoys under LPIPS identification; needs its weights (gia-audit weights lpips)")
    if which == "ssim":
        monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no-weights"))
        monkeypatch.delenv(lpips_weights.ENV_VAR, raising=False)


@pytest.mark.parametrize("which", ["lpips", "ssim"])
@pytest.mark.parametrize("kind", ["flat", "texture", "photo"])
def test_a_decoy_that_shares_nothing_private_reads_no_recovered_image(tmp_path, monkeypatch, kind, which):
    """The analytic attack recovers the decoy exactly, so every reconstruction is the decoy: the step's
    word must stay "no recovered image" at 8 images whichever similarity identifies the candidates."""
    _similarity(monkeypatch, tmp_path, which)
    report = audit.run(defense="decoy", defense_args={"kind": kind}, steps=[0], attacks=["analytic"], images=8,
                       out=tmp_path / "decoy", **{**TINY, "image_size": 32})
    step = report.step(0)
    assert ("LPIPS" in report.data["null"]["similarity"]) == (which == "lpips")
    assert step["attacks"]["analytic"]["status"] == "ok"
    assert step["verdict"]["judged"] == "no recovered image", step["verdict"]
    assert step["verdict"]["excludes_rate_above"] == pytest.approx(excluded_rate(8))


def test_an_undefended_client_of_the_same_audit_leaks_every_image(tmp_path):
    honest = audit.run(defense="none", steps=[0], attacks=["analytic"], images=4, out=tmp_path / "none", **TINY)
    assert honest.verdict == "leaks" and honest.step(0)["verdict"]["recovered"] == 4


def test_a_steps_words_need_more_images_than_images_carrying_nothing_private_reach():
    from audit.core.evidence import binomial_tail, images_needed
    from audit.core.records import Interval

    def tail(n, p, k):  # P(Binomial(n, p) >= k), summed by hand
        return 1 - sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k))

    assert binomial_tail(8, 3 / 64, 3) == pytest.approx(tail(8, 3 / 64, 3))
    # rank <= 3 of K = 64 by chance: 1 of 8 images in 32% of steps, 2 in 5.1%, 3 in 0.48%
    assert images_needed(8, 3 / 64, 0.05) == 3 and tail(8, 3 / 64, 2) > 0.05 >= tail(8, 3 / 64, 3)
    assert images_needed(1, 3 / 64, 0.05) == 1 and images_needed(2, 0.9, 0.05) == 3  # never: n + 1
    rule = LeakRule()
    none_of = Interval(0, 1040, *clopper_pearson(0, 1040))
    leaks, partially = rule.step_bars(8, (none_of, none_of), candidates=64)
    # "leaks": the null items' upper bound 0.35% (0 of 1040), under the rank bound 1/64: one image
    assert leaks.needed == 1 and leaks.per_image == pytest.approx(clopper_pearson(0, 1040)[1])
    assert leaks.step_rate == pytest.approx(tail(8, leaks.per_image, 1)) and leaks.step_rate <= 0.05
    # "partially": the rank bound 3/64, whatever the null items measured
    assert partially.needed == 3 and partially.per_image == pytest.approx(3 / 64) and partially.step_rate <= 0.05
    few = Interval(0, 6, *clopper_pearson(0, 6))  # a null too small to bound "recovered": the rank bound caps it
    assert rule.step_bars(8, (few, few), candidates=64)[0].per_image == pytest.approx(1 / 64)


def test_the_difference_of_means_over_seeds_is_welchs_interval():
    from scipy.stats import ttest_ind

    a, b = [0.61, 0.64, 0.66], [0.70, 0.69, 0.75, 0.72]
    diff = mean_difference(a, b)
    reference = ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    assert diff.estimate == pytest.approx(np.mean(a) - np.mean(b))
    assert (diff.low, diff.high) == pytest.approx((reference.low, reference.high))
    assert diff.sizes == (3, 4) and diff.low < diff.estimate < diff.high
    # a weighted difference is the difference with the second sample scaled
    scaled = ttest_ind(a, [0.9 * x for x in b], equal_var=False).confidence_interval(0.99)
    assert (mean_difference(a, b, 0.9, 0.99).low, mean_difference(a, b, 0.9, 0.99).high) == pytest.approx(
        (scaled.low, scaled.high))
    assert mean_difference([0.5], b) is None  # one seed: no spread, no interval
    same = mean_difference([0.5, 0.5], [0.4, 0.4])
    assert (same.low, same.estimate, same.high) == pytest.approx((0.1, 0.1, 0.1))


def test_one_image_at_chance_among_eight_is_not_a_partial_leak():
    """The flat decoy audited by the default attacks without the LPIPS weights (seed 0): one image of
    eight at 15.76 dB against its chance level of 15.72, 3rd of 64. Images carrying nothing private
    reach that in a third of 8-image steps; two exact images always leak."""
    from audit.core.records import Interval
    from audit.report.risk import step_verdict

    measured = [(15.76, 15.72, 3), (17.23, 21.10, 34), (12.89, 16.50, 60), (26.98, 27.27, 3), (17.94, 21.74, 23),
                (18.94, 19.09, 6), (21.79, 21.89, 28), (21.84, 22.07, 13)]
    rule = LeakRule()

    def entries(rows, exact=()):
        return [{"image": i, "index": 0, "rank": rank, "candidates": 64, "exact": i in exact,
                 "image_class": rule.classify(score, rank, chance).value}
                for i, (score, chance, rank) in enumerate(rows)]

    null_rate = Interval(1, 1040, *clopper_pearson(1, 1040))
    bars = rule.step_bars(8, (null_rate, null_rate), candidates=64)
    decoy = step_verdict(entries(measured), rule, bars=bars)
    assert decoy.partially == 1 and decoy.label == "no recovered image" and "in 32% of such steps" in decoy.short_of
    assert step_verdict(entries(measured), LeakRule(calibrated=False)).label == "partially"  # the uncalibrated word
    three = [(c + 0.1, c, 2) for _, c, _ in measured[:3]] + measured[3:]
    assert step_verdict(entries(three), rule, bars=bars).label == "partially"
    exact = [(60.0, c, 1) for _, c, _ in measured[:1]] + measured[1:]
    assert step_verdict(entries(exact, exact={0}), rule, bars=bars).label == "leaks"
