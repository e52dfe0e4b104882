"""How a cell runs: in slices of a step and a few images (:func:`cell_slices`), each an audit
call that adds to the cell's engine run, sized by its gradient evaluations on a CPU or its
planned minutes on a GPU (:data:`GPU_MS`); and the deadline of one invocation."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Optional, Sequence, Set, Tuple

if TYPE_CHECKING:
    from bench.papers.cells import CellPlan
    from bench.papers.spec import Row

#: image-evaluations per slice of a cell: a cell runs one step and a few images at a time
#: (the engine's key leaves steps and the image count out, so each slice adds to the same
#: run), and each slice's results are copied into the repository as it finishes, so a cell
#: longer than a sitting accumulates; a slice is 15-30 minutes on one core for the slowest rows
SLICE_EVALUATIONS = 4000
#: attacks an ``auto`` call is sized as (the planner's base attacks and picks: six on ATS), for
#: slicing alone: slices never change a number
PLANNER_ATTACKS = 6


def image_evaluations(call: Dict[str, Any]) -> int:
    """What one image of the cell's audit call costs in gradient evaluations: every attack of the
    call its budget (``auto``: :data:`PLANNER_ATTACKS` of them), twice for a defended call, whose
    positive control runs the same attacks' base forms on the same images at the same budget."""
    named = call.get("attacks") or ()
    attacks = max(1, len([a for a in named if a != "auto"]) + PLANNER_ATTACKS * ("auto" in named))
    runs = 1 if call.get("defense") in (None, "none") else 2  # an undefended audit is its own control
    return runs * attacks * max(1, int(call["budget"] or 1))


