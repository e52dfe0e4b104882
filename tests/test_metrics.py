import json
import math

import pytest
import torch
from skimage.metrics import structural_similarity

from audit.core import metrics
from audit.core.errors import DataError
from audit.core.jsonable import from_jsonable, to_jsonable
from audit.core.metrics import (MetricUnavailable, MetricValue, label_accuracy, match_batches, mse, psnr,
                           score, ssim)


def _batch(n=4, c=3, s=16, seed=0):
    return torch.rand(n, c, s, s, generator=torch.Generator().manual_seed(seed))


def test_mse_and_psnr_on_known_pairs():
    a = torch.zeros(2, 3, 8, 8)
    b = torch.stack([torch.full((3, 8, 8), 0.1), torch.full((3, 8, 8), 0.01)])
    assert mse(a, b).tolist() == pytest.approx([0.01, 1e-4])
    assert psnr(a, b).tolist() == pytest.approx([20.0, 40.0])
    assert psnr(a[0], b[0]).tolist() == pytest.approx([20.0])  # a single (C, H, W) image


def test_identical_images_give_inf_psnr_kept_in_json():
    x = _batch()
    p = psnr(x, x.clone())
    assert torch.isinf(p).all() and (p > 0).all()
    value = MetricValue.of(p)
    assert value.value == math.inf
    text = json.dumps(to_jsonable({"psnr": value}), allow_nan=False)
    assert json.loads(text)["psnr"] == {"value": "inf", "per_image": ["inf"] * 4}
    assert from_jsonable(json.loads(text))["psnr"] == {"value": math.inf, "per_image": [math.inf] * 4}


def test_ssim_matches_scikit_image_and_is_one_on_identical():
    x, y = _batch(3, seed=1), _batch(3, seed=2)
    assert ssim(x, x).tolist() == pytest.approx([1.0, 1.0, 1.0])
    ref = structural_similarity(x[1].double().numpy(), y[1].double().numpy(), data_range=1.0, channel_axis=0)
    vals = ssim(x, y)
    assert float(vals[1]) == pytest.approx(ref) and float(vals.max()) < 0.2
    gray = ssim(x[:, :1], (x[:, :1] * 0.9))
    assert 0.8 < float(gray.min()) < 1.0
    assert ssim(_batch(1, s=5), _batch(1, s=5, seed=3)).shape == (1,)  # 5x5 window
    with pytest.raises(MetricUnavailable, match="3x3"):
        ssim(torch.rand(1, 1, 2, 2), torch.rand(1, 1, 2, 2))


def test_shape_mismatch_is_a_data_error():
    with pytest.raises(DataError, match=r"\(2, 3, 16, 16\).*\(2, 1, 16, 16\)"):
        mse(_batch(2), _batch(2, c=1))


def test_label_accuracy_counts_multisets():
    assert label_accuracy(torch.tensor([1, 1, 2]), torch.tensor([2, 1, 2])) == pytest.approx(2 / 3)
    assert label_accuracy(torch.tensor([3, 0]), torch.tensor([0, 3])) == 1.0
    assert label_accuracy(torch.tensor([5]), torch.tensor([4])) == 0.0


def test_matching_recovers_a_shuffled_batch():
    truth = _batch(6, seed=4)
    shuffle = torch.tensor([3, 0, 5, 1, 4, 2])
    noisy = (truth + 0.05 * torch.randn(truth.shape, generator=torch.Generator().manual_seed(5)))
    recon = noisy[shuffle]
    perm = match_batches(recon, truth)
    assert torch.equal(recon[perm], noisy)
    extra = torch.cat([torch.rand(2, 3, 16, 16), recon])  # more reconstructions than images
    assert torch.equal(extra[match_batches(extra, truth)], noisy)
    with pytest.raises(DataError, match="2 images but the private batch has 6"):
        match_batches(recon[:2], truth)


