"""Generators: interface, DCGAN training, checkpoints, user generators, cache, CLI."""
import os
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from audit.core.errors import ConfigError, DataError
from generators import (DCGANGenerator, GeneratorRecipe, ImageGenerator, as_generator, build_generator,
                        check_compatible, default_generator, load_generator, read_checkpoint, save_generator,
                        train_generator)

# The generator every generative test uses: trained once per pytest run on the embedded
# *train* split (16x16), cached in the run's temporary directory.
TEST_SHAPE = (3, 16, 16)
TEST_RECIPE = dict(width=16, latent_dim=16, steps=300, batch_size=32, lr=5e-4, seed=0)


def session_generator(tmp_path_factory) -> ImageGenerator:
    """The test generator, shared by the xdist workers of one pytest run (file lock)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "gia-generators"
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / "train.lock")):
        return default_generator(TEST_SHAPE, cache=root, progress=False, **TEST_RECIPE)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return session_generator(tmp_path_factory)


@pytest.mark.parametrize("num_classes", [0, 4])
def test_features_and_decode_compose_to_forward(num_classes):
    gen, _ = build_generator("dcgan", seed=0, latent_dim=8, image_shape=(3, 32, 32), num_classes=num_classes,
                             width=8)
    gen.eval()
    z = torch.randn(2, 8)
    y = torch.tensor([1, 3]) if num_classes else None
    x = gen(z, y)
    assert x.shape == (2, 3, 32, 32) and x.min() >= 0 and x.max() <= 1
    assert gen.num_layers == 4  # 4x4, 8x8, 16x16, image
    shapes = [tuple(gen.features(z, y, k).shape[1:]) for k in range(gen.num_layers)]
    assert shapes[1:] == [(32, 4, 4), (16, 8, 8), (8, 16, 16)]
    for k in range(gen.num_layers):
        assert torch.allclose(gen.decode(gen.features(z, y, k), k), x, atol=1e-6)
    with pytest.raises(ConfigError, match="valid layers are 0..3"):
        gen.features(z, y, 4)


def test_bad_settings_name_the_fix():
    with pytest.raises(ConfigError, match="power of two"):
        DCGANGenerator(image_shape=(3, 24, 24))
    gen = DCGANGenerator(latent_dim=4, image_shape=(3, 8, 8), num_classes=3, width=4)
    with pytest.raises(ConfigError, match="class-conditional"):
        gen(torch.randn(1, 4))
    with pytest.raises(ConfigError, match="train-generator --image-size 32 on a data set of 3 channels"):
        check_compatible(gen, (3, 32, 32))


def test_training_is_seeded_and_reproducible():
    recipe = GeneratorRecipe(size=8, width=4, latent_dim=4, steps=5, batch_size=8, seed=3)
    a = train_generator(recipe, progress=False)
    b = train_generator(recipe, progress=False)
    c = train_generator(GeneratorRecipe(**{**recipe.__dict__, "seed": 4}), progress=False)
    z = torch.randn(3, 4)
    y = torch.tensor([0, 1, 2])
    assert torch.equal(a(z, y), b(z, y))
    assert not torch.equal(a(z, y), c(z, y))


def test_trained_generator_learns_each_class(trained):
    """Samples of class c are near (mean colour) class c's training crops: the true class ranks
    first or second among the 10 on average (chance: 4.5)."""
    from audit.core.data import load_dataset

    data = load_dataset("embedded", size=16)
    colour = torch.stack([data.train_images[data.train_labels == c].mean((0, 2, 3)) for c in range(10)])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        samples = torch.stack([trained(trained.sample_latent(16, g), torch.full((16,), c)).mean((0, 2, 3))
                               for c in range(10)])
    dist = torch.cdist(samples, colour)
    rank = (dist < dist.diagonal().unsqueeze(1)).sum(1).float()  # 0: the true class is the nearest
    assert rank.mean() <= 1.0, rank
    info = trained.checkpoint_info
    assert info["data"]["split"] == "train" and info["data"]["dataset"] == "embedded"
    assert info["data"]["images"] == len(data.train_labels)


def test_checkpoint_round_trip_keeps_settings_and_outputs(trained, tmp_path):
    path = save_generator(tmp_path / "g.pt", trained, data={"dataset": "embedded", "split": "train"},
                          training={"steps": 300})
    payload = read_checkpoint(path)
    assert payload["settings"] == {"latent_dim": 16, "image_shape": [3, 16, 16], "num_classes": 10, "width": 16}
    assert payload["data"]["split"] == "train"
    loaded = load_generator(path)
    z, y = torch.randn(4, 16), torch.tensor([0, 3, 5, 9])
    with torch.no_grad():
        assert torch.equal(loaded(z, y), trained(z, y))
    assert loaded.checkpoint_info["training"] == {"steps": 300}


def test_default_generator_is_cached(trained, tmp_path_factory):
    again = session_generator(tmp_path_factory)  # loads the cached checkpoint: no training
    assert "path" in again.checkpoint_info and again.checkpoint_info["path"].endswith(".pt")
    z, y = torch.randn(2, 16), torch.tensor([1, 2])
    with torch.no_grad():
        assert torch.equal(again(z, y), trained(z, y))


def test_bad_checkpoints_raise_data_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_generator(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(DataError, match="cannot read"):
        load_generator(tmp_path / "junk.pt")
    torch.save({"weight": torch.zeros(2)}, tmp_path / "raw.pt")
    with pytest.raises(DataError, match="generator-factory"):
        load_generator(tmp_path / "raw.pt")


USER_MODULE = '''
import torch
from torch import nn

class TanhGen(nn.Module):
    """A user's generator: no blocks, tanh output in [-1, 1]."""
    latent_dim = 6
    output_range = (-1.0, 1.0)

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 3 * 8 * 8)

    def forward(self, z):
        return torch.tanh(self.fc(z)).view(-1, 3, 8, 8)

