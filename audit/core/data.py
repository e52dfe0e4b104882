"""Data sets by name: an embedded default that needs no network, and loaders for CIFAR-10/100,
MNIST and an image folder from a local path.

Every loader returns a :class:`Dataset` of float images in [0, 1] ``(N, C, H, W)`` resized to
``size x size`` (``size=32`` by default), with a fixed train/test split and the per-channel
mean / std of the training images (the models put normalisation in their first layer).
Missing, truncated or wrong-format files raise a :class:`~audit.core.errors.DataError` that names
the path and what was expected. Nothing is downloaded unless ``download=True`` is given.
"""
from __future__ import annotations

import codecs
import functools
import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from audit.core.errors import ConfigError, DataError
from audit.core.registry import Registry

DATASETS = Registry("dataset")

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
_LUMA = (0.299, 0.587, 0.114)  # ITU-R BT.601, as PIL's "L" mode


# --------------------------------------------------------------------------- the data set
@dataclass
class Dataset:
    """Images in [0, 1] ``(N, C, H, W)`` with integer labels, split into train and test."""

    name: str
    train_images: Tensor
    train_labels: Tensor
    test_images: Tensor
    test_labels: Tensor
    classes: List[str]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            images, labels = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
            if images.ndim != 4 or labels.ndim != 1 or len(images) != len(labels):
                raise DataError(
                    f"data set {self.name!r}: {split} images {tuple(images.shape)} and labels "
                    f"{tuple(labels.shape)} do not form (N, C, H, W) / (N,) pairs"
                )
            if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= len(self.classes)):
                raise DataError(
                    f"data set {self.name!r}: {split} labels outside 0..{len(self.classes) - 1}"
                )
        if self.train_images.shape[1:] != self.test_images.shape[1:]:
            raise DataError(f"data set {self.name!r}: train and test images differ in shape")

    @property
    def input_shape(self) -> Tuple[int, int, int]:
        return tuple(self.train_images.shape[1:])  # type: ignore[return-value]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, input_shape={self.input_shape}, classes={self.num_classes}, "
                f"train={len(self.train_labels)}, test={len(self.test_labels)})")


def load_dataset(name: str, path: Optional[str] = None, size: int = 32, **kw) -> Dataset:
    """Load a registered data set (see :data:`DATASETS`) at ``size x size`` pixels."""
    if path is not None:
        kw["path"] = path
    return DATASETS.build(name, size=size, **kw)


# --------------------------------------------------------------------------- image helpers
def _check_size(size: int) -> int:
    if not isinstance(size, int) or size < 4:
        raise ConfigError(f"image size must be an integer >= 4 pixels, got {size!r}")
    return size


def _check_channels(channels: Optional[int]) -> Optional[int]:
    if channels not in (None, 1, 3):
        raise ConfigError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
    return channels


def _pil_square(img, side: int, keep: float = 1.0):
    """Centre-crop a PIL image to a square (``keep`` of its short side) and resize it to
    ``side x side`` (Lanczos)."""
    from PIL import Image

    w, h = img.size
    s = max(1, round(min(w, h) * keep))
    left, top = (w - s) // 2, (h - s) // 2
    img = img.crop((left, top, left + s, top + s))
    return img if s == side else img.resize((side, side), Image.LANCZOS)


def _pil_to_tensor(img) -> Tensor:
    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr.copy()).permute(2, 0, 1).float().div_(255.0)


def _open_image(path: Path, channels: int):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.convert("L" if channels == 1 else "RGB")
    except FileNotFoundError:
        raise DataError(f"image {path} does not exist; give the path of a PNG/JPEG file") from None
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise DataError(f"{path} is not a readable image ({err}); expected a PNG/JPEG file") from None


def load_image(path: str, size: int = 32, channels: int = 3) -> Tensor:
    """One image file as a ``(1, C, size, size)`` tensor in [0, 1] (centre square crop)."""
    _check_size(size)
    if _check_channels(channels) is None:
        raise ConfigError("load_image needs channels=1 or channels=3")
    return _pil_to_tensor(_pil_square(_open_image(Path(path), channels), size)).unsqueeze(0)


def to_grayscale(images: Tensor) -> Tensor:
    """``(N, 3, H, W) -> (N, 1, H, W)`` with the BT.601 luma weights."""
    w = torch.tensor(_LUMA, dtype=images.dtype, device=images.device).view(1, 3, 1, 1)
    return (images * w).sum(1, keepdim=True)


