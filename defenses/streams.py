"""Parallel Gaussian draws: many rows of normal numbers filled by several random streams at once.

A CPU generator fills a tensor on one core (its state is sequential); a defense that draws
millions of normal numbers per call (CENSOR: ``trials`` x the model's parameter count) spends
most of its time there. :func:`fill_normal` splits the rows among :data:`STREAMS` generators
seeded from the caller's generator and fills them on up to ``torch.get_num_threads()``
threads. The number of streams is fixed, so the same generator state gives the same numbers
on any machine; the caller's generator advances by the :data:`STREAMS` seeds it hands out.

:class:`Workspaces` keeps large scratch buffers between calls: writing into fresh memory
costs the page faults of its first touch, a large share of a draw on a small model.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.defense_call import in_functorch_transform

STREAMS = 4  # random streams per draw; fixed so the numbers do not depend on the machine's cores
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


def stream_rows(rows: int, streams: int = STREAMS) -> List[Tuple[int, int]]:
    """Contiguous ``[lo, hi)`` row ranges, one per stream, as equal as possible (some empty)."""
    bounds = [rows * j // streams for j in range(streams + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def stream_generators(generator: torch.Generator, streams: int = STREAMS) -> List[torch.Generator]:
    """``streams`` generators on ``generator``'s device, seeded by ``streams`` draws from it."""
    seeds = torch.randint(0, 2 ** 62, (streams,), generator=generator, device=generator.device).tolist()
    return [torch.Generator(device=generator.device).manual_seed(int(s)) for s in seeds]


def fill_normal(buffers: Sequence[Tensor], generator: torch.Generator,
                then: Optional[Callable[[int, int], None]] = None) -> None:
    """Fill every ``(rows, n)`` tensor of ``buffers`` (same row count) with standard normal
    numbers, in place: stream ``j`` fills rows :func:`stream_rows`\\ ``[j]`` of each buffer, in
    order, then runs ``then(lo, hi)`` on those rows (row-wise work that parallelises with the
    draws). Worker threads run the streams on a CPU; elsewhere (or inside a ``torch.func``
    transform, whose state is per thread) they run one after another."""
    if not buffers:
        return
    parts = stream_rows(buffers[0].shape[0])
    gens = stream_generators(generator)

    def fill(j: int) -> None:
        lo, hi = parts[j]
        if hi > lo:
            for buf in buffers:
                buf[lo:hi].normal_(generator=gens[j])
            if then is not None:
                then(lo, hi)

    if not in_threads(generator.device):
        for j in range(STREAMS):
            fill(j)
        return
    list(_pool().map(fill, range(STREAMS)))


def in_threads(device) -> bool:
    """Whether :func:`fill_normal` runs the streams (and their ``then``) on worker threads."""
    return torch.device(device).type == "cpu" and torch.get_num_threads() >= 2 and not in_functorch_transform()


def _pool() -> ThreadPoolExecutor:
    """The worker threads, each running torch on one thread: a worker's own intra-op pool
    would put more OpenMP threads than cores on the machine, and the OpenMP runtime then stops
    spinning between parallel regions, slowing every later small operation of the process."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = min(STREAMS, max(2, torch.get_num_threads()))
            ready = threading.Barrier(workers + 1)
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gia-normal")
            main = torch.get_num_threads()
            for _ in range(workers):  # start every worker now, each holding until all are single-threaded
                _POOL.submit(_single_threaded, ready)
            ready.wait()
            torch.set_num_threads(main)  # the setting new threads inherit, as it was
        return _POOL


def _single_threaded(ready: threading.Barrier) -> None:
    torch.get_num_threads()  # torch's per-thread set-up first: it would later reset what follows
    torch.set_num_threads(1)
    ready.wait()


class Workspaces:
    """Scratch buffers reused between calls: :meth:`take` hands out the free buffer of that
    size, device and dtype (or a new one), :meth:`give` returns it; only the buffer returned
    last is kept free, so a change of model frees the old size."""

    def __init__(self) -> None:
        self._free: Dict[Tuple, Tensor] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, device, dtype: torch.dtype) -> Tensor:
        key = (int(numel), str(torch.device(device)), dtype)
        with self._lock:
            buf = self._free.pop(key, None)
        return buf if buf is not None else torch.empty(numel, device=device, dtype=dtype)

    def give(self, buf: Tensor) -> None:
        key = (buf.numel(), str(buf.device), buf.dtype)
        with self._lock:
            self._free.clear()
            self._free[key] = buf
