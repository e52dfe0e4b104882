"""Sweeps: the privacy-utility frontier of defenses across their settings.

A sweep audits a grid of defenses and settings. Every *cell* (one defense with one setting)
is a full :class:`~audit.engine.audit.Audit` with the same data, FL training, attacks, steps,
images and seed as every other cell, so cells are comparable, plus its utility (test
accuracy after defended training, over ``utility_seeds`` seeds) next to the undefended
training runs on the same seeds, shared by all cells.
The undefended cell (defense ``none``) is always audited too: the frontier's reference point.

Layout under the output folder ``OUT``::

    OUT/sweep.json, sweep.md, sweep.html, frontier.png   the sweep's report
    OUT/baseline.json                                    the shared undefended training runs
    OUT/cells/<defense>[-<k>=<v>...]/                    each cell's own audit (report.html, runs/)
    OUT/cells/<cell>/cell.json                           written when the cell's audit finished

Resuming is per cell (a cell whose ``cell.json`` matches its settings is not touched) and per
result (an unfinished cell is its audit's own resume). Cells run on an executor
(:mod:`audit.engine.executors`: ``local`` or ``ray``); each one's seeds come from the
settings, never from the order in which cells run. An executor that splits cells (``ray``)
also runs each cell's (step, attack) groups as jobs of their own: the cell's checkpoints are
trained once, then every group is the cell's audit restricted to that step and attack,
writing to the same result store (an audit's results are keyed by settings that leave the
steps and attacks out), and a last run of the whole audit finds every result and writes the
report.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from audit.core.errors import ConfigError
from audit.core.records import AccuracySpread, UtilityResult
from audit.engine.audit import UTILITY_FORMAT, Audit, undefended_identity
from audit.engine.config import AuditConfig, make_config
from audit.engine.utility import PROTOCOL
from audit.engine.compose import AuditParts, SharedParts, build_parts, build_shared
from audit.engine.executors import EXECUTORS
from audit.engine.grid import Cell, grid_cells, grid_entries, pair_options  # noqa: F401  (re-exported)
from audit.engine.identity import audited_model_identity
from audit.engine.settings import Sections, plain_dict
from audit.report.store import ResultStore, atomic_write_json, read_json, settings_key
from audit.report.sweep_report import SweepReport

UNDEFENDED = "none"
CELL_FILE = "cell.json"
BASELINE_FILE = "baseline.json"


# --------------------------------------------------------------------------- one cell
@dataclass(frozen=True)
class CellJob:
    """Everything a worker needs to audit one cell besides the sweep's :class:`SharedParts`
    (picklable: sent to Ray tasks as is): the settings, the cell's resolved defense and its
    client model (wrapped once, by the sweep)."""

    cell: Cell
    settings: Sections  # the sweep's, writing to the cell's folder
    client_model: Any
    baseline: Optional[Dict[str, Any]] = None  # the undefended cell's UtilityResult, as stored
    only: Optional[Tuple[int, str]] = None  # one (step, attack) group of the cell
    control: Optional[Tuple[Any, Any]] = None  # the undefended cell's (defense, client model): every cell's control
    config: Optional[AuditConfig] = None  # the config of this cell's audit alone


class CellAudit(Audit):
    """An audit whose utility reuses the sweep's undefended training runs instead of its own,
    and whose positive control is the sweep's undefended cell (the same audit: its results are
    computed once for every cell)."""

    baseline: Optional[Dict[str, Any]] = None  # the undefended cell's UtilityResult, as stored

    control: Optional[Tuple[Any, Any]] = None  # the undefended cell's (defense, client model), built once

    def control_out(self) -> Path:
        return Path(self.output_settings.out).parent / UNDEFENDED

    def control_parts(self) -> AuditParts:
        if self.control is None or self.is_undefended():
            return super().control_parts()
        defense, client = self.control
        return AuditParts(self.parts.shared, defense, undefended_identity(), client)

    def utility(self, baseline: Optional[AccuracySpread] = None) -> UtilityResult:
        stored = UtilityResult.from_dict(self.baseline) if self.baseline else None
        if stored is None or stored.undefended is None or stored.undefended.mean is None:
            return super().utility(baseline)
        if self.defense.name == UNDEFENDED and not self.defense.params():
            return stored  # the undefended cell *is* the baseline
        return super().utility(stored.undefended)


def _cell_audit(job: CellJob, shared: SharedParts) -> CellAudit:
    """The cell's audit on the parts built already: nothing is resolved, loaded or built again."""
    s = job.settings
    attacks, output = s.attack_settings, s.output_settings
    if job.only is not None:  # the same store; its utility is measured by the cell's last run
        attacks = replace(attacks, steps=(job.only[0],), names=(job.only[1],))
        output = replace(output, utility=False, progress=False)
    parts = AuditParts(shared, job.cell.built, job.cell.ident, job.client_model)
    audit = CellAudit(job.cell.defense, s.model, defense_args=dict(job.cell.params),
                      data_settings=s.data_settings, fl_settings=s.fl_settings, attack_settings=attacks,
                      output_settings=output, seed=s.seed, parts=parts,
                      config=job.config if job.only is None else None)
    audit.baseline, audit.control = job.baseline, job.control
    return audit