def _convert_channels(images: Tensor, channels: Optional[int]) -> Tensor:
    if channels is None or images.shape[1] == channels:
        return images
    return to_grayscale(images) if channels == 1 else images.expand(-1, 3, -1, -1).contiguous()


def _resize(images: Tensor, size: int, chunk: int = 4096) -> Tensor:
    if images.shape[-2:] == (size, size):
        return images
    parts = [F.interpolate(images[i:i + chunk], size=(size, size), mode="bilinear",
                           align_corners=False, antialias=True) for i in range(0, len(images), chunk)]
    return torch.cat(parts).clamp_(0.0, 1.0)


def _channel_stats(images: Tensor) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
    flat = images.transpose(0, 1).reshape(images.shape[1], -1).double()
    std = flat.std(1).clamp_min(1e-3)
    return tuple(flat.mean(1).tolist()), tuple(std.tolist())


def _finalize(name: str, train: Tuple[Tensor, Tensor], test: Tuple[Tensor, Tensor], classes: Sequence[str],
              size: int, channels: Optional[int] = None, limit: Optional[int] = None) -> Dataset:
    """Resize / convert raw splits, keep the first ``limit`` of each, compute the statistics."""
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1 (images per split), got {limit}")
    splits = []
    for images, labels in (train, test):
        if limit is not None:
            images, labels = images[:limit], labels[:limit]
        images = _convert_channels(_resize(images.float(), size), channels)
        splits.append((images.contiguous(), labels.long()))
    mean, std = _channel_stats(splits[0][0])
    return Dataset(name, *splits[0], *splits[1], list(classes), mean, std)


def _uint8_images(arr: np.ndarray) -> Tensor:
    """``(N, H, W, C)`` or ``(N, C, H, W)`` uint8 array -> float tensor ``(N, C, H, W)`` in [0, 1]."""
    return torch.from_numpy(arr.astype(np.float32)).div_(255.0)


# --------------------------------------------------------------------------- embedded data
# (class name, picture in scikit-image's data folder -- shipped inside the wheel, no pooch
#  download -- and the fraction of the centred square kept: the retina's fundus is a disc)
EMBEDDED_SOURCES: List[Tuple[str, str, float]] = [
    ("astronaut", "astronaut.png", 1.0),
    ("cat", "chelsea.png", 1.0),
    ("coffee", "coffee.png", 1.0),
    ("galaxies", "hubble_deep_field.jpg", 1.0),
    ("tissue", "ihc.png", 1.0),
    ("retina", "retina.jpg", 0.7),
    ("rocket", "rocket.jpg", 1.0),
    ("motorcycle", "motorcycle_left.png", 1.0),
    ("photographer", "camera.png", 1.0),
    ("grass", "grass.png", 1.0),
]


def skimage_picture(filename: str):
    """A picture bundled with scikit-image, as an RGB PIL image (read directly, no imageio)."""
    import skimage.data
    from PIL import Image

    path = Path(skimage.data.__file__).parent / filename
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, ValueError) as err:
        raise DataError(f"the embedded data set needs {path}, bundled with scikit-image, which failed "
                        f"to load ({err}); reinstall scikit-image >= 0.22") from None


