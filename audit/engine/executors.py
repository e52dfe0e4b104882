"""Where a sweep's work runs: a small registry of executors.

An executor maps a picklable module-level function ``fn(job, shared)`` over picklable jobs
and reports each result as it finishes (``done(index, result)``), in any order; ``shared``
(the data set and models every job uses) is sent once, not with each job. Jobs carry their
own seeds and write their own results to disk, so the numbers do not depend on the executor
or the order in which jobs finish.

* ``local``: one job after another in this process (no extra dependency);
* ``ray``: one Ray task per job with CPU / GPU resource requests, on a local Ray instance or
  an existing cluster (``address``); ``pip install "gia-audit[ray]"``. On a cluster, every
  node needs this package installed and the output folder on a shared file system.

``splits_cells``: whether a sweep also hands the executor each cell's (step, attack) groups
as jobs of their own (worth it only where jobs run in parallel).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from audit.core.errors import ConfigError
from audit.core.registry import Registry

EXECUTORS = Registry("executor")

Done = Callable[[int, Any], None]


@EXECUTORS.register("local", "one job after another in this process (no extra dependency)")
class LocalExecutor:
    """Runs jobs in order, in this process; shows each job's own progress bar."""

    name = "local"
    shows_job_progress = True
    splits_cells = False  # one process: the audit groups its work itself

    def __init__(self, device: Any = None):
        self.device = device

    def map(self, fn: Callable[[Any, Any], Any], jobs: Sequence[Any], done: Done, shared: Any = None) -> None:
        for index, job in enumerate(jobs):
            done(index, fn(job, shared))

    def close(self) -> None:
        pass


@EXECUTORS.register("ray", "Ray tasks on a local Ray instance or a cluster (pip install 'gia-audit[ray]')")
class RayExecutor:
    """Every job is a Ray task requesting ``cpus`` CPUs and ``gpus`` GPUs (default: 1 when
    the audit's ``device`` is CUDA, else 0).

    ``address``: an existing cluster (``"auto"``, ``"ray://head:10001"``); ``None`` starts a
    local instance with ``num_cpus`` CPUs (default: all) that is shut down again by
    :meth:`close`. An already initialised Ray (``ray.init`` by the caller) is used as is.
    ``groups``: a sweep's (step, attack) groups of a cell run as tasks of their own too.
    ``threads``: intra-op torch threads of each task (default: this process's count, so that a
    task's numbers equal a local run's: float sums, and with them the ties a magnitude pruning
    breaks, depend on the count; docs/performance.md).
    """

    name = "ray"
    shows_job_progress = False  # the workers' bars would interleave in the driver's terminal

    def __init__(self, address: Optional[str] = None, num_cpus: Optional[int] = None, cpus: float = 1,
                 gpus: Optional[float] = None, groups: bool = True, device: Any = None,
                 threads: Optional[int] = None):
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("the ray executor needs Ray: pip install 'gia-audit[ray]' (or use --executor local)") from None
        if gpus is None:
            gpus = 1 if getattr(device, "type", str(device)).startswith("cuda") else 0
        for label, value in (("cpus per task", cpus), ("gpus per task", gpus)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"ray executor: {label} must be a number >= 0, got {value!r}")
        if num_cpus is not None and (not isinstance(num_cpus, int) or num_cpus < 1):
            raise ConfigError(f"ray executor: num_cpus (the local instance's CPUs) must be an integer >= 1, got {num_cpus!r}")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"ray executor: threads per task must be an integer >= 1, got {threads!r}")
        self.address, self.num_cpus, self.cpus, self.gpus, self.threads = address, num_cpus, cpus, gpus, threads
        self.splits_cells = bool(groups)
        self._started = False

    def _ray(self):
        import ray

        if not ray.is_initialized():
            local = {} if self.address else {"num_cpus": self.num_cpus, "include_dashboard": False}
            ray.init(address=self.address, log_to_driver=True, **local)
            self._started = True
        return ray

    def map(self, fn: Callable[[Any, Any], Any], jobs: Sequence[Any], done: Done, shared: Any = None) -> None:
        if not jobs:
            return
        ray = self._ray()
        task = ray.remote(_with_threads).options(num_cpus=self.cpus, num_gpus=self.gpus)
        import torch

        threads = self.threads or torch.get_num_threads()
        common = ray.put(shared)  # in the object store once; each task receives the value
        pending = {task.remote(fn, threads, job, common): index for index, job in enumerate(jobs)}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    done(pending.pop(ref), ray.get(ref))
        finally:
            for ref in pending:  # an error or Ctrl-C: finished results are on disk already
                ray.cancel(ref)

    def close(self) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started = False


def _with_threads(fn: Callable[[Any, Any], Any], threads: int, job: Any, shared: Any) -> Any:
    """``fn(job, shared)`` with ``threads`` intra-op torch threads: a Ray worker's own count
    depends on how Ray started it, and float reductions depend on the count (the same count
    as a local run gives the same numbers)."""
    import torch

    torch.set_num_threads(threads)
    return fn(job, shared)