def run_cell(job: CellJob, shared: SharedParts) -> Dict[str, Any]:
    """Audit one cell (resuming its stored results) and mark it finished; runs in a worker."""
    report = _cell_audit(job, shared).run()
    done = {"key": job.cell.key, "cell": job.cell.describe(), "status": report.data["status"],
            "run_key": report.data["run_key"]}
    atomic_write_json(Path(job.settings.output_settings.out) / CELL_FILE, done)
    return done


def cell_groups(job: CellJob, shared: SharedParts) -> List[CellJob]:
    """Train the cell's checkpoints once and plan its attacks; its unfinished (step, attack)
    groups as jobs (run by :func:`run_group`)."""
    audit = _cell_audit(job, shared)
    store = ResultStore.create(job.settings.output_settings.out, audit.key_settings())
    steps = list(job.settings.attack_settings.steps)
    audit.checkpoints(store, steps)
    specs, _ = audit.planned()
    return [replace(job, only=(step, spec.name)) for step in steps for spec in specs
            if not all(store.has(step, spec.id, i, settings=spec.settings, defaults=spec.defaults)
                       for i in range(job.settings.data_settings.images))]


def run_group(job: CellJob, shared: SharedParts) -> str:
    """One (step, attack) group of a cell: the cell's audit restricted to it."""
    _cell_audit(job, shared).run()
    return f"{job.cell.name} step {job.only[0]} {job.only[1]}"


def baseline_utility(job: CellJob, shared: SharedParts) -> Dict[str, Any]:
    """The undefended cell's utility measurement: the training runs every cell is compared to."""
    return _cell_audit(job, shared).utility().to_dict()


def cell_finished(out: Path, cell: Cell) -> bool:
    path = Path(out) / "cells" / cell.name / CELL_FILE
    try:
        return path.is_file() and read_json(path).get("key") == cell.key
    except ValueError:  # unreadable: redo the cell (its audit resumes its results)
        return False


