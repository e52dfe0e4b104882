"""One audited round on disk, in the client's own output folder (nothing of it leaves the client)::

    OUT/<client>/round-<r>/audit.json       status: queued, running, finished, failed or timed out; why; times
    OUT/<client>/round-<r>/global_model.pt  the state the client received in round r (a state_dict)
    OUT/<client>/round-<r>/job.pkl          the settings and the client's drawn images (removed when the audit ends)
    OUT/<client>/round-<r>/worker.log       the background audit's output; worker.pid its process id
    OUT/<client>/round-<r>/report.*, runs/  the audit's report and result store, as `gia-audit audit` writes them

The client's images are drawn once per round with the mod's seed (the same images every round
for the same data): ``images x batch_size`` audited images and up to ``reference`` others, the
null and the attacker's auxiliary data.
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
from audit.core.files import atomic_torch_save, atomic_write_bytes
from audit.engine.null import MIN_CANDIDATES
from audit.integrations.flower.settings import ModSettings

STATUS, JOB, STATE, LOG_FILE, PID_FILE = "audit.json", "job.pkl", "global_model.pt", "worker.log", "worker.pid"
PENDING = ("queued", "running")  # an audit in these states has no verdict yet
FINISHED = "finished"
_WRITING = threading.Lock()  # one status write at a time in a process (an inline audit runs on a thread)


@dataclass
class RoundJob:
    """What the worker needs to audit one round: the settings, the round's defense, where the
    state came from, and the client's drawn images ``(images, labels)``."""

    round: int
    client: str
    origin: str
    settings: ModSettings
    defense: Any
    defense_args: Dict[str, Any]
    private: Tuple[Tensor, Tensor]
    reference: Tuple[Tensor, Tensor]


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
    with _WRITING:
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


def client_images(got: Any, settings: ModSettings) -> Tuple[Tuple[Tensor, Tensor], Tuple[Tensor, Tensor]]:
    """``(private, reference)`` image/label pairs drawn from what ``data(context)`` returned."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise DataError(f"data(context) must return (images, labels), got {type(got).__name__}")
    images, labels = _as_tensor(got[0], "images").float(), _as_tensor(got[1], "labels").long()
    if images.dim() != 4 or labels.shape != (len(images),):
        raise DataError(f"data(context) must return images (N, C, H, W) and labels (N,), got "
                        f"{tuple(images.shape)} and {tuple(labels.shape)}")
    if len(images) and (images.min() < 0 or images.max() > 1):
        raise DataError("data(context) must return images in [0, 1] (the model's normalisation is model_normalize); "
                        "divide uint8 images by 255")
    need = settings.data.images * settings.data.batch_size
    if len(images) < need + MIN_CANDIDATES:
        raise DataError(f"the client's data has {len(images)} images; the audit needs images x batch_size = {need} "
                        f"audited images plus at least {MIN_CANDIDATES} others (the null and the candidates)")
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(settings.seed))
    private, reference = order[:need], order[need:need + settings.reference]
    return (images[private].clone(), labels[private].clone()), (images[reference].clone(), labels[reference].clone())


# --------------------------------------------------------------------------- the job file
def save_job(folder: Path, job: RoundJob, state: Dict[str, Tensor]) -> None:
    """Write the round's state and job (the job pickled by value, so factories and data
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
