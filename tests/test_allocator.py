"""The kept heap: a loop that allocates and frees activation-sized tensors stops faulting
their pages in again once ``keep_freed_memory`` is on (each case in a fresh process, since the
setting is process-wide)."""
import json
import os
import subprocess
import sys

import pytest

LOOP = """
import json, resource, sys, torch
from audit.core.allocator import keep_freed_memory
kept = keep_freed_memory()
x = torch.ones(256, 1024)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
start = faults()
for _ in range(200):
    y = torch.ones(1024, 1024) * 2.0  # 4 MiB, above glibc's initial mmap threshold
    del y
print(json.dumps({"kept": kept, "faults": faults() - start}))
"""


def _faults(opt_out: bool) -> dict:
    env = dict(os.environ, GIA_AUDIT_KEEP_MEMORY="0" if opt_out else "1")
    out = subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's, on Linux")
def test_kept_heap_stops_refaulting_freed_tensors():
    default, kept = _faults(opt_out=True), _faults(opt_out=False)
    assert default["kept"] is False and kept["kept"] is True
    # 200 x 4 MiB fresh maps fault ~200k pages by default; the kept heap reuses one block
    assert default["faults"] > 50_000
    assert kept["faults"] < default["faults"] / 20
