"""The cuda path: the same attack, plan and audit numbers on a GPU as on the CPU (within
float tolerance). Skipped where no GPU is present."""
import pytest
import torch

import adaptive
import audit
from attacks import ATTACKS, observe
from audit.core.metrics import psnr
from audit.core.models import build_model
from defenses import build_defense

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compares cpu with cuda results: runs where a CUDA GPU is present")
SHAPE = (3, 16, 16)


def _batch(n=3):
    gen = torch.Generator().manual_seed(0)
    return torch.rand(n, *SHAPE, generator=gen), torch.tensor([0, 1, 2][:n])


@pytest.mark.parametrize("model_name", ["cnn"])  # (train-mode BatchNorm models diverge further: docs/performance.md)
def test_grouped_ig_on_cuda_recovers_what_it_recovers_on_cpu(model_name):
    x, y = _batch()
    scores = {}
    for device in ("cpu", "cuda"):
        model = build_model(model_name, SHAPE, 4, seed=0).to(device)
        obs = [observe(model, x[i:i + 1].to(device), y[i:i + 1].to(device), seed=i) for i in range(3)]
        recs = ATTACKS.build("ig").reconstruct_many(obs, 60, [0, 1, 2])
        assert all(r.inputs.device.type == device for r in recs)
        scores[device] = [float(psnr(r.inputs.cpu(), x[i:i + 1])) for i, r in enumerate(recs)]
    for cpu, cuda in zip(scores["cpu"], scores["cuda"]):
        assert abs(cpu - cuda) < 1.0, scores


@pytest.mark.parametrize("defense", ["prune", "gaussian", "soft-prune", "censor", "none"])
def test_the_plan_does_not_depend_on_the_device(defense):
    plans = {device: adaptive.plan(build_defense(defense), None, (3, 8, 8), 10, seed=0, device=torch.device(device))
             for device in ("cpu", "cuda")}
    assert [a.name for a in plans["cpu"].attacks] == [a.name for a in plans["cuda"].attacks]


def test_audit_on_cuda_matches_the_cpu_audit(tmp_path):
    kwargs = dict(defense="prune", steps=[0, 2], attacks="auto", images=2, model="cnn", image_size=16,
                  budget=40, utility=False, progress=False, seed=0)
    cpu = audit.run(out=tmp_path / "cpu", device="cpu", **kwargs)
    cuda = audit.run(out=tmp_path / "cuda", device="cuda", **kwargs)
    assert [a["id"] for a in cpu.data["attacks"]] == [a["id"] for a in cuda.data["attacks"]]
    for step in (0, 2):
        assert abs(cpu.psnr(step) - cuda.psnr(step)) < 1.0