def cell_slices(call: Dict[str, Any], claim: Sequence[int] = (),
                evaluations: Optional[float] = None) -> List[Tuple[List[int], int]]:
    """The (steps, images) of each slice of the cell's audit call, then the whole call: as many
    images a slice as ``evaluations`` (default :data:`SLICE_EVALUATIONS`) pays for at
    :func:`image_evaluations` each. With several steps each step runs all its images in slices,
    so the whole call only gathers them (no slice spans steps). The steps of a claim (``claim``:
    some of the call's steps) run first and are gathered on their own, so the claim is judged
    before the other steps finish."""
    images, steps = int(call["images"]), list(call["steps"])
    per = max(1, int((SLICE_EVALUATIONS if evaluations is None else evaluations) // image_evaluations(call)))
    if call.get("utility") or (per >= images and len(steps) == 1):
        return [(steps, images)]
    counts = list(range(per, images, per)) + ([images] if len(steps) > 1 else [])
    first = [s for s in steps if s in claim]
    if not first or len(first) == len(steps):
        return [([step], n) for step in steps for n in counts] + [(steps, images)]
    rest = [s for s in steps if s not in first]
    return ([([step], n) for step in first for n in counts] + [(first, images)]
            + [([step], n) for step in rest for n in counts] + [(steps, images)])


def claim_of(row: Row, plan: "CellPlan") -> List[int]:
    """The steps of the row's claim that the cell runs, where they are some of its steps (the
    cell's evidence there is judged as soon as it is complete); [] otherwise."""
    claim = [s for s in plan.call["steps"] if s in (row.claim_steps or ())]
    return claim if 0 < len(claim) < len(plan.call["steps"]) else []


@dataclass(frozen=True)
class CellCall:
    """One audit call of a cell (:func:`cell_slices`): its steps and image count; ``work``: the
    slice of images it attacks that no kept result covers (None: it attacks nothing new);
    ``claim``: it completes the steps of the row's claim; ``whole``: the cell's last call;
    ``step``: of a row judged step by step, the claim's step whose images it completes and whose
    evidence is not stored yet (its report is read and kept, :func:`step_record`)."""

    steps: List[int]
    images: int
    work: Optional["GpuSlice"]
    claim: bool
    whole: bool
    step: Optional[int] = None

    @property
    def needed(self) -> bool:
        """Whether the call must run: it attacks something, or its report is read."""
        return self.work is not None or self.claim or self.whole or self.step is not None


def cell_calls(row: Row, plan: CellPlan, kept: Set[Tuple[int, int]] = frozenset(),
               claim_only: bool = False, stepped: Collection[int] = (),
               until_step: Optional[int] = None) -> List[CellCall]:
    """The cell's audit calls in order, each with the slice of new work it does given the
    image-steps ``kept`` (each call of one step attacks the images after its step's previous
    call, up to its count); ``claim_only``: up to the call that completes the claim's steps;
    ``until_step``: that step's calls alone (the others' images wait for their own step's
    pass or the cell's whole pass). A row judged step by step reads each claim step's
    evidence as its images complete, where it is not stored already (``stepped``)."""
    claim, total = claim_of(row, plan), int(plan.call["images"])
    slices = cell_slices(plan.call, claim, slice_evaluations(plan))
    per_image, covered, calls = image_minutes(plan.call), {}, []
    for i, (steps, images) in enumerate(slices):
        work = None
        if len(steps) == 1:
            first = covered.get(steps[0], 0)
            new = sum((steps[0], image) not in kept for image in range(first, images))
            if new:
                work = GpuSlice(row.id, plan.name, steps[0], first, images - first, new * per_image)
            covered[steps[0]] = max(first, images)
        completes = bool(claim) and steps == claim and images == total
        step = steps[0] if (row.per_step and len(steps) == 1 and images == total and steps[0] in row.claim_steps
                            and steps[0] not in stepped) else None
        calls.append(CellCall(steps, images, work, completes, i == len(slices) - 1, step))
        if completes and claim_only:
            break
    return calls if until_step is None else [c for c in calls if c.steps == [until_step]]


class CallOver(Exception):
    """A slice's planned minutes do not fit what is left of the invocation's deadline."""

    def __init__(self, work: "GpuSlice", left: float):
        super().__init__(f"{work.text()}: {max(0.0, left):.1f} minutes left")
        self.work, self.left = work, left


@dataclass
class Deadline:
    """The minutes one invocation may run slices for (``--call-minutes``), by the wall clock
    from when it is set: a slice starts only while its planned minutes fit what is left, so a
    call never loses a slice it started; ``ran``: the slices finished, in order."""

    minutes: float
    clock: Callable[[], float] = time.monotonic
    ran: List["GpuSlice"] = field(default_factory=list)
    started: float = field(init=False)
    began: float = field(init=False)  # when the slice under way started

    def __post_init__(self) -> None:
        self.started = self.began = self.clock()

    def used(self) -> float:
        """Minutes since the deadline was set."""
        return (self.clock() - self.started) / 60

    def admit(self, work: Optional["GpuSlice"]) -> None:
        """Start ``work`` (None: a call that attacks nothing new), or raise :class:`CallOver`."""
        left = self.minutes - self.used()
        if work is not None and work.minutes > left:
            raise CallOver(work, left)
        self.began = self.clock()

    def finished(self, work: Optional["GpuSlice"]) -> None:
        """Count ``work`` as run, and say how long it took beside its plan (:data:`GPU_MS`)."""
        if work is not None:
            self.ran.append(work)
            print(f"    slice {work.text()}; took {(self.clock() - self.began) / 60:.1f} min", flush=True)


#: ms per image per gradient evaluation of IG on an H100 (``docs/gpu-turn.md``: the audit's grouped
#: iteration captured in a CUDA graph, 8 images, measured beside its floor): the gpu profile's
#: planning figure, not a measurement of these rows (a run of many images or iterations compiles
#: its program and is faster: 0.84 ms at 32 images on ResNet-18)
#: (``convnet9``: the ResNet-18 figure x 3.45, its forward FLOPs over a width-64 ResNet-18's at
#: 32x32; ``lenet``: the ``cnn`` figure, a model of a tenth of its FLOPs whose iteration is
#: bound by kernel launches, which the captured graph removes)
GPU_MS = {"resnet18": 2.75, "cnn": 0.158, "convnet9": 2.75 * 3.45, "lenet": 0.158}
#: the minutes of one lent GPU call: its command's wall-clock limit
GPU_CALL_MINUTES = 9.0
#: the planned minutes of one GPU slice at most: a call less a minute for seeding ``$OUT`` and
#: copying it back (the one-call command's ``--call-minutes 8``) and a minute for the process's
#: start (imports, LPIPS weights, restoring the kept results, a row's model health), so that every
#: call starts at least one slice and finishes it
GPU_SLICE_MINUTES = 7.0


def gpu_ms(model: str) -> float:
    """:data:`GPU_MS` of ``model`` (an unlisted model is planned as ResNet-18)."""
    return GPU_MS.get(model, GPU_MS["resnet18"])


def image_minutes(call: Dict[str, Any]) -> float:
    """Planned GPU minutes of one image of the cell's audit call (:func:`image_evaluations` at
    :data:`GPU_MS`; the defense's own cost inside adaptive attacks and the planner's probe are
    not counted: unmeasured)."""
    return image_evaluations(call) * gpu_ms(call["model"]) / 60000


def slice_evaluations(plan: CellPlan) -> float:
    """The gradient evaluations one slice of the cell pays for (:func:`cell_slices`): on the gpu
    profile, :data:`GPU_SLICE_MINUTES` at :data:`GPU_MS`; else :data:`SLICE_EVALUATIONS`."""
    return GPU_SLICE_MINUTES * 60000 / gpu_ms(plan.call["model"]) if plan.gpu else SLICE_EVALUATIONS


@dataclass(frozen=True)
class GpuSlice:
    """One slice of a cell: a step and a range of its images, with its planned GPU minutes (of
    the images no kept result covers)."""

    row: str
    cell: str
    step: int
    first: int
    images: int
    minutes: float

    def text(self) -> str:
        fits = "" if self.minutes <= GPU_SLICE_MINUTES else \
            f" (over a call's {GPU_SLICE_MINUTES:g} planned minutes: one image-step; no call starts it)"
        return (f"{self.row} {self.cell} step {self.step} images {self.first}-{self.first + self.images - 1}: "
                f"{self.minutes:.1f} min{fits}")


def calls_needed(slices: Sequence[GpuSlice], minutes: float = GPU_SLICE_MINUTES) -> int:
    """How many calls run ``slices`` in order when each starts slices while their planned
    minutes fit its ``minutes`` (one slice at least)."""
    calls, left = 0, 0.0
    for s in slices:
        if not calls or s.minutes > left:
            calls, left = calls + 1, minutes
        left -= s.minutes
    return calls


def left_text(slices: Sequence[GpuSlice]) -> str:
    """The slices left in words: how many, their planned minutes and the calls they need."""
    return (f"{len(slices)} left, ~{sum(s.minutes for s in slices):.0f} planned minutes in "
            f"{calls_needed(slices)} {GPU_CALL_MINUTES:g}-minute calls")
