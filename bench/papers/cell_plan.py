"""What the papers bench runs, below the modules that plan, store and search it: a profile
(:class:`Profile`) and one cell's ``audit.run`` call with its key (:class:`CellPlan`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass
class Profile:
    """``tiny``: the profile's rows and models at the quick check's budgets, images and steps
    (the gpu profile's plumbing checked on a CPU); its cells never reach the page."""
    name: str
    images: Optional[int] = None  # overrides every row's image count (the quick check's 2)
    device: str = "cpu"
    tiny: bool = False

    @property
    def shrunk(self) -> bool:
        return self.name == "quick" or self.tiny


@dataclass
class CellPlan:
    """One cell: its name (``paper:<attack>``, ``adaptive``, ``planner``, ``utility``), the
    ``audit.run`` call that makes it and the steps it is judged at; ``gpu``: it runs in slices
    sized for a GPU call (:func:`slice_evaluations`), not for a CPU sitting."""

    name: str
    call: Dict[str, Any]
    steps: List[int]
    gpu: bool = False

    @property
    def key(self) -> str:
        return cell_key(self.call)


def cell_key(call: Dict[str, Any]) -> str:
    """The key of an ``audit.run`` call: every setting that changes its numbers (not where it
    writes or whether it shows progress; the utility's recipe only when it measures utility)."""
    from audit.report.store import settings_key

    ignored = {"out", "progress"} | (set() if call.get("utility") else {"utility_steps", "utility_seeds"})
    return settings_key({k: v for k, v in call.items() if k not in ignored}, 16)
