"""One audited round on disk, in the client's own output folder (nothing of it leaves the client)::

    OUT/<client>/round-<r>/audit.json       status: queued, running, finished, failed or timed out; why; times
    OUT/<client>/round-<r>/global_model.pt  the state the client received in round r (a state_dict)
    OUT/<client>/round-<r>/job.pkl          the settings, the reply and the client's images (removed when the audit ends)
    OUT/<client>/round-<r>/worker.log       the background audit's output; worker.pid its process id
    OUT/<client>/round-<r>/report.*, runs/  the audit's report and result store, as `gia-audit audit` writes them

The round's images are the ones ``data`` says the round trained on (the audited batch, in
training order); up to ``reference`` of the client's other images, drawn with the mod's seed,
are the null and the attacker's auxiliary data.
"""
from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from audit.core.errors import DataError
from audit.core.files import atomic_torch_save, atomic_write_bytes, exclusive_lock
from audit.engine.null import MIN_CANDIDATES
from audit.integrations.flower.settings import ModSettings

STATUS, JOB, STATE, LOG_FILE, PID_FILE = "audit.json", "job.pkl", "global_model.pt", "worker.log", "worker.pid"
STATUS_LOCK = ".audit.json.lock"  # held across processes while the status is read, merged and written
PENDING = ("queued", "running")  # an audit in these states has no verdict yet
FINISHED = "finished"
NOT_JUDGED = "not judged"  # the declared training does not reproduce the reply: no attack ran
_WRITING = threading.Lock()  # one status write at a time in a process (an inline audit runs on a thread)


@dataclass
class RoundJob:
    """What the worker needs to audit one round: the settings, the round's defense, where the
    state came from, the arrays the client received and the reply it sent (by name), the
    images the round trained on and the reference images, each ``(images, labels)``."""

    round: int
    client: str
    origin: str
    settings: ModSettings
    defense: Any
    defense_args: Dict[str, Any]
    trained: Tuple[Tensor, Tensor]
    reference: Tuple[Tensor, Tensor]
    global_arrays: Dict[str, Tensor]
    reply: Dict[str, Tensor]


def round_dir(out: Path, client: str, round: int) -> Path:
    return Path(out) / client / f"round-{int(round)}"


def round_of(path: Path) -> Optional[int]:
    """The round of a ``round-<r>`` folder (None for any other name)."""
    name, _, number = Path(path).name.partition("-")
    return int(number) if name == "round" and number.isdigit() else None


# --------------------------------------------------------------------------- status
def read_status(folder: Path) -> Dict[str, Any]:
    path = Path(folder) / STATUS
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_status(folder: Path, fresh: bool = False, **fields: Any) -> Dict[str, Any]:
    """Merge ``fields`` into the round's status (``fresh``: replace it), written atomically;
    the status."""
    with _WRITING, exclusive_lock(Path(folder) / STATUS_LOCK):  # the mod and a round's process write it both
        status = {**({} if fresh else read_status(folder)), **fields, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}
        atomic_write_bytes(Path(folder) / STATUS, json.dumps(status, indent=2).encode())
    return status


def one_line(err: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def worker_alive(folder: Path) -> Optional[bool]:
    """Whether the round's background audit process is still there (None: it has none)."""
    try:
        pid = int((Path(folder) / PID_FILE).read_text())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an exited process nobody reaped yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# --------------------------------------------------------------------------- the client's data
def _as_tensor(value: Any, what: str) -> Tensor:
    try:
        return torch.as_tensor(value).detach().cpu()
    except (TypeError, ValueError, RuntimeError):
        raise DataError(f"data(context) returned {what} of type {type(value).__name__}; return tensors or arrays") \
            from None


def _rows(trained: Any, count: int) -> Tensor:
    rows = _as_tensor(trained, "trained")
    if rows.dtype == torch.bool:
        if rows.shape != (count,):
            raise DataError(f"data(context)'s trained mask has shape {tuple(rows.shape)}, the images {count}")
        rows = rows.nonzero().flatten()
    rows = rows.long().flatten()
    if not len(rows) or rows.min() < 0 or rows.max() >= count or len(set(rows.tolist())) != len(rows):
        raise DataError(f"data(context)'s trained must be distinct row indices in 0..{count - 1} (or a mask), "
                        "the images the round trained on in training order")
    return rows


def round_images(got: Any, settings: ModSettings) -> Tuple[Tuple[Tensor, Tensor], Tuple[Tensor, Tensor]]:
    """``(trained, reference)`` image/label pairs from what ``data`` returned: ``(images,
    labels, trained)``, ``trained`` the rows the round trained on (indices in training order,
    or a mask)."""
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        kind = f"{len(got)} items" if isinstance(got, (tuple, list)) else type(got).__name__
        raise DataError(f"data(context) must return (images, labels, trained), trained the rows this round "
                        f"trained on; got {kind} (docs/flower.md: 'Which images a round trained on')")
    images, labels = _as_tensor(got[0], "images").float(), _as_tensor(got[1], "labels").long()
    if images.dim() != 4 or labels.shape != (len(images),):
        raise DataError(f"data(context) must return images (N, C, H, W) and labels (N,), got "
                        f"{tuple(images.shape)} and {tuple(labels.shape)}")
    if len(images) and (images.min() < 0 or images.max() > 1):
        raise DataError("data(context) must return images in [0, 1] (the model's normalisation is model_normalize); "
                        "divide uint8 images by 255")
    rows = _rows(got[2], len(images))
    others = torch.ones(len(images), dtype=torch.bool)
    others[rows] = False
    rest = others.nonzero().flatten()
    if len(rest) < MIN_CANDIDATES:
        raise DataError(f"the client's data has {len(rest)} images besides the {len(rows)} the round trained on; the "
                        f"audit needs at least {MIN_CANDIDATES} others (the null and the candidates): return more of "
                        "the client's images (e.g. its validation split) with the trained rows")
    order = rest[torch.randperm(len(rest), generator=torch.Generator().manual_seed(settings.seed))]
    reference = order[:settings.reference]
    return (images[rows].clone(), labels[rows].clone()), (images[reference].clone(), labels[reference].clone())


# --------------------------------------------------------------------------- the job file
def save_job(folder: Path, job: RoundJob, state: Dict[str, Tensor]) -> None:
    """Write the round's global state (``state``, the model's state_dict) and job (the job pickled by value, so factories and data
    functions defined in a script or a notebook reach the worker too)."""
    try:
        import cloudpickle as pickler
    except ImportError:  # flwr[simulation] brings cloudpickle; plain pickle needs importable callables
        import pickle as pickler
    folder.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(state, folder / STATE)
    atomic_write_bytes(folder / JOB, pickler.dumps(job))


def load_job(folder: Path) -> RoundJob:
    import pickle

    return pickle.loads((Path(folder) / JOB).read_bytes())
