import gzip
import os
import pickle
import time

import numpy as np
import pytest
import torch
from PIL import Image

from audit.core import data
from audit.core.data import DATASETS, Dataset, load_dataset, load_image, to_grayscale
from audit.core.errors import ConfigError, DataError


# --------------------------------------------------------------------------- embedded
def test_embedded_shapes_split_and_classes():
    ds = load_dataset("embedded")
    assert isinstance(ds, Dataset)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == 10
    assert ds.train_images.shape == (480, 3, 32, 32) and ds.test_images.shape == (160, 3, 32, 32)
    assert ds.train_images.dtype == torch.float32 and ds.train_labels.dtype == torch.long
    assert torch.equal(torch.bincount(ds.train_labels), torch.full((10,), 48))
    assert torch.equal(torch.bincount(ds.test_labels), torch.full((10,), 16))
    assert 0.0 <= float(ds.train_images.min()) and float(ds.train_images.max()) <= 1.0
    assert ds.classes[1] == "cat" and ds.classes[5] == "retina"
    flat = ds.train_images.transpose(0, 1).reshape(3, -1)
    assert ds.mean == pytest.approx(flat.double().mean(1).tolist(), abs=1e-6)
    assert ds.std == pytest.approx(flat.double().std(1).tolist(), abs=1e-6)
    # not a flat / degenerate image set: crops differ
    assert float(ds.train_images.flatten(1).std(1).min()) > 0.0


def test_embedded_is_deterministic_and_cache_is_not_shared():
    a = load_dataset("embedded", size=16)
    a.train_images.zero_()
    b = load_dataset("embedded", size=16)
    c = load_dataset("embedded", size=16)
    assert float(b.train_images.abs().sum()) > 0
    assert torch.equal(b.train_images, c.train_images) and torch.equal(b.test_labels, c.test_labels)
    assert b.input_shape == (3, 16, 16)


def test_embedded_cold_build_is_fast():
    data._embedded_tiles.cache_clear()
    start = time.perf_counter()
    load_dataset("embedded")
    assert time.perf_counter() - start < 3.0


def test_embedded_tiles_are_disjoint_regions_of_the_source_picture():
    size, grid = 8, 4
    ds = load_dataset("embedded", size=size, grid=grid)
    cls, filename, keep = data.EMBEDDED_SOURCES[5]
    source = data._pil_to_tensor(data._pil_square(data.skimage_picture(filename), size * grid, keep))
    train = ds.train_images[ds.train_labels == 5]  # rows 0..2, row-major
    test = ds.test_images[ds.test_labels == 5]  # row 3
    assert len(train) == 12 and len(test) == 4
    rows = torch.cat([train, test]).view(grid, grid, 3, size, size)
    mosaic = rows.permute(2, 0, 3, 1, 4).reshape(3, size * grid, size * grid)
    assert torch.allclose(mosaic, source)


def test_embedded_gray_is_the_luma_of_embedded():
    rgb, gray = load_dataset("embedded", size=16), load_dataset("embedded-gray", size=16)
    assert gray.input_shape == (1, 16, 16) and gray.classes == rgb.classes
    assert torch.allclose(gray.train_images, to_grayscale(rgb.train_images), atol=1e-6)
    assert len(gray.mean) == 1 and len(gray.std) == 1


def test_registry_names_and_bad_arguments():
    assert set(DATASETS.names()) >= {"embedded", "embedded-gray", "cifar10", "cifar100", "mnist", "folder"}
    with pytest.raises(ConfigError, match="embedded-gray"):
        load_dataset("imagenet")
    with pytest.raises(ConfigError, match="path"):
        load_dataset("embedded", path="/tmp")
    with pytest.raises(ConfigError, match="size"):
        load_dataset("embedded", size=2)


# --------------------------------------------------------------------------- CIFAR
def _cifar_batch(n, label_key, offset):
    rng = np.random.default_rng(offset)
    return {b"batch_label": b"x", b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            label_key: [int(v) for v in (np.arange(n) + offset) % 10]}


def _write_cifar10(root, n=3):
    root.mkdir(parents=True, exist_ok=True)
    batches = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        batches[name] = _cifar_batch(n, b"labels", i)
        (root / name).write_bytes(pickle.dumps(batches[name], protocol=2))
    names = [f"class{i}".encode() for i in range(10)]
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": names}))
    return batches


