import os
from collections import OrderedDict

import pytest
import torch

from audit.core.allocator import keep_freed_memory
import adaptive  # noqa: F401  (registers the adaptive attacks in attacks.ATTACKS for every test module)

# Under pytest-xdist each worker gets one thread: two workers with torch's default thread
# count oversubscribe a 2-core machine badly (GAN training ran ~30x slower).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
keep_freed_memory()  # as the CLI does: attack steps reuse freed memory, not fault it in again


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-model tests (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): more only contend on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_programs(monkeypatch):
    """Captured programs, failures and counters of the test's own (attacks.capture)."""
    from attacks import capture

    monkeypatch.setattr(capture, "PROGRAMS", OrderedDict())
    monkeypatch.setattr(capture, "FAILED", {})
    monkeypatch.setattr(capture, "STATS", dict.fromkeys(capture.STATS, 0))