# --------------------------------------------------------------------------- the sweep
class Sweep:
    """A grid of defenses and settings, audited cell by cell on an executor; see the module
    docstring. ``step``: the audited step the frontier shows (None: each cell's worst step).
    ``executor``: ``"local"`` or ``"ray"`` (``executor_args``: its options, e.g.
    ``{"address": "auto", "cpus": 2, "gpus": 1}``)."""

    def __init__(self, grid: Any, config: AuditConfig, *, step: Optional[int] = None, executor: str = "local",
                 executor_args: Optional[Dict[str, Any]] = None):
        self.config = config
        sections = config.sections()
        self.model = sections.model
        self.data_settings, self.fl_settings = sections.data_settings, sections.fl_settings
        self.attack_settings, self.output_settings = sections.attack_settings, sections.output_settings
        attack_settings, data_settings, device = self.attack_settings, self.data_settings, config.device
        self.seed = int(config.seed)
        if step is not None and step not in attack_settings.steps:
            raise ConfigError(f"step {step} is not an audited step {list(attack_settings.steps)}; choose one of them "
                              "or leave it out for each cell's worst step")
        self.step = step
        # the device, the data set and the seeded model: built once for every cell and job
        self.shared = build_shared(self.model, data_settings, self.seed, device)
        self.device = self.shared.device
        # the built model's digests key every cell
        self.model_ident = {**self.model.describe(), **audited_model_identity(self.model, self.shared.base_model)}
        self._clients: Dict[str, Any] = {}
        self.cells = grid_cells(grid, self._common_key(), self.output_settings.defense_timeout)
        self.executor = EXECUTORS.build(executor, device=self.device, **(executor_args or {}))
        # the private images, checked now rather than in a worker
        _cell_audit(self._job(self.cells[0]), self.shared)

    @property
    def out(self) -> Path:
        return Path(self.output_settings.out)

    def _data_key(self) -> Dict[str, Any]:
        data = self.data_settings.data
        return {**plain_dict(self.data_settings), "data": data if isinstance(data, str) else getattr(data, "name", repr(data))}

    def _utility_key(self) -> Dict[str, Any]:
        return {"model": self.model_ident, "data": self._data_key(),
                "fl": plain_dict(self.fl_settings), "utility_steps": self.output_settings.utility_steps,
                "utility_seeds": self.output_settings.utility_seeds, "utility_format": UTILITY_FORMAT, "seed": self.seed,
                "device": self.device.type}

    def _common_key(self) -> Dict[str, Any]:
        return {**self._utility_key(), "attacks": plain_dict(self.attack_settings), "utility": self.output_settings.utility,
                "thresholds": self.output_settings.thresholds.to_dict(), "delta": self.output_settings.delta}

    def _job(self, cell: Cell, baseline: Optional[Dict[str, Any]] = None) -> CellJob:
        output = replace(self.output_settings, out=self.out / "cells" / cell.name,
                         progress=self.output_settings.progress and self.executor.shows_job_progress)
        if cell.name not in self._clients:  # the cell's client model, wrapped once
            self._clients[cell.name] = build_parts(self.shared, cell.built, cell.defense, self.seed, cell.ident).model
        client = self._clients[cell.name]
        undefended = next(c for c in self.cells if c.undefended)
        control = (undefended.built, client if cell is undefended else self._job(undefended).client_model)
        return CellJob(cell, replace(self.config.sections(), output_settings=output), client, baseline,
                       control=control, config=self.cell_config(cell))

    def cell_config(self, cell: Cell) -> AuditConfig:
        """The config that audits ``cell`` alone (its ``config.toml`` replays it)."""
        return replace(self.config, defense=cell.defense, defense_args=dict(cell.params) or None,
                       out=str(self.out / "cells" / cell.name))

    def _baseline(self) -> Optional[Dict[str, Any]]:
        """The undefended training run, stored in ``baseline.json`` (measured once per settings)."""
        if not self.output_settings.utility:
            return None
        key = settings_key(self._utility_key())
        path = self.out / BASELINE_FILE
        if path.is_file() and read_json(path).get("key") == key:
            return read_json(path)["utility"]
        found: List[Dict[str, Any]] = []
        self.executor.map(baseline_utility, [self._job(self.cells[0])], lambda _, result: found.append(result),
                          self.shared)
        atomic_write_json(path, {"key": key, "utility": found[0]})
        return found[0]

    def settings(self) -> Dict[str, Any]:
        return {"model": self.model_ident, "data": self._data_key(),
                "fl": plain_dict(self.fl_settings), "attacks": plain_dict(self.attack_settings), "utility": self.output_settings.utility,
                "utility_steps": self.output_settings.utility_steps, "utility_seeds": self.output_settings.utility_seeds,
                "utility_recipe": PROTOCOL.recipe_key(), "seed": self.seed, "device": self.device.type,
                "executor": self.executor.name}

    def run(self) -> SweepReport:
        """Audit every unfinished cell, then write ``sweep.json``, ``sweep.md``, ``sweep.html``."""
        started = time.perf_counter()
        pending = [c for c in self.cells if not cell_finished(self.out, c)]
        computed: List[str] = []
        groups = 0
        bar = _progress(len(self.cells), len(self.cells) - len(pending), self.output_settings.progress)
        try:
            if pending:
                baseline = self._baseline()
                jobs = [self._job(c, baseline) for c in pending]
                if self.executor.splits_cells:
                    groups = self._run_groups(jobs, bar)

                def done(index: int, _result: Any) -> None:
                    computed.append(pending[index].name)
                    bar.set_postfix_str(f"finished {pending[index].name}")
                    bar.update(1)

                self.executor.map(run_cell, jobs, done, self.shared)
        finally:
            bar.close()
            self.executor.close()
        report = SweepReport.from_cells(self.out, [c.describe() for c in self.cells], settings=self.settings(),
                                        thresholds=self.output_settings.thresholds.to_dict(), step=self.step,
                                        invocation={"computed": computed, "group_jobs": groups,
                                                    "reused": [c.name for c in self.cells if c.name not in computed],
                                                    "seconds": round(time.perf_counter() - started, 1)})
        report.write(self.out)
        return report


    def _run_groups(self, jobs: Sequence[CellJob], bar) -> int:
        """Every pending (step, attack) group of the ``jobs``' cells as a job of its own; how many."""
        groups: List[CellJob] = []
        self.executor.map(cell_groups, jobs, lambda _, found: groups.extend(found), self.shared)
        finished = [0]

        def done(_index: int, label: str) -> None:
            finished[0] += 1
            bar.set_postfix_str(f"(step, attack) groups {finished[0]}/{len(groups)}: {label}")

        self.executor.map(run_group, groups, done, self.shared)
        return len(groups)


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="sweep (cells)", unit="cell", position=0,
                disable=not enabled, dynamic_ncols=True)


