"""The probe reads the same traits whatever the precision (and so whatever the device's
float arithmetic): float32 and float64 probes agree on every trait the planner uses."""
import pytest
import torch

from adaptive.planner.probe import probe_defense, random_batch
from defenses import build_defense

MEASURED = ("layers", "noise_std", "noise_relative", "sparsity", "rounds_probe", "notes")


@pytest.mark.parametrize("name, params", [("none", {}), ("prune", {"ratio": 0.9}), ("gaussian", {}),
                                          ("soft-prune", {}), ("clip", {"bound": 0.01}), ("svdefense", {}),
                                          ("quantize", {"bits": 1}), ("censor", {})])
def test_float32_and_float64_probes_read_the_same_traits(name, params, one_thread):
    single = probe_defense(build_defense(name, **params), seed=0).to_dict()
    double = probe_defense(build_defense(name, **params), seed=0, dtype=torch.float64).to_dict()
    differing = {k: (single[k], double[k]) for k in single if k not in MEASURED and single[k] != double[k]}
    assert not differing
    if double["noise_std"] is not None:
        # a measurement from two draws, and the precisions draw differently: compare the
        # mean over a few probe seeds (one CENSOR reading ranges over 0.7-1.2x its mean)
        assert _mean_noise(name, params, None) == pytest.approx(_mean_noise(name, params, torch.float64), rel=0.25)


def _mean_noise(name, params, dtype, seeds=range(4)):
    return sum(probe_defense(build_defense(name, **params), seed=s, dtype=dtype).noise_std for s in seeds) / len(seeds)


def test_the_probe_batch_is_drawn_on_the_cpu():
    x, y = random_batch(4, (3, 8, 8), 10, seed=3, device="cpu", dtype=torch.float64)
    x32, y32 = random_batch(4, (3, 8, 8), 10, seed=3, device="cpu")
    assert x.dtype == torch.float64 and torch.equal(x.float(), x32) and torch.equal(y, y32)


def test_the_rank_of_a_large_layer_is_read_off_a_sketch_exactly_below_its_size():
    """Both sides above RANK_SKETCH: the sketch keeps a low rank exact (a truncation to 100
    components is still seen) and reads a full one as RANK_SKETCH + 1."""
    from adaptive.planner.probe import RANK_SKETCH, _matrix_rank

    g = torch.Generator().manual_seed(0)
    big = RANK_SKETCH + 200
    assert _matrix_rank(torch.randn(big, 40, generator=g) @ torch.randn(40, 2 * big, generator=g)) == 40
    full = torch.randn(big, 2 * big, generator=g, dtype=torch.float64)
    assert _matrix_rank(full) == RANK_SKETCH + 1
    u, s, vh = torch.linalg.svd(full, full_matrices=False)
    assert _matrix_rank(u[:, :100] @ torch.diag(s[:100]) @ vh[:100]) == 100