def test_cifar10_loader_reads_pickle_batches(tmp_path):
    batches = _write_cifar10(tmp_path / "cifar-10-batches-py")
    ds = load_dataset("cifar10", path=str(tmp_path))  # the parent folder works too
    assert ds.train_images.shape == (15, 3, 32, 32) and ds.test_images.shape == (3, 3, 32, 32)
    assert ds.classes[3] == "class3"
    raw = batches["data_batch_2"][b"data"][1]  # row-major: 1024 red, 1024 green, 1024 blue
    img = ds.train_images[4]
    assert float(img[1, 2, 5]) == pytest.approx(raw[1024 + 2 * 32 + 5] / 255.0)
    assert ds.train_labels.tolist()[3:6] == batches["data_batch_2"][b"labels"]
    small = load_dataset("cifar10", path=str(tmp_path / "cifar-10-batches-py"), size=16, limit=2, channels=1)
    assert small.train_images.shape == (2, 1, 16, 16) and small.test_images.shape == (2, 1, 16, 16)


def test_cifar100_loader_uses_fine_labels(tmp_path):
    for i, name in enumerate(["train", "test"]):
        batch = {b"data": np.full((4, 3072), 10 * i, dtype=np.uint8), b"fine_labels": [99, 0, 5, 7],
                 b"coarse_labels": [1, 1, 1, 1]}
        (tmp_path / name).write_bytes(pickle.dumps(batch))
    (tmp_path / "meta").write_bytes(pickle.dumps({b"fine_label_names": [f"f{i}".encode() for i in range(100)]}))
    ds = load_dataset("cifar100", path=str(tmp_path))
    assert ds.num_classes == 100 and ds.classes[99] == "f99"
    assert ds.train_labels.tolist() == [99, 0, 5, 7]
    assert float(ds.test_images.max()) == pytest.approx(10 / 255.0)


