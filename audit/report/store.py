"""The on-disk result store that makes an audit resumable.

Layout under the output directory ``DIR``::

    DIR/runs/<key>/manifest.json          settings, threat model, plan, utility, versions
    DIR/runs/<key>/originals/i<N>.png     private batch N (for the report's grids)
    DIR/runs/<key>/checkpoints/s<S>.pt    model state at audited step S
    DIR/runs/<key>/results/s<S>__<attack>__i<N>.json   one finished (step, attack, image)
    DIR/runs/<key>/results/s<S>__<attack>__i<N>.png    its reconstruction
    DIR/runs/<key>/.lock, locks/s<S>__<attack>.lock   cross-process locks (manifest, group)
    DIR/latest_run                        the key of the last run written to DIR

``key`` is a hash of every setting that changes a number (defense, model and its
arguments, the data: path, grid, limit, size and a digest of the images; FL settings,
budget, seed, ...), so a rerun of the same command resumes, while a changed
setting starts a fresh run instead of reusing stale results. A stored error is retried
by a rerun (``retry_errors``). Every file is written to a
temporary name and renamed, so an interrupt (Ctrl-C) never leaves a half-written result; the
results of one (step, attack) group name the group, and count as finished only together, so a
cut between their writes redoes the group whole. A file that cannot be read is a cache miss.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from audit.core.errors import ConfigError, StoreError
from audit.core.manifest import Manifest
from audit.core.records import AttackResult
from audit.core.files import atomic_torch_save, atomic_write_bytes, exclusive_lock, storage_error
from audit.core.jsonable import from_jsonable, to_jsonable

MANIFEST = "manifest.json"
LATEST = "latest_run"
RETRIED = ("error",)  # stored statuses a rerun computes again (a timeout or a crash may not recur)
#: what a stored result must hold to be read (the rest has defaults)
RESULT_KEYS = {"step": int, "attack_id": str, "image": int, "status": str}
REDO = "rerun the same audit command to recompute it (or delete the file)"
#: run keys are what :func:`settings_key` makes: a name inside DIR/runs, never a path
RUN_KEY = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def settings_key(settings: Dict[str, Any], length: int = 12) -> str:
    """A short stable hash of a JSON-able settings dictionary."""
    blob = json.dumps(to_jsonable(settings), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=False).encode())


def read_json(path: Path, kind: type = object) -> Any:
    """The JSON value in ``path`` (of type ``kind``; its non-finite floats read back); a file that
    cannot be read or parsed, or holds another type, raises :class:`StoreError` naming it."""
    try:
        with open(path, encoding="utf-8") as fh:
            value = from_jsonable(json.load(fh))
    except (OSError, ValueError) as err:  # ValueError: JSONDecodeError, UnicodeDecodeError
        why = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
        raise StoreError(f"{path} cannot be read ({why}); {REDO}") from None
    if not isinstance(value, kind):
        raise StoreError(f"{path} holds a {type(value).__name__}, not a {kind.__name__}; {REDO}")
    return value


def save_png(path: Path, images: torch.Tensor) -> None:
    """Save a batch ``(B, C, H, W)`` in [0, 1] as one PNG, images side by side."""
    from audit.report.images import batch_to_png_bytes

    atomic_write_bytes(path, batch_to_png_bytes(images))


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name)


def result_id(step: int, attack_id: str, image: int) -> str:
    return f"s{int(step)}__{_safe(attack_id)}__i{int(image)}"


class ResultStore:
    """One run's results under ``DIR/runs/<key>``; see the module docstring for the layout.

    A stored file that cannot be read (truncated, not the expected JSON, a corrupt
    checkpoint) is a cache miss: it is left out of :meth:`records`, :meth:`has` says it is
    not finished, and :attr:`unreadable` names it with the reason, until a rerun writes it
    again (the rewrite is noted among the manifest's failures)."""

    def __init__(self, root: os.PathLike | str, key: str, retry_errors: bool = True):
        if not isinstance(key, str) or not RUN_KEY.match(key):
            raise ConfigError(f"run key {key!r} is not a run's name (letters, digits, '-', '_'); "
                              f"pick one of the folders under {Path(root) / 'runs'}")
        self.root = Path(root)
        self.key = key
        self.dir = self.root / "runs" / key
        self.retry_errors = bool(retry_errors)
        self.unreadable: Dict[str, str] = {}  # path -> why, for files read as a cache miss

    # -------------------------------------------------------------- opening
    @classmethod
    def create(cls, root: os.PathLike | str, settings: Dict[str, Any], retry_errors: bool = True) -> "ResultStore":
        """Open (or start) the run for ``settings`` and mark it as the latest in ``root``;
        ``retry_errors=False`` keeps stored errors as finished results."""
        store = cls(root, settings_key(settings), retry_errors)
        results = store.dir / "results"
        try:
            results.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise storage_error(results, err, "create the folder") from err
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
            try:
                key = marker.read_text().strip()
            except (OSError, ValueError) as err:
                raise StoreError(f"{marker} cannot be read ({err}); name the run with --run KEY") from None
        runs = sorted(p.name for p in (root / "runs").glob("*") if (p / MANIFEST).is_file())
        if not RUN_KEY.match(key) or not (root / "runs" / key / MANIFEST).is_file():
            raise ConfigError(
                f"run {key!r} not found in {root}; runs there: {', '.join(runs) or '(none)'}"
            )
        return cls(root, key)

    # -------------------------------------------------------------- manifest
    @property
    def manifest_path(self) -> Path:
        return self.dir / MANIFEST

    def load_manifest(self, strict: bool = False) -> Manifest:
        """The :class:`~audit.core.manifest.Manifest` (empty when there is none). One that cannot
        be read raises :class:`StoreError` with ``strict``; else it reads as a manifest holding
        only the note that it was unreadable (a rerun rebuilds it and keeps the note among its
        failures)."""
        return Manifest.from_dict(self._manifest_json(strict))

    def _manifest_json(self, strict: bool = False) -> Dict[str, Any]:
        if not self.manifest_path.is_file():
            return {}
        try:
            return read_json(self.manifest_path, dict)
        except StoreError as err:
            if strict:
                raise
            self.unreadable[str(self.manifest_path)] = str(err)
            return {"failures": [{"phase": "store", "status": "recomputed",
                                  "error": f"{err}: rebuilt (the utility measured again)"}]}

    def update_manifest(self, part: Optional[Manifest] = None, **fields: Any) -> Manifest:
        """Merge the fields ``part`` sets, and ``fields``, into the manifest; the read-modify-write
        holds a lock on the run (processes writing one run, such as a sweep's group jobs, never
        lose each other's fields). Keys the record does not know are kept as they were."""
        changes = {**(part.to_dict() if part is not None else {}), **fields}
        with self._locked():
            manifest = self._manifest_json()
            manifest.update(to_jsonable(changes))
            atomic_write_json(self.manifest_path, manifest)
        self.unreadable.pop(str(self.manifest_path), None)  # rebuilt, its loss noted in its failures
        return Manifest.from_dict(manifest)

    def claim(self, step: int, attack_id: str) -> ContextManager[None]:
        """Hold the (step, attack) group against other processes: a second audit of the same run
        waits here while the first attacks the group, then finds its results stored."""
        return self._locked(f"locks/{result_id(step, attack_id, 0).rsplit('__', 1)[0]}.lock")

    def _locked(self, name: str = ".lock") -> ContextManager[None]:
        """An exclusive lock on ``DIR/runs/<key>/<name>`` across processes."""
        return exclusive_lock(self.dir / name)

    def record_stop(self, err: BaseException) -> None:
        """Mark the run as stopped by ``err`` in the manifest, as far as the disk allows (a full
        disk may refuse even that; the run then reads as unfinished, never as complete)."""
        with contextlib.suppress(OSError):
            self.update_manifest(status=f"stopped ({type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''})")

    # -------------------------------------------------------------- results
    def result_path(self, step: int, attack_id: str, image: int, suffix: str = ".json") -> Path:
        return self.dir / "results" / (result_id(step, attack_id, image) + suffix)

    def _stored(self, path: Path) -> Optional[Dict[str, Any]]:
        """The stored record in ``path`` as a dict, or None when there is none or it cannot be
        read as one (noted in :attr:`unreadable`)."""
        if not path.is_file():
            return None
        try:
            raw = read_json(path, dict)
            AttackResult.from_dict(raw)  # the fields a report needs have the right types
            if not all(isinstance(raw.get(k), t) for k, t in RESULT_KEYS.items()):
                raise StoreError(f"{path} misses its {', '.join(RESULT_KEYS)} or holds the wrong types; {REDO}")
            if not isinstance(raw.get("metrics"), (dict, type(None))) or \
                    (raw.get("status") == "ok" and not isinstance(raw.get("metrics"), dict)):
                raise StoreError(f"{path} holds no metrics for a finished result; {REDO}")
        except StoreError as err:
            self.unreadable[str(path)] = str(err)
            return None
        except Exception as err:  # the record's own checks (a status that is not one, ...)
            self.unreadable[str(path)] = f"{path} is not a result record ({type(err).__name__}: {err}); {REDO}"
            return None
        self.unreadable.pop(str(path), None)
        return raw

    def has(self, step: int, attack_id: str, image: int, settings: Optional[Dict[str, Any]] = None,
            defaults: Optional[str] = None) -> bool:
        """Whether this result is finished; with ``settings`` (and ``defaults``, the fingerprint
        of the attack's own defaults), only if it was computed with exactly those (a changed
        attack is redone, not reused). A stored error is not finished while ``retry_errors`` is
        on (the default): a rerun retries it. A result computed in a group
        (:meth:`save_group`) is finished only when every member of its group is stored: a
        group cut short is computed again as the same group, so its numbers do not move."""
        record = self._stored(self.result_path(step, attack_id, image))
        if record is None:
            return False
        if self.retry_errors and record.get("status") in RETRIED:
            return False
        if defaults is not None and record.get("defaults") != defaults:
            return False
        if settings is not None and to_jsonable(record.get("settings")) != to_jsonable(settings):
            return False
        group = record.get("group")
        return not isinstance(group, list) or all(
            (member := self._stored(self.result_path(step, attack_id, other))) is not None
            and member.get("group") == group for other in group if other != image)

    def save_result(self, result: AttackResult, reconstruction: Optional[torch.Tensor] = None,
                    group: Optional[Sequence[int]] = None) -> Path:
        """Write one finished result (and its reconstruction PNG) atomically; the PNG is
        written first so that a JSON on disk always has its picture. ``group``: the images
        computed together with it (see :meth:`has`)."""
        record = AttackResult.from_dict(result).to_dict()
        step, attack_id, image = record["step"], record["attack_id"], record["image"]
        if reconstruction is not None:
            png = self.result_path(step, attack_id, image, ".png")
            save_png(png, reconstruction)
            record["png"] = str(png.relative_to(self.dir))
        if group is not None:
            record["group"] = sorted(int(i) for i in group)
        path = self.result_path(step, attack_id, image)
        replaced = self.unreadable.pop(str(path), None)
        atomic_write_json(path, record)
        if replaced is not None:  # say in the report that a stored result was lost and recomputed
            failures = self.load_manifest().failures or []
            self.update_manifest(failures=failures + [{
                "phase": "store", "step": step, "attack": attack_id, "image": image, "status": "recomputed",
                "error": replaced.split("; ")[0] + ": recomputed"}])
        return path

    def save_group(self, results: Sequence[Tuple[AttackResult, Optional[torch.Tensor]]]) -> List[Path]:
        """Write the results of one (step, attack) group, each marked with the group's images:
        a rerun after an interrupt between two of these writes computes the whole group again
        (:meth:`has`), so resumed numbers equal uninterrupted ones."""
        images = [AttackResult.from_dict(r).image for r, _ in results]
        return [self.save_result(r, png, group=images if len(images) > 1 else None) for r, png in results]

    def records(self) -> List[AttackResult]:
        """Every readable finished result of this run, ordered by step, attack and image (the
        unreadable ones are named in :attr:`unreadable`)."""
        raw = (self._stored(p) for p in sorted((self.dir / "results").glob("*.json")))
        out = [AttackResult.from_dict(r) for r in raw if r is not None]
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
        """The stored model state of ``step``; None when there is none or it cannot be read (a
        truncated or corrupt file is retrained, and named in :attr:`unreadable`)."""
        path = self.checkpoint_path(step)
        if not path.is_file():
            return None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise TypeError(f"holds a {type(state).__name__}, not a state dict of tensors")
        except Exception as err:  # truncated zip, bad pickle, wrong content: retrain this step
            self.unreadable[str(path)] = f"{path} cannot be read ({type(err).__name__}: {str(err)[:200]}); retrained"
            return None
        return state