@functools.lru_cache(maxsize=8)
def _embedded_tiles(size: int, grid: int, test_rows: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Cut every source into a ``grid x grid`` mosaic of non-overlapping ``size`` crops; the
    bottom ``test_rows`` rows of tiles form the test split (disjoint regions)."""
    cut = grid - test_rows
    train, test = [], []
    for _, filename, keep in EMBEDDED_SOURCES:
        pic = np.asarray(_pil_square(skimage_picture(filename), size * grid, keep), dtype=np.uint8)
        tiles = pic.reshape(grid, size, grid, size, 3).transpose(0, 2, 4, 1, 3)  # row, col, C, y, x
        train.append(tiles[:cut].reshape(-1, 3, size, size))
        test.append(tiles[cut:].reshape(-1, 3, size, size))
    classes = torch.arange(len(EMBEDDED_SOURCES))
    return (_uint8_images(np.concatenate(train)), classes.repeat_interleave(cut * grid),
            _uint8_images(np.concatenate(test)), classes.repeat_interleave(test_rows * grid))


def _embedded(name: str, size: int, grid: int, channels: int) -> Dataset:
    _check_size(size)
    if grid < 2:
        raise ConfigError(f"grid must be >= 2 tiles per side (one row is kept for testing), got {grid}")
    tx, ty, vx, vy = _embedded_tiles(size, grid, max(1, grid // 4))
    classes = [cls for cls, _, _ in EMBEDDED_SOURCES]
    return _finalize(name, (tx.clone(), ty.clone()), (vx.clone(), vy.clone()), classes, size, channels)


@DATASETS.register("embedded", "Offline default: 10 scikit-image photos cut into RGB crops (480 train / 160 test at grid=8)")
def embedded(size: int = 32, grid: int = 8) -> Dataset:
    """Deterministic: each class is one picture, tiled into ``grid x grid`` crops; the bottom
    quarter of each picture is the test split."""
    return _embedded("embedded", size, grid, 3)


@DATASETS.register("embedded-gray", "The embedded data set in grayscale (1 channel)")
def embedded_gray(size: int = 32, grid: int = 8) -> Dataset:
    return _embedded("embedded-gray", size, grid, 1)


# --------------------------------------------------------------------------- local files
def _require_path(name: str, path: Optional[str], expected: str) -> Path:
    if path is None:
        raise DataError(f"data set {name!r} needs a local path (--data-path) to {expected}; "
                        "pass download=True to fetch it")
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"{p} does not exist; expected {expected}")
    return p


def _first_dir_with(root: Path, candidates: Sequence[str], marker: str) -> Optional[Path]:
    for sub in candidates:
        d = root / sub if sub else root
        if (d / marker).is_file() or (d / (marker + ".gz")).is_file():
            return d
    return None


_NUMPY_GLOBALS: Dict[Tuple[str, str], object] = {}


def _numpy_globals() -> Dict[Tuple[str, str], object]:
    if not _NUMPY_GLOBALS:
        try:
            from numpy._core import multiarray
        except ImportError:  # numpy < 2
            from numpy.core import multiarray
        for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
            _NUMPY_GLOBALS[(mod, "_reconstruct")] = multiarray._reconstruct
            _NUMPY_GLOBALS[(mod, "scalar")] = multiarray.scalar
        _NUMPY_GLOBALS[("numpy", "ndarray")] = np.ndarray
        _NUMPY_GLOBALS[("numpy", "dtype")] = np.dtype
        _NUMPY_GLOBALS[("_codecs", "encode")] = codecs.encode  # bytes in protocol-2 pickles
    return _NUMPY_GLOBALS


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles only plain containers and numpy arrays: no code from the file is run."""

    def find_class(self, module: str, name: str):
        try:
            return _numpy_globals()[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}") from None


def safe_unpickle(path: Path, what: str):
    """Load a pickle of dicts / lists / numpy arrays (CIFAR batches, weight checkpoints)."""
    try:
        with open(path, "rb") as fh:
            return _ArrayUnpickler(fh, encoding="bytes").load()
    except FileNotFoundError:
        raise DataError(f"{path} does not exist; expected {what}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError,
            AttributeError, UnicodeDecodeError, OSError) as err:
        raise DataError(f"{path} is truncated or not {what} ({type(err).__name__}: {err})") from None


def _get(d, key: str):
    if isinstance(d, dict):
        for k in (key.encode(), key):
            if k in d:
                return d[k]
    return None


def _cifar_batch(path: Path, label_key: str) -> Tuple[Tensor, Tensor]:
    what = f"a CIFAR python pickle batch (a dict with b'data' (N, 3072) uint8 and b'{label_key}')"
    batch = safe_unpickle(path, what)
    data, labels = _get(batch, "data"), _get(batch, label_key)
    if not isinstance(data, np.ndarray) or labels is None:
        raise DataError(f"{path} is not {what}")
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DataError(f"{path}: b'data' has shape {data.shape} ({data.dtype}) and {len(labels)} labels; "
                        f"expected {what} with one label per row (truncated file?)")
    return _uint8_images(data.reshape(-1, 3, 32, 32)), torch.as_tensor(np.asarray(labels), dtype=torch.long)


def _cifar_names(meta_path: Path, key: str, count: int) -> List[str]:
    if not meta_path.is_file():
        return [str(i) for i in range(count)]
    names = _get(safe_unpickle(meta_path, f"a CIFAR meta pickle with b'{key}'"), key)
    if not isinstance(names, list) or len(names) != count:
        raise DataError(f"{meta_path} has no list of {count} names under b'{key}'")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def _cifar(name: str, path: Optional[str], download: bool, subdir: str, train_files: Sequence[str],
           test_file: str, label_key: str, meta: Tuple[str, str], count: int, size: int,
           channels: Optional[int], limit: Optional[int]) -> Dataset:
    expected = (f"the {name} python version: a folder ({subdir}) with "
                f"{', '.join(train_files)} and {test_file}")
    if download:
        _download(name, path)
    root = _require_path(name, path, expected)
    folder = _first_dir_with(root, ("", subdir), test_file)
    if folder is None:
        raise DataError(f"{root} has no {test_file}; expected {expected}")
    missing = [f for f in (*train_files, test_file) if not (folder / f).is_file()]
    if missing:
        raise DataError(f"{folder} lacks {', '.join(missing)}; expected {expected}")
    train = [_cifar_batch(folder / f, label_key) for f in train_files]
    test = _cifar_batch(folder / test_file, label_key)
    train_x, train_y = torch.cat([b[0] for b in train]), torch.cat([b[1] for b in train])
    for labels, file in ((train_y, train_files[0]), (test[1], test_file)):
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= count):
            raise DataError(f"{folder / file}: labels outside 0..{count - 1}; is this {name}?")
    classes = _cifar_names(folder / meta[0], meta[1], count)
    return _finalize(name, (train_x, train_y), test, classes, _check_size(size), _check_channels(channels), limit)