def test_cifar_errors_name_the_path(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="needs a local path"):
        load_dataset("cifar10")
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=str(missing)):
        load_dataset("cifar10", path=str(missing))
    root = tmp_path / "c10"
    _write_cifar10(root)
    (root / "data_batch_4").unlink()
    with pytest.raises(DataError, match="data_batch_4"):
        load_dataset("cifar10", path=str(root))
    _write_cifar10(root)
    full = (root / "data_batch_3").read_bytes()
    (root / "data_batch_3").write_bytes(full[: len(full) // 2])  # truncated
    with pytest.raises(DataError, match=f"{root / 'data_batch_3'}.*truncated"):
        load_dataset("cifar10", path=str(root))
    (root / "data_batch_3").write_text("not a pickle at all\n")  # wrong format
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", path=str(root))
    (root / "data_batch_3").write_bytes(pickle.dumps({b"data": np.zeros((3, 3000), np.uint8), b"labels": [0, 1, 2]}))
    with pytest.raises(DataError, match=r"data_batch_3.*\(3, 3000\)"):
        load_dataset("cifar10", path=str(root))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickles_cannot_run_code(tmp_path):
    root = tmp_path / "c10"
    _write_cifar10(root)
    (root / "test_batch").write_bytes(pickle.dumps({b"data": _Evil(), b"labels": [0]}))
    with pytest.raises(DataError, match="refusing to load .*system"):
        load_dataset("cifar10", path=str(root))


def test_download_happens_only_when_asked(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(data, "_download", lambda name, path: calls.append((name, path)))
    _write_cifar10(tmp_path)
    load_dataset("cifar10", path=str(tmp_path))
    assert calls == []
    load_dataset("cifar10", path=str(tmp_path), download=True)
    assert calls == [("cifar10", str(tmp_path))]


# --------------------------------------------------------------------------- MNIST
def _idx(array):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(np.uint8).tobytes()


def _write_mnist(root, gz=False):
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 5), ("t10k", 3)):
        arrays[split] = (rng.integers(0, 256, (n, 28, 28)), np.arange(n) % 10)
        for kind, arr in zip(("images-idx3", "labels-idx1"), arrays[split]):
            raw, name = _idx(arr), f"{split}-{kind}-ubyte"
            if gz:
                (root / (name + ".gz")).write_bytes(gzip.compress(raw))
            else:
                (root / name).write_bytes(raw)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_loader_reads_idx_files(tmp_path, gz):
    arrays = _write_mnist(tmp_path / "MNIST" / "raw", gz=gz)
    ds = load_dataset("mnist", path=str(tmp_path), size=28)
    assert ds.train_images.shape == (5, 1, 28, 28) and ds.test_images.shape == (3, 1, 28, 28)
    assert float(ds.train_images[2, 0, 7, 9]) == pytest.approx(arrays["train"][0][2, 7, 9] / 255.0)
    assert ds.test_labels.tolist() == [0, 1, 2] and ds.classes == [str(d) for d in range(10)]
    assert load_dataset("mnist", path=str(tmp_path)).input_shape == (1, 32, 32)  # resized by default


def test_mnist_truncated_and_wrong_format(tmp_path):
    _write_mnist(tmp_path)
    images = tmp_path / "train-images-idx3-ubyte"
    raw = images.read_bytes()
    images.write_bytes(raw[:-100])
    with pytest.raises(DataError, match=f"{images}.*truncated"):
        load_dataset("mnist", path=str(tmp_path))
    images.write_bytes(b"\x89PNG" + raw[4:])
    with pytest.raises(DataError, match=f"{images}.*idx"):
        load_dataset("mnist", path=str(tmp_path))
    images.unlink()
    with pytest.raises(DataError, match=str(tmp_path)):
        load_dataset("mnist", path=str(tmp_path))
    (tmp_path / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b garbage")
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    _write_mnist(tmp_path)  # restores the plain files; the .gz is ignored when the plain file exists
    load_dataset("mnist", path=str(tmp_path))
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz.*gzip"):
        load_dataset("mnist", path=str(tmp_path))


# --------------------------------------------------------------------------- folder + single image
def _png(path, color, size=(20, 12)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def test_folder_loader_with_and_without_split_folders(tmp_path):
    for i in range(5):
        _png(tmp_path / "flat" / "red" / f"{i}.png", (255, 0, 0))
        _png(tmp_path / "flat" / "blue" / f"{i}.jpg", (0, 0, 255))
    ds = load_dataset("folder", path=str(tmp_path / "flat"), size=8)
    assert ds.classes == ["blue", "red"] and ds.input_shape == (3, 8, 8)
    assert len(ds.train_labels) == 8 and ds.test_labels.tolist() == [0, 1]
    assert torch.allclose(ds.test_images[1, :, 3, 3], torch.tensor([1.0, 0.0, 0.0]), atol=0.02)
    _png(tmp_path / "split" / "train" / "a" / "0.png", (10, 10, 10))
    _png(tmp_path / "split" / "train" / "b" / "0.png", (200, 200, 200))
    _png(tmp_path / "split" / "test" / "b" / "1.png", (200, 200, 200))
    ds = load_dataset("folder", path=str(tmp_path / "split"), size=8, channels=1)
    assert ds.train_images.shape == (2, 1, 8, 8) and ds.test_labels.tolist() == [1]


def test_folder_errors_name_the_path(tmp_path):
    (tmp_path / "one" / "only").mkdir(parents=True)
    _png(tmp_path / "one" / "only" / "a.png", (1, 2, 3))
    with pytest.raises(DataError, match=f"{tmp_path / 'one'}.*at least two classes"):
        load_dataset("folder", path=str(tmp_path / "one"))
    _png(tmp_path / "one" / "other" / "a.png", (1, 2, 3))
    bad = tmp_path / "one" / "other" / "b.png"
    bad.write_bytes(b"this is no png")
    with pytest.raises(DataError, match=str(bad)):
        load_dataset("folder", path=str(tmp_path / "one"))


def test_load_image(tmp_path):
    _png(tmp_path / "x.png", (0, 255, 0), size=(40, 20))
    img = load_image(str(tmp_path / "x.png"), size=16)
    assert img.shape == (1, 3, 16, 16)
    assert torch.allclose(img[0, :, 8, 8], torch.tensor([0.0, 1.0, 0.0]), atol=0.01)
    gray = load_image(str(tmp_path / "x.png"), size=16, channels=1)
    assert gray.shape == (1, 1, 16, 16) and float(gray[0, 0, 4, 4]) == pytest.approx(150 / 255, abs=0.01)
    with pytest.raises(DataError, match=str(tmp_path / "missing.png")):
        load_image(str(tmp_path / "missing.png"), 16)
    with pytest.raises(ConfigError, match="channels"):
        load_image(str(tmp_path / "x.png"), 16, channels=2)
