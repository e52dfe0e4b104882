"""The GPU plan: the gpu profile's slices left (:func:`gpu_slices`), their planned minutes and
the lent calls they need, and how one call runs them (:data:`GPU_CALL`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from bench.papers.cells import Profile, run_setting, stored_cells
from bench.papers.run import open_passes
from bench.papers.slices import (GPU_MS, GPU_SLICE_MINUTES, CallOver, Deadline, GpuSlice,
                                 cell_calls, left_text)
from bench.papers.spec import Row
from bench.papers.stale import PlanCache
from bench.papers.store import kept_for, partial_dir, results_path


def gpu_slices(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
               out: Path, retry: bool = False) -> List[GpuSlice]:
    """The slices the row has left, in the order :func:`run_row` runs them: the slices of its
    cells' calls (:func:`cell_calls`, sliced as ``profile`` slices them) that attack something no
    kept result covers, each once."""
    stored, _, plans = stored_cells(row, profile, data, data_args, root, out)
    path = results_path(root, profile.name, data, row)
    found: List[GpuSlice] = []
    cache = PlanCache(path.parent)
    for plan, claim_only, until_step in open_passes(row, stored, plans, run_setting(row, profile), retry, cache):
        kept = kept_for(partial_dir(path, plan.name), plan, cache)
        found += [c.work for c in cell_calls(row, plan, kept, claim_only, until_step=until_step)
                  if c.work and c.work not in found]
    return found


def slices_left(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                out: Path, retry: bool = False) -> List[GpuSlice]:
    """Every row's slices left (:func:`gpu_slices`), row by row."""
    return [s for row in rows for s in gpu_slices(row, profile, data, data_args, root, out, retry)]


def gpu_plan(slices: Sequence[GpuSlice]) -> str:
    """The GPU slices left, row by row, with their planned minutes, the total and the calls."""
    return "\n".join([s.text() for s in slices] + [
        f"slices: {left_text(slices)} (each call runs {GPU_SLICE_MINUTES:g} planned minutes of slices; "
        f"unmeasured: the plan counts {GPU_MS['resnet18']} ms per image-iteration on ResNet-18)"])


def plan_table(slices: Sequence[GpuSlice]) -> str:
    """The GPU plan as the page shows it: each row's slices left and their planned minutes, and
    the calls they need in all."""
    rows: Dict[str, List[GpuSlice]] = {}
    for s in slices:
        rows.setdefault(s.row, []).append(s)
    lines = ["| row | cells | slices left | planned GPU minutes |", "|---|---|---|---|"]
    lines += [f"| {row} | {', '.join(dict.fromkeys(s.cell for s in mine))} | {len(mine)} | "
              f"{sum(s.minutes for s in mine):.1f} |" for row, mine in rows.items()]
    return "\n".join(lines + ["", f"Slices: {left_text(slices)}; each call runs {GPU_SLICE_MINUTES:g} planned "
                                  f"minutes of slices. Unmeasured: the plan counts {GPU_MS['resnet18']} ms per "
                                  "image-iteration on ResNet-18. `--plan` lists every slice."])


def call_summary(deadline: Deadline, over: Optional[CallOver], left: Sequence[GpuSlice]) -> str:
    """What one invocation under a deadline ran, why it stopped, and what is left."""
    stop = f"; stopped before {over}" if over else ""
    return (f"{len(deadline.ran)} slices run in {deadline.used():.1f} of {deadline.minutes:g} minutes{stop}; "
            f"{left_text(left)}")


#: how a lent GPU call runs the gpu profile, with its command (``--help`` prints it)
GPU_CALL = """\
A lent GPU call (at most 9 minutes; only what it writes under ``$OUT`` comes back) runs the gpu
profile's slices (:func:`gpu_slices`: a step and as many images as fit
:data:`GPU_SLICE_MINUTES` at :data:`GPU_MS`) in order, starting each only while its planned
minutes fit what is left of ``--call-minutes``; each finished slice's results are in
``--results`` before the next starts, and a kept slice is never run again. ``--plan`` lists
the slices left, their minutes and the calls they need. Seed ``$OUT`` with the committed
store and the gpu profile's cells under way, and run (the machine needs the LPIPS weights,
``make weights``)::

    mkdir -p $OUT/papers-gpu && cp -r bench/results/papers/results.jsonl bench/results/papers/gpu-embedded $OUT/papers-gpu/ 2>/dev/null; python -m bench.papers --profile gpu --call-minutes 8 --results $OUT/papers-gpu

then replace the committed store and folder by what came back (``R``: where ``$OUT``'s files
landed; the store came back with the lines the call appended) and commit them::

    cp R/papers-gpu/results.jsonl bench/results/papers/ && rm -rf bench/results/papers/gpu-embedded
    cp -r R/papers-gpu/gpu-embedded bench/results/papers/ 2>/dev/null
    git add bench/results/papers && git commit -m "papers bench: gpu slices"

``python -m bench.papers --profile gpu --render --docs papers-gpu`` then writes the page.
"""


def gpu_call_help() -> str:
    """:data:`GPU_CALL`, for ``--help``."""
    return GPU_CALL.strip()
