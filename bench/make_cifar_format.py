"""A CIFAR-10-python-format data set made offline from photos that scikit-image, scikit-learn
and matplotlib ship: ten photos, one class each, cut into 32x32 crops of random position and
scale (train crops from the top three quarters of each photo, test crops from the bottom
quarter, so the splits never share pixels), written as ``data_batch_1..5``, ``test_batch``
and ``batches.meta`` pickles that ``load_dataset("cifar10", path)`` reads like the real one.

Usage::

    python -m bench.make_cifar_format --out bench-data/cifar-photos   # ~5 s, 2000 train / 400 test
"""
from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import List, Tuple

import numpy as np

from audit.core.data import skimage_picture

SIDE = 32
TEST_FRACTION = 0.25  # the bottom quarter of each photo holds the test crops


def _sklearn(name: str):
    from PIL import Image
    import sklearn.datasets

    return Image.open(Path(sklearn.datasets.__file__).parent / "images" / name).convert("RGB")


def _matplotlib(name: str):
    from PIL import Image
    import matplotlib

    return Image.open(Path(matplotlib.get_data_path()) / "sample_data" / name).convert("RGB")


# (class name, loader, file): photos only, several outside the embedded data set
PHOTOS = [
    ("temple", _sklearn, "china.jpg"),
    ("flower", _sklearn, "flower.jpg"),
    ("portrait", _matplotlib, "grace_hopper.jpg"),
    ("cat", skimage_picture, "chelsea.png"),
    ("astronaut", skimage_picture, "astronaut.png"),
    ("coffee", skimage_picture, "coffee.png"),
    ("rocket", skimage_picture, "rocket.jpg"),
    ("motorcycle", skimage_picture, "motorcycle_right.png"),
    ("brick", skimage_picture, "brick.png"),
    ("gravel", skimage_picture, "gravel.png"),
]


def _crops(photo, count: int, top: float, bottom: float, rng: np.random.Generator) -> np.ndarray:
    """``count`` random square crops (a fifth to a half of the short side) from the band
    ``top..bottom`` (fractions of the height), resized to 32x32: ``(count, 3, 32, 32)`` uint8."""
    from PIL import Image

    w, h = photo.size
    y0, y1 = int(top * h), int(bottom * h)
    out = []
    for _ in range(count):
        s = int(rng.uniform(0.2, 0.5) * min(w, h))
        s = min(s, y1 - y0)
        x, y = int(rng.integers(0, w - s + 1)), int(rng.integers(y0, y1 - s + 1))
        crop = photo.crop((x, y, x + s, y + s)).resize((SIDE, SIDE), Image.LANCZOS)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
        out.append(np.asarray(crop, dtype=np.uint8).transpose(2, 0, 1))
    return np.stack(out)


def _write(path: Path, batch: dict) -> None:
    with open(path, "wb") as fh:
        pickle.dump(batch, fh, protocol=2)


def make(out: Path, train_per_class: int = 200, test_per_class: int = 40, seed: int = 0) -> Tuple[int, int]:
    """Write the data set under ``out/cifar-10-batches-py``; the number of train and test images."""
    rng = np.random.default_rng(seed)
    train: List[Tuple[np.ndarray, int]] = []
    test: List[Tuple[np.ndarray, int]] = []
    for label, (_, load, name) in enumerate(PHOTOS):
        photo = load(name)
        train += [(x, label) for x in _crops(photo, train_per_class, 0.0, 1 - TEST_FRACTION, rng)]
        test += [(x, label) for x in _crops(photo, test_per_class, 1 - TEST_FRACTION, 1.0, rng)]
    folder = out / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    order = rng.permutation(len(train))
    for k, part in enumerate(np.array_split(order, 5), 1):
        _write(folder / f"data_batch_{k}", {b"batch_label": f"training batch {k} of 5".encode(),
                                             b"labels": [train[i][1] for i in part],
                                             b"data": np.stack([train[i][0].reshape(-1) for i in part])})
    _write(folder / "test_batch", {b"batch_label": b"testing batch 1 of 1", b"labels": [y for _, y in test],
                                   b"data": np.stack([x.reshape(-1) for x, _ in test])})
    _write(folder / "batches.meta", {b"label_names": [c.encode() for c, _, _ in PHOTOS]})
    return len(train), len(test)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-data/cifar-photos")
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--test-per-class", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    n_train, n_test = make(Path(args.out), args.train_per_class, args.test_per_class, args.seed)
    print(f"wrote {n_train} train / {n_test} test 32x32 images in 10 classes to {Path(args.out) / 'cifar-10-batches-py'}")


if __name__ == "__main__":
    main()