class NoLatent(nn.Module):
    def forward(self, z):
        return z

def make():
    torch.manual_seed(0)
    return TanhGen()
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_user_gen.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_user_gen"
    sys.modules.pop("my_user_gen", None)


def test_user_generator_from_factory_and_state_dict(user_module, tmp_path):
    import importlib

    mod = importlib.import_module(user_module)
    trained_user = mod.make()
    with torch.no_grad():
        trained_user.fc.weight.mul_(3.0)
    torch.save(trained_user.state_dict(), tmp_path / "user.pt")
    gen = load_generator(tmp_path / "user.pt", factory=f"{user_module}:make")
    assert gen.image_shape == (3, 8, 8) and gen.latent_dim == 6 and gen.num_layers == 0
    z = torch.randn(5, 6)
    with torch.no_grad():
        out = gen(z)
        expected = (trained_user(z) + 1) / 2  # rescaled from the declared output range
    assert torch.allclose(out, expected) and out.min() >= 0 and out.max() <= 1
    with pytest.raises(ConfigError, match="no blocks"):
        gen.features(z, None, 0)


def test_user_generator_errors_name_the_fix(user_module):
    with pytest.raises(ConfigError, match="latent_dim"):
        load_generator(factory=f"{user_module}:NoLatent")
    with pytest.raises(ConfigError, match="no attribute"):
        load_generator(factory=f"{user_module}:missing")
    with pytest.raises(ConfigError, match="package.module:attr"):
        load_generator(factory="no_colon")
    with pytest.raises(ConfigError, match="cannot import"):
        load_generator(factory="not_a_module_xyz:make")
    with pytest.raises(ConfigError, match="nn.Module"):
        as_generator(lambda z: z)

    class Wrong(nn.Module):
        latent_dim = 3

        def forward(self, z):
            return z

    with pytest.raises(ConfigError, match=r"\(B, C, H, W\)"):
        as_generator(Wrong())


def test_cli_train_generator(tmp_path):
    from cli import main

    out = tmp_path / "g.pt"
    args = ["train-generator", "--image-size", "8", "--gan-steps", "3", "--width", "4", "--latent-dim", "4",
            "--gan-batch-size", "8", "--save", str(out), "--seed", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "trained on embedded/train" in result.output
    gen = load_generator(out)
    assert gen.image_shape == (3, 8, 8) and gen.num_classes == 10
    assert gen.checkpoint_info["training"]["seed"] == 1
    bad = CliRunner().invoke(main, ["train-generator", "--size", "12", "--save", str(out)])
    assert bad.exit_code == 2 and "power of two" in bad.output