def test_score_matches_then_scores_every_metric():
    truth = _batch(4, s=32, seed=6)
    recon = truth.flip(0).clone()
    recon[0] = 1.0 - recon[0]  # the reconstruction of truth[3] is bad
    result = score(recon, torch.tensor([1, 2, 3, 9]), truth, torch.tensor([3, 2, 1, 0]), lpips=False)
    assert result["assignment"] == [3, 2, 1, 0]
    per = result["psnr"].per_image
    assert per[:3] == (math.inf, math.inf, math.inf) and 3.0 < per[3] < 10.0
    assert result["psnr"].value == math.inf
    assert result["ssim"].per_image[0] == pytest.approx(1.0) and result["ssim"].per_image[3] < 0.0
    assert result["mse"].per_image[3] == pytest.approx(float(((2 * truth[3] - 1) ** 2).mean()), rel=1e-5)
    assert result["label_accuracy"].value == 0.75
    assert result["lpips"].to_dict() == {"value": None, "unavailable": "not computed (lpips=False)"}
    json.dumps(to_jsonable(result), allow_nan=False)


def test_score_out_of_range_reconstructions_are_clamped():
    truth = _batch(2, seed=7)
    result = score(truth + 2.0, None, truth, torch.tensor([0, 1]), lpips=False)
    assert result["mse"].per_image == pytest.approx(tuple(mse(torch.ones_like(truth), truth).tolist()))
    assert result["label_accuracy"].to_dict() == {"value": None, "unavailable": "the attack returned no labels"}


def test_score_without_usable_images_reports_reasons_never_nan():
    truth = _batch(2, seed=8)
    none = score(None, torch.tensor([0, 1]), truth, torch.tensor([0, 1]))
    assert none["assignment"] is None and none["psnr"].unavailable == "the attack returned no images"
    bad = truth.clone()
    bad[1, 0, 0, 0] = float("nan")
    result = score(bad, torch.tensor([0, 1]), truth, torch.tensor([0, 1]))
    for name in ("mse", "psnr", "ssim", "lpips"):
        assert result[name].value is None and "image(s) [1]" in result[name].unavailable
    text = json.dumps(to_jsonable(result), allow_nan=False)  # raises on a NaN float
    assert '"nan"' not in text
    with pytest.raises(DataError, match="private batch"):
        score(truth, None, torch.full_like(truth, float("nan")), torch.tensor([0, 1]))


def test_metric_value_never_hides_nan():
    v = MetricValue.of([1.0, float("nan")])
    assert v.value is None and "NaN" in v.unavailable
    assert MetricValue.scalar(float("nan")).available is False
    assert to_jsonable({"x": float("-inf"), "t": torch.tensor([1.5])}) == {"x": "-inf", "t": [1.5]}


def test_lpips_unavailable_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("GIA_AUDIT_LPIPS_WEIGHTS", str(tmp_path / "missing.pth"))
    truth = _batch(2, s=32, seed=9)
    result = score(truth.flip(0), None, truth, torch.tensor([0, 1]))
    assert result["lpips"].value is None
    assert "gia-audit weights lpips" in result["lpips"].unavailable
    assert str(tmp_path / "missing.pth") in result["lpips"].unavailable
    with pytest.raises(MetricUnavailable, match="gia-audit weights lpips"):
        metrics.lpips_model("cpu")
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"\x00" * 100)
    monkeypatch.setenv("GIA_AUDIT_LPIPS_WEIGHTS", str(corrupt))
    result = score(truth, None, truth, torch.tensor([0, 1]))
    assert result["lpips"].value is None and str(corrupt) in result["lpips"].unavailable


def test_lpips_unavailable_for_small_images_whatever_the_weights():
    truth = _batch(2, s=16, seed=10)
    result = score(truth, None, truth, torch.tensor([0, 1]))
    assert result["lpips"].value is None and "31x31" in result["lpips"].unavailable


def test_scoring_a_group_at_once_gives_each_batchs_own_scores():
    """score_many runs each metric once over every batch: the same numbers as one at a time."""
    from audit.core.metrics import score, score_many

    gen = torch.Generator().manual_seed(3)
    truths = [torch.rand(2, 3, 8, 8, generator=gen), torch.rand(1, 3, 8, 8, generator=gen)]
    recons = [truths[0].flip(0) + 0.05 * torch.rand(2, 3, 8, 8, generator=gen), torch.rand(1, 3, 8, 8, generator=gen)]
    labels = [torch.tensor([1, 2]), torch.tensor([0])]
    together = score_many(recons, labels, truths, labels, lpips=False)
    for got, r, t, y in zip(together, recons, truths, labels):
        alone = score(r, y, t, y, lpips=False)
        assert got["assignment"] == alone["assignment"]
        for name in ("mse", "psnr", "ssim"):
            assert got[name].per_image == alone[name].per_image
    assert together[0]["assignment"] == [1, 0]  # the flipped batch is matched back
