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
for k in range(200):
    # each block a little larger than the last: by default above glibc's threshold (which rises to
    # the last block freed), so mapped fresh; kept, it grows the heap's top by the difference only
    y = torch.ones(2**18 + k * 2**14)  # 1 MiB + k * 64 KiB
    del y
print(json.dumps({"kept": kept, "faults": faults() - start}))
"""


def _faults(opt_out: bool) -> dict:
    env = dict(os.environ, GIA_AUDIT_KEEP_MEMORY="0" if opt_out else "1")
    out = subprocess.run([sys.executable, "-c", LOOP], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="checks the kept heap, set through glibc's mallopt: runs on Linux only")
def test_kept_heap_stops_refaulting_freed_tensors():
    default, kept = _faults(opt_out=True), _faults(opt_out=False)
    assert default["kept"] is False and kept["kept"] is True
    # 200 fresh maps of 1-13 MiB fault ~370k pages by default; the kept heap reuses one block
    assert default["faults"] > 50_000
    assert kept["faults"] < default["faults"] / 20