# --------------------------------------------------------------------------- public entry point
def sweep(grid: Any, out: Union[str, Path, None] = None, *, config: Optional[AuditConfig] = None,
          step: Optional[int] = None, executor: str = "local", executor_args: Optional[Dict[str, Any]] = None,
          **fields: Any) -> SweepReport:
    """Audit a grid of defenses and settings; the privacy-utility frontier as a report.

    ``grid``: ``{"prune": {"ratio": [0.5, 0.9]}, "gaussian": {"sigma": [0.01, 0.1]}, "censor": {}}``,
    or a list of defenses and ``(defense, {param: values})`` pairs; a defense may be a name,
    ``"pkg.mod:attr"``, a Defense class (gridded over its parameters) or any defended-gradient
    callable (one cell). ``config`` (:class:`~audit.engine.config.AuditConfig`, ``fields`` over
    it): the settings every cell shares (its defense aside); ``out``: the sweep's folder
    (default: the config's ``out``), each cell's audit under ``out/cells``. ``step``: the
    frontier's audited step (default: each cell's worst step). ``executor``: ``"local"`` or
    ``"ray"`` (``executor_args``: ``address``, ``num_cpus``, ``cpus`` and ``gpus`` per task; see
    :mod:`audit.engine.executors`). Rerunning resumes: finished cells and results are reused.
    """
    for name in ("defense", "defense_args"):
        if name in fields:
            raise ConfigError(f"a sweep takes its defenses from the grid, not {name}=; put them in the grid")
    config = make_config(config, **fields)
    config = config.replace(out=str(config.out if out is None else out))
    return Sweep(grid, config, step=step, executor=executor, executor_args=executor_args).run()
