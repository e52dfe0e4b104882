"""The sweep's report as one typed record: what ``sweep.json`` holds and every format renders.

:func:`audit.report.sweep_report.build_sweep` makes it from the cells' audit reports; the
formats (:mod:`audit.report.formats`) render it; ``Sweep.from_dict`` reads a stored
``sweep.json`` back. Each record's JSON is the flat object of its fields (keys it does not know
kept in ``extra``), and it reads as a mapping of that object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from audit.core.manifest import MappingRecord


@dataclass(frozen=True, eq=False)  # equal as mappings: the same JSON object
class SweepCell(MappingRecord):
    """One cell's row: the cell (``name``, ``defense`` family, ``params``, ``setting``,
    ``undefended``, its folder ``dir``); its audit at the chosen step (``status``, worst-case
    ``psnr`` and ``ssim``, the ``step``, the ``verdict`` label); its utility (the mean test
    ``accuracy`` over ``seeds`` with its spread and words, runs that ``diverged``, the undefended
    mean, the ratio ``relative``, ``utility_note`` when missing); its ``report`` (relative to the
    sweep's folder) and whether it is ``pareto``-optimal."""

    name: str = ""
    defense: str = ""
    params: Dict[str, Any] = field(default_factory=dict)
    setting: str = ""
    undefended: bool = False
    dir: str = ""
    status: str = "pending"
    psnr: Optional[float] = None
    ssim: Optional[float] = None
    step: Optional[int] = None
    verdict: Optional[str] = None
    accuracy: Optional[float] = None
    accuracies: List[float] = field(default_factory=list)
    accuracy_std: Optional[float] = None
    accuracy_min: Optional[float] = None
    accuracy_max: Optional[float] = None
    accuracy_text: str = ""
    seeds: int = 0
    diverged: str = ""
    diverged_runs: int = 0
    baseline_accuracy: Optional[float] = None
    relative: Optional[float] = None
    utility_note: str = ""
    report: str = ""
    pareto: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)
    keeps_none = True

    @property
    def point(self) -> Tuple[Optional[float], Optional[float], List[float]]:
        """``(psnr, accuracy, per-seed accuracies)``: the cell on the frontier."""
        return self.psnr, self.accuracy, self.accuracies


@dataclass(frozen=True, eq=False)
class Sweep(MappingRecord):
    """Every number of one sweep's report: ``title``, ``generated``, the ``step`` compared
    ("worst": each cell's worst step), ``progress`` (cells done of all), the ``defenses``, the
    ``undefended`` cell's numbers, the ``dominance_rule`` and the ``pareto``-optimal cells'
    names, the leak rule's ``thresholds``, the ``settings`` every cell shares, what this
    invocation did (``invocation``) and one :class:`SweepCell` per cell (``cells``)."""

    title: str = ""
    generated: str = ""
    step: Any = "worst"
    progress: Dict[str, int] = field(default_factory=dict)
    defenses: List[str] = field(default_factory=list)
    undefended: Optional[Dict[str, Any]] = None
    dominance_rule: str = ""
    pareto: List[str] = field(default_factory=list)
    thresholds: Dict[str, Any] = field(default_factory=dict)
    settings: Dict[str, Any] = field(default_factory=dict)
    invocation: Dict[str, Any] = field(default_factory=dict)
    cells: List[SweepCell] = field(default_factory=list)
    extra: Dict[str, Any] = field(default_factory=dict)
    keeps_none = True

    def __post_init__(self):
        object.__setattr__(self, "cells", [SweepCell.from_dict(c) for c in self.cells])

    def cell(self, name: str) -> SweepCell:
        """The cell ``name`` (KeyError naming the cells)."""
        for row in self.cells:
            if row.name == name:
                return row
        raise KeyError(f"no cell {name!r}; cells: {', '.join(r.name for r in self.cells)}")
