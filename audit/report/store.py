"""The on-disk result store that makes an audit resumable.

Layout under the output directory ``DIR``::

    DIR/runs/<key>/manifest.json          settings, threat model, plan, utility, versions
    DIR/runs/<key>/originals/i<N>.png     private batch N (for the report's grids)
    DIR/runs/<key>/checkpoints/s<S>.pt    model state at audited step S
    DIR/runs/<key>/results/s<S>__<attack>__i<N>.json   one finished (step, attack, image)
    DIR/runs/<key>/results/s<S>__<attack>__i<N>.png    its reconstruction
    DIR/latest_run                        the key of the last run written to DIR

``key`` is a hash of every setting that changes a number (defense, model and its
arguments, the data: path, grid, limit, size and a digest of the images; FL settings,
budget, seed, ...), so a rerun of the same command resumes, while a changed
setting starts a fresh run instead of reusing stale results. A stored error is retried
by a rerun (``retry_errors``). Every file is written to a
temporary name and renamed, so an interrupt (Ctrl-C) never leaves a half-written result.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import torch

from audit.core.errors import ConfigError
from audit.core.records import AttackResult
from audit.core.files import atomic_torch_save, atomic_write_bytes

MANIFEST = "manifest.json"
LATEST = "latest_run"
RETRIED = ("error",)  # stored statuses a rerun computes again (a timeout or a crash may not recur)


def settings_key(settings: Dict[str, Any], length: int = 12) -> str:
    """A short stable hash of a JSON-able settings dictionary."""
    blob = json.dumps(to_jsonable(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def to_jsonable(obj: Any) -> Any:
    """Convert tensors, tuples, paths and non-finite floats into plain JSON values.

    Non-finite floats become ``None`` (JSON has no NaN); callers report why a value is
    missing separately.
    """
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and hasattr(obj, "as_dict"):  # a typed record
        return to_jsonable(obj.as_dict())
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return to_jsonable(obj.item())
    return repr(obj)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=False).encode())


def read_json(path: Path) -> Any:
    with open(path) as fh:
        return json.load(fh)


def save_png(path: Path, images: torch.Tensor) -> None:
    """Save a batch ``(B, C, H, W)`` in [0, 1] as one PNG, images side by side."""
    from audit.report.images import batch_to_png_bytes

    atomic_write_bytes(path, batch_to_png_bytes(images))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def result_id(step: int, attack_id: str, image: int) -> str:
    return f"s{int(step)}__{_safe(attack_id)}__i{int(image)}"


class ResultStore:
    """One run's results under ``DIR/runs/<key>``; see the module docstring for the layout."""

    def __init__(self, root: os.PathLike | str, key: str, retry_errors: bool = True):
        self.root = Path(root)
        self.key = key
        self.dir = self.root / "runs" / key
        self.retry_errors = bool(retry_errors)

    # -------------------------------------------------------------- opening
    @classmethod
    def create(cls, root: os.PathLike | str, settings: Dict[str, Any], retry_errors: bool = True) -> "ResultStore":
        """Open (or start) the run for ``settings`` and mark it as the latest in ``root``;
        ``retry_errors=False`` keeps stored errors as finished results."""
        store = cls(root, settings_key(settings), retry_errors)
        (store.dir / "results").mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(store.root / LATEST, store.key.encode())
        return store

    @classmethod
    def open_latest(cls, root: os.PathLike | str, key: Optional[str] = None) -> "ResultStore":
        """The run ``key`` (default: the latest) of a finished or interrupted audit in ``root``."""
        root = Path(root)
        if key is None:
            marker = root / LATEST
            if not marker.is_file():
                raise ConfigError(
                    f"{root} holds no audit (no {LATEST} file); run `gia-audit audit --out {root}` first"
                )
            key = marker.read_text().strip()
        store = cls(root, key)
        if not (store.dir / MANIFEST).is_file():
            runs = sorted(p.name for p in (root / "runs").glob("*") if (p / MANIFEST).is_file())
            raise ConfigError(
                f"run {key!r} not found in {root}; runs there: {', '.join(runs) or '(none)'}"
            )
        return store

    # -------------------------------------------------------------- manifest
    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST

    def load_manifest(self) -> Dict[str, Any]:
        return read_json(self.manifest_path) if self.manifest_path.is_file() else {}

    def update_manifest(self, **fields: Any) -> Dict[str, Any]:
        manifest = self.load_manifest()
        manifest.update(to_jsonable(fields))
        atomic_write_json(self.manifest_path, manifest)
        return manifest

    # -------------------------------------------------------------- results
    def result_path(self, step: int, attack_id: str, image: int, suffix: str = ".json") -> Path:
        return self.dir / "results" / (result_id(step, attack_id, image) + suffix)

    def has(self, step: int, attack_id: str, image: int, settings: Optional[Dict[str, Any]] = None,
            defaults: Optional[str] = None) -> bool:
        """Whether this result is finished; with ``settings`` (and ``defaults``, the fingerprint
        of the attack's own defaults), only if it was computed with exactly those (a changed
        attack is redone, not reused). A stored error is not finished while ``retry_errors`` is
        on (the default): a rerun retries it."""
        path = self.result_path(step, attack_id, image)
        if not path.is_file():
            return False
        record = read_json(path)
        if self.retry_errors and record.get("status") in RETRIED:
            return False
        if defaults is not None and record.get("defaults") != defaults:
            return False
        return settings is None or record.get("settings") == to_jsonable(settings)

    def save_result(self, result: AttackResult, reconstruction: Optional[torch.Tensor] = None) -> Path:
        """Write one finished result (and its reconstruction PNG) atomically; the PNG is
        written first so that a JSON on disk always has its picture."""
        record = AttackResult.from_dict(result).to_dict()
        step, attack_id, image = record["step"], record["attack_id"], record["image"]
        if reconstruction is not None:
            png = self.result_path(step, attack_id, image, ".png")
            save_png(png, reconstruction)
            record["png"] = str(png.relative_to(self.dir))
        path = self.result_path(step, attack_id, image)
        atomic_write_json(path, record)
        return path

    def records(self) -> List[AttackResult]:
        """Every finished result of this run, ordered by step, attack and image."""
        out = [AttackResult.from_dict(read_json(p)) for p in sorted((self.dir / "results").glob("*.json"))]
        return sorted(out, key=lambda r: (r.step, r.attack_id, r.image))

    def __iter__(self) -> Iterator[AttackResult]:
        return iter(self.records())

    # -------------------------------------------------------------- originals / checkpoints
    def original_path(self, image: int) -> Path:
        return self.dir / "originals" / f"i{int(image)}.png"

    def save_original(self, image: int, batch: torch.Tensor) -> None:
        if not self.original_path(image).is_file():
            save_png(self.original_path(image), batch)

    def checkpoint_path(self, step: int) -> Path:
        return self.dir / "checkpoints" / f"s{int(step)}.pt"

    def save_checkpoint(self, step: int, state: Dict[str, torch.Tensor]) -> None:
        atomic_torch_save({k: v.detach().cpu() for k, v in state.items()}, self.checkpoint_path(step))

    def load_checkpoint(self, step: int) -> Optional[Dict[str, torch.Tensor]]:
        path = self.checkpoint_path(step)
        return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None