@DATASETS.register("cifar10", "CIFAR-10 python pickle batches from a local path (data_batch_1..5, test_batch)")
def cifar10(path: Optional[str] = None, size: int = 32, channels: Optional[int] = None,
            limit: Optional[int] = None, download: bool = False) -> Dataset:
    return _cifar("cifar10", path, download, "cifar-10-batches-py",
                  [f"data_batch_{i}" for i in range(1, 6)], "test_batch", "labels",
                  ("batches.meta", "label_names"), 10, size, channels, limit)


@DATASETS.register("cifar100", "CIFAR-100 python pickles (train, test; fine labels) from a local path")
def cifar100(path: Optional[str] = None, size: int = 32, channels: Optional[int] = None,
             limit: Optional[int] = None, download: bool = False) -> Dataset:
    return _cifar("cifar100", path, download, "cifar-100-python", ["train"], "test", "fine_labels",
                  ("meta", "fine_label_names"), 100, size, channels, limit)


# MNIST idx files: magic = 0x00 0x00 <dtype 0x08 = ubyte> <ndim>
_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _read_maybe_gz(folder: Path, stem: str) -> Tuple[Path, bytes]:
    plain, gz = folder / stem, folder / (stem + ".gz")
    path = plain if plain.is_file() else gz
    if not path.is_file():
        raise DataError(f"{folder} lacks {stem} (or {stem}.gz); expected the four MNIST idx files "
                        f"{', '.join(n for pair in _MNIST_FILES.values() for n in pair)}")
    try:
        raw = path.read_bytes()
        return path, gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise DataError(f"{path} is a truncated or corrupt gzip file ({err}); re-extract MNIST") from None


def read_idx(folder: Path, stem: str, ndim: int) -> np.ndarray:
    """An idx file of unsigned bytes with ``ndim`` dimensions (MNIST's format)."""
    path, raw = _read_maybe_gz(folder, stem)
    expected = f"an idx file of unsigned bytes with {ndim} dimension(s) (magic 0x0000080{ndim})"
    if len(raw) < 4 + 4 * ndim or raw[:3] != b"\x00\x00\x08" or raw[3] != ndim:
        raise DataError(f"{path} is not {expected}")
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    body = raw[4 + 4 * ndim:]
    need = int(np.prod(dims))
    if len(body) != need:
        raise DataError(f"{path} is truncated: the header promises {dims} = {need} bytes, "
                        f"the file holds {len(body)}; expected {expected}")
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


