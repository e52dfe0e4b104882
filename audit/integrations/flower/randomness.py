"""The client's global random states (torch, CUDA, numpy, random), kept as they were around
the mod's own work: a client that shuffles, samples or augments with them trains the same
with the mod as without it."""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch


@contextlib.contextmanager
def preserved_random_state() -> Iterator[None]:
    """Restore torch's (and CUDA's, where initialised), numpy's and ``random``'s global states on exit."""
    cuda = torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)
