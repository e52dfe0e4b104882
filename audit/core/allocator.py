"""Keep freed heap memory in the process (glibc's malloc, on Linux).

torch takes its CPU tensors from malloc. By default glibc maps each block above a moving
threshold fresh from the kernel and returns it on free, so every step of an optimisation
attack faults its activations in again, page by page. An 8-image ig audit of ResNet-18 on 2
cores took 93 s with 22M page faults and 54 s of system time; with the heap kept, 66 s, 5.7M
and 16 s (``python -m bench.bench_allocator``, docs/device.md).
``GIA_AUDIT_KEEP_MEMORY=0`` leaves glibc's defaults.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

#: the environment variable that turns it off (``0``)
OPT_OUT = "GIA_AUDIT_KEEP_MEMORY"
#: mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
#: the largest mmap threshold glibc accepts on 64-bit: blocks below it come from the heap
MMAP_THRESHOLD = 32 * 2**20
#: free memory at the heap's top that is kept, not trimmed back to the kernel
TRIM_THRESHOLD = 2**31 - 1
#: extra heap asked for each time it grows
TOP_PAD = 512 * 2**20


@functools.lru_cache(maxsize=None)
def keep_freed_memory() -> bool:
    """Tell glibc to keep freed blocks for reuse; False where turned off or not glibc. Once a
    process: the CLI and ``audit.run`` both call it, and the setting is the process's."""
    if os.environ.get(OPT_OUT) == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = _libc()
        mallopt = libc.mallopt
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    except (OSError, AttributeError):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all(mallopt(param, value) == 1 for param, value in settings)


def _libc() -> ctypes.CDLL:
    """glibc by its soname; only elsewhere the search (``find_library`` runs ldconfig, slow at start-up)."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return ctypes.CDLL(ctypes.util.find_library("c"))
