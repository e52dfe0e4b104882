"""``torch.compile`` with inductor's on-disk kernel cache kept apart per CPU kernel set.

Inductor reuses generated C++ from its cache without keying it by the kernel set the process runs
(``ATEN_CPU_CAPABILITY``): code generated with vector instructions under AVX2 or AVX-512 is then
built for the generic set, and the build fails (``at::vec`` undeclared). Keeping one cache folder
per kernel set makes a compiled attack build on any CPU, whatever ran before it.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

ENV = "TORCHINDUCTOR_CACHE_DIR"
#: the user's own cache folder, if set before this module was imported (inductor itself sets the
#: variable to its default the first time anything asks for its cache, so it is read here, early)
USERS = os.environ.get(ENV)


def kernel_cache() -> str:
    """The cache folder inductor uses from now on: the user's ``TORCHINDUCTOR_CACHE_DIR`` where set,
    else inductor's default folder with the kernel set's name below it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = os.path.abspath(default_cache_dir())
    if USERS is None or os.path.abspath(USERS) == default:
        os.environ[ENV] = os.path.join(default, torch.backends.cpu.get_cpu_capability().lower())
    return os.environ[ENV]


def compiled(fn: Callable, **options: Any) -> Callable:
    """``torch.compile(fn, **options)``, its kernels cached under :func:`kernel_cache`."""
    kernel_cache()
    return torch.compile(fn, **options)
