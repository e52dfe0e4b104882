"""The schedule of an audit: which (step, attack, image) results are still pending, grouped
as (step, attack) groups; the observations of a step; storing each group's results as one unit
and moving the progress bar (image-iterations) as the groups run. It runs on the audit as
built (:class:`~audit.engine.built.BuiltRun`) and the model states the audit hands it; a set
``cancel`` event stops it at its next progress report (:class:`Cancelled`)."""
from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.errors import GiaError
from audit.core.records import Status
from audit.engine import runner
from audit.engine.built import BuiltRun
from audit.report.store import ResultStore


class Cancelled(BaseException):
    """The audit was given up (its ``cancel`` event is set): raised through the attacks' error handling."""


def check_cancel(cancel: Optional[threading.Event]) -> None:
    """Raise :class:`Cancelled` once ``cancel`` (None: never) is set."""
    if cancel is not None and cancel.is_set():
        raise Cancelled()


def pending(run: BuiltRun, store: ResultStore, specs: Sequence[Any]) -> List[Tuple[int, int, Any]]:
    """Every ``(step, image, spec)`` of the audit whose result ``store`` lacks (or holds for
    other settings)."""
    return [(s, i, a) for s in run.attack_settings.steps for i in range(run.data_settings.images) for a in specs
            if not store.has(s, a.id, i, settings=a.settings, defaults=a.defaults)]


def steps_of(todo: Sequence[Tuple[int, int, Any]]) -> List[int]:
    """The steps of the pending results ``todo`` (:func:`pending`), in order."""
    return sorted({s for s, _, _ in todo})


def attack_all(run: BuiltRun, store: ResultStore, specs: Sequence[Any], todo: Sequence[Tuple[int, int, Any]],
               states: Dict[int, Any], failure: Optional[Dict[str, Any]]) -> None:
    """Compute and store every pending result ``todo`` of ``specs`` (:func:`pending`) from the
    model ``states`` at their steps (``failure``: why training stopped before a step, if it
    did): each step's observations, then its (step, attack) groups."""
    check_cancel(run.cancel)
    total = len(run.attack_settings.steps) * run.data_settings.images * len(specs)
    if not todo:
        return
    known = store.load_manifest().failures or []
    if failure is not None and failure not in known:
        store.update_manifest(failures=known + [failure])
    cost = result_cost(run)
    bar = _progress(total * cost, (total - len(todo)) * cost, run.output_settings.progress, run.label)
    try:
        for step in steps_of(todo):
            step_todo = [(i, a) for s, i, a in todo if s == step]
            observations = observations_of(run, states.get(step), failure, step, sorted({i for i, _ in step_todo}))
            for spec in specs:  # one (step, attack) group: every pending image at once
                images = [i for i, a in step_todo if a is spec]
                if images:
                    with store.claim(step, spec.id):  # another process on this group: wait, then reuse its results
                        attack_claimed(run, store, spec, observations, step, images, bar)
    finally:
        bar.close()
    check_cancel(run.cancel)


def result_cost(run: BuiltRun) -> int:
    """The progress bar's unit count for one result: image-iterations, i.e. gradient
    evaluations (the budget) times the private images in a batch."""
    return max(1, run.attack_settings.budget) * run.data_settings.batch_size


def observations_of(run: BuiltRun, state, failure, step: int, images: Sequence[int]) -> Dict[int, Any]:
    """The observation of each private batch at ``step`` (or, as text, why there is none)."""
    out: Dict[int, Any] = {}
    for image in images:
        x, y = run.private[image]
        if state is None:
            out[image] = failure["error"] if failure else "no checkpoint for this step"
            continue
        model = copy.deepcopy(run.parts.model)
        model.load_state_dict(state)
        try:
            out[image] = run.client.observe(model, x, y, step, image)
        except GiaError as err:
            out[image] = f"{type(err).__name__}: {err}"
    return out


def attack_claimed(run: BuiltRun, store: ResultStore, spec: Any, observations: Dict[int, Any], step: int,
                   images: Sequence[int], bar) -> None:
    """Attack ``images`` of ``step`` with ``spec`` as one group (this process holds its claim);
    store each result."""
    cost = result_cost(run)
    done = [i for i in images if store.has(step, spec.id, i, settings=spec.settings, defaults=spec.defaults)]
    bar.update(cost * len(done))
    images = [i for i in images if i not in done]
    failed = [i for i in images if isinstance(observations[i], str)]
    for image in failed:  # the defense failed on this batch: nothing to attack
        store.save_result(replace(runner.record_for(run, spec, step, image), status=Status.ERROR, failed="defense",
                                  reason=observations[image]))
        bar.update(cost)
    group = [(i, observations[i], *run.private[i]) for i in images if i not in failed]
    if not group:
        return
    label = f"step {step} {spec.id} images {','.join(str(i) for i, *_ in group)}"
    bar.set_postfix_str(label)
    credit = GroupCredit(bar, label, cost * len(group), run.cancel)
    check_cancel(run.cancel)
    results = runner.attack_group(run, spec, group, step, credit.progress)
    store.save_group(results)  # one unit: a rerun after a cut between its writes redoes the group
    credit.settle(len(results) * cost)


class GroupCredit:
    """Moves the audit's bar (image-iterations) while one (step, attack) group runs: its
    share grows with the attack's ``progress(done, total, loss)``; ``settle`` tops it up to
    the finished results' full cost (attacks that stop early, or cost less than the budget).
    Each progress report first checks the ``cancel`` event (:func:`check_cancel`)."""

    def __init__(self, bar, label: str, cost: int, cancel: Optional[threading.Event] = None, every_s: float = 0.5):
        self.bar, self.label, self.cost, self.cancel, self.every_s = bar, label, cost, cancel, every_s
        self.credited, self.last = 0, 0.0

    def settle(self, units: int) -> None:
        """Move the bar to ``units`` of the group's cost (never back, never past it)."""
        units = min(self.cost, units)
        if units > self.credited:
            self.bar.update(units - self.credited)
            self.credited = units

    def progress(self, done: int, total: int, loss: float) -> None:
        check_cancel(self.cancel)
        self.settle(int(self.cost * done / max(total, 1)))
        now = time.perf_counter()
        if now - self.last >= self.every_s or done == total:
            self.last = now
            self.bar.set_postfix_str(f"{self.label}: {done}/{total}, loss {float(loss):.3g}")


def _progress(total: int, initial: int, enabled: bool, label: str = "audit"):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=label, unit=" image-it", unit_scale=True,
                disable=not enabled, dynamic_ncols=True)