@DATASETS.register("mnist", "MNIST idx files (optionally .gz) from a local path, resized to `size`")
def mnist(path: Optional[str] = None, size: int = 32, channels: Optional[int] = None,
          limit: Optional[int] = None, download: bool = False) -> Dataset:
    expected = "a folder with the MNIST idx files (train-images-idx3-ubyte[.gz], ...)"
    if download:
        _download("mnist", path)
    root = _require_path("mnist", path, expected)
    folder = _first_dir_with(root, ("", "raw", "MNIST/raw"), _MNIST_FILES["train"][0])
    if folder is None:
        raise DataError(f"{root} has no {_MNIST_FILES['train'][0]}[.gz]; expected {expected}")
    splits = []
    for images_stem, labels_stem in _MNIST_FILES.values():
        images, labels = read_idx(folder, images_stem, 3), read_idx(folder, labels_stem, 1)
        if len(images) != len(labels):
            raise DataError(f"{folder}: {images_stem} has {len(images)} images but {labels_stem} "
                            f"has {len(labels)} labels")
        if len(labels) and labels.max() > 9:
            raise DataError(f"{folder / labels_stem}: labels above 9; expected MNIST digit labels")
        splits.append((_uint8_images(images[:, None]), torch.from_numpy(labels.astype(np.int64))))
    return _finalize("mnist", splits[0], splits[1], [str(d) for d in range(10)],
                     _check_size(size), _check_channels(channels), limit)


def _class_images(class_dir: Path) -> List[Path]:
    return sorted(p for p in class_dir.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _folder_split(folders: Dict[str, List[Path]], classes: List[str], size: int, channels: int):
    xs, ys = [], []
    for label, cls in enumerate(classes):
        for f in folders.get(cls, []):
            xs.append(load_image(str(f), size, channels)[0])
            ys.append(label)
    empty = torch.zeros(0, channels, size, size)
    return (torch.stack(xs) if xs else empty), torch.tensor(ys, dtype=torch.long)


@DATASETS.register("folder", "An image folder (one sub-folder per class; optional train/ and test/)")
def folder(path: Optional[str] = None, size: int = 32, channels: int = 3,
           test_fraction: float = 0.2) -> Dataset:
    """``path/<class>/*.png``; or ``path/train/<class>`` and ``path/test/<class>``. Without the
    split folders, every ``round(1/test_fraction)``-th file (sorted by name) of each class is
    a test image."""
    expected = "a folder with one sub-folder of images (PNG/JPEG) per class"
    root = _require_path("folder", path, expected)
    _check_size(size)
    if _check_channels(channels) is None:
        raise ConfigError("the folder data set needs channels=1 or channels=3")
    if not root.is_dir():
        raise DataError(f"{root} is not a folder; expected {expected}")
    if (root / "train").is_dir() and (root / "test").is_dir():
        train = {d.name: _class_images(d) for d in (root / "train").iterdir() if d.is_dir()}
        test = {d.name: _class_images(d) for d in (root / "test").iterdir() if d.is_dir()}
    else:
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
        every = max(2, round(1.0 / test_fraction))
        files = {d.name: _class_images(d) for d in root.iterdir() if d.is_dir()}
        train = {c: [f for i, f in enumerate(fs) if i % every != every - 1] for c, fs in files.items()}
        test = {c: [f for i, f in enumerate(fs) if i % every == every - 1] for c, fs in files.items()}
    classes = sorted(c for c, fs in train.items() if fs)
    if len(classes) < 2:
        raise DataError(f"{root} has {len(classes)} class folder(s) with images; expected {expected} "
                        "and at least two classes")
    unknown = sorted(set(c for c, fs in test.items() if fs) - set(classes))
    if unknown:
        raise DataError(f"{root / 'test'} has classes {unknown} with no training images")
    tr, te = _folder_split(train, classes, size, channels), _folder_split(test, classes, size, channels)
    return _finalize("folder", tr, te, classes, size)


# --------------------------------------------------------------------------- explicit download
def _download(name: str, path: Optional[str]) -> None:
    """Fetch a public data set into ``path`` with torchvision (only when the user asks)."""
    from torchvision import datasets as tvd

    if path is None:
        raise DataError(f"download=True needs a path to download {name} into")
    fetchers = {"cifar10": tvd.CIFAR10, "cifar100": tvd.CIFAR100, "mnist": tvd.MNIST}
    try:
        for train in (True, False):
            fetchers[name](str(Path(path).expanduser()), train=train, download=True)
    except (OSError, RuntimeError) as err:
        raise DataError(f"could not download {name} into {path} ({err}); "
                        "download it by hand and give its local path") from None
