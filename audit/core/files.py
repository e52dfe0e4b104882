"""Atomic file writes: a temporary file in the same folder, then a rename, so a reader (a
resumed audit, a concurrent test worker) never sees half a file. A write that fails (a full
disk, a read-only folder, a path under a file) removes its temporary file and raises
:class:`~audit.core.errors.StoreError` naming the file and the fix."""
from __future__ import annotations

import contextlib
import errno
import io
import os
from pathlib import Path
from typing import Any, Iterator

from audit.core.errors import StoreError


#: the fix for an OSError, by its errno (else :data:`DEFAULT_FIX`)
FIXES = {
    errno.ENOSPC: "free disk space",
    errno.EDQUOT: "free disk space (the disk quota is used up)",
    errno.EISDIR: "it is a folder: remove or rename it",
    errno.ENOTDIR: "a part of the path is a file, not a folder: choose another output folder",
    errno.EACCES: "make the folder writable, or choose another output folder",
    errno.EPERM: "make the folder writable, or choose another output folder",
    errno.EROFS: "the file system is read-only: choose another output folder",
}
DEFAULT_FIX = "make sure its folder is a writable folder with free space, or choose another output folder"


def storage_error(path: os.PathLike | str, err: OSError, doing: str = "write") -> StoreError:
    """One line for an OSError on ``path``: what failed, why, and what to do about it."""
    why = err.strerror or type(err).__name__
    fix = FIXES.get(err.errno, DEFAULT_FIX)
    return StoreError(f"cannot {doing} {path}: {why}; {fix}, then rerun (finished work is kept)")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as err:  # a failed write, or an interrupt before the rename
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and not isinstance(err, StoreError):
            raise storage_error(path, err) from err
        raise


def atomic_torch_save(obj: Any, path: Path) -> Path:
    """``torch.save`` that never leaves a truncated file behind."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


@contextlib.contextmanager
def exclusive_lock(path: os.PathLike | str) -> Iterator[None]:
    """An exclusive lock on the file ``path`` across processes, held for the ``with`` block
    (none where the platform has no ``fcntl``: there, writers must not overlap)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError as err:
        raise storage_error(path, err) from err
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
