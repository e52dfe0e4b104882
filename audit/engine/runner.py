"""Attack one private batch, or a group of them, and return scored result records: the
runner of an audit's (step, attack) groups, on the audit as built (:class:`BuiltRun`: its
seed, defense, budget and null). Failures (an attack that raises, a defense that fails inside
an adaptive attack, non-finite images) become records, never exceptions."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from attacks import ATTACKS
from attacks.optimization import not_grouped
from audit.core.errors import DefenseError, NotApplicable
from audit.core.reasons import Reason
from audit.core.records import AttackResult, Scores, Status
from audit.engine.built import BuiltRun
from audit.engine.clients import defense_seed
from audit.engine.compose import reconstruct
from audit.engine.identity import derive_seed
from audit.engine.scoring import score_against_trained, score_reconstructions, trace_summary, trained_batch

Scored = Tuple[AttackResult, Optional[torch.Tensor]]


def attack_one(run: BuiltRun, spec: Any, obs, images, labels, step: int, image: int,
               progress: Optional[Callable] = None) -> Scored:
    """Run one attack on one observation and score it. ``progress(done, total, loss)`` is
    forwarded to attacks that report progress."""
    record = record_for(run, spec, step, image)
    start = time.perf_counter()
    try:
        attack = ATTACKS.build(spec.name, **spec.settings)
        rec = reconstruct(attack, obs, run.attack_settings.budget, record.seed, progress)
    except NotApplicable as err:
        return replace(record, status=Status.NOT_APPLICABLE, why=err.reason), None
    except Exception as err:  # an attack, or a defense inside an adaptive attack, failed
        return failed(run.parts.defense.name, record, err, step), None
    return scored_group(run, spec, [record], [rec], [images], [labels], time.perf_counter() - start)[0]


def attack_group(run: BuiltRun, spec: Any, group: Sequence[Tuple[int, Any, torch.Tensor, torch.Tensor]], step: int,
                 progress: Optional[Callable] = None) -> List[Scored]:
    """One attack on every pending ``(image, observation, x, y)`` of a step: as one batched
    computation when the attack can group observations (``reconstruct_many``), else (or when
    the grouped run fails) one at a time through :func:`attack_one`, so every failure is
    recorded against its own image."""
    if len(group) == 1:
        image, obs, x, y = group[0]
        return [attack_one(run, spec, obs, x, y, step, image, progress=progress)]
    records = [record_for(run, spec, step, image) for image, _, _, _ in group]
    start = time.perf_counter()
    recs, why = None, not_grouped(Reason("no-grouped-path", attack=spec.name))
    try:
        attack = ATTACKS.build(spec.name, **spec.settings)
        many = getattr(attack, "reconstruct_many", None)
        if many is not None:
            recs = many([obs for _, obs, _, _ in group], run.attack_settings.budget, [r.seed for r in records],
                        progress=progress, max_members=run.max_members)
    except Exception as err:  # NotApplicable or a failure: attribute it image by image
        why = not_grouped(Reason("grouped-run-failed", error=f"{type(err).__name__}: {str(err)[:120]}"))
    if recs is None:
        out = [attack_one(run, spec, obs, x, y, step, image, progress=share(progress, k, len(group)))
               for k, (image, obs, x, y) in enumerate(group)]
        for record, _ in out:
            record.trace.setdefault("grouped", why)
        return out
    seconds = (time.perf_counter() - start) / len(group)
    return scored_group(run, spec, records, recs, [x for *_, x, _ in group], [y for *_, y in group], seconds)


def scored_group(run: BuiltRun, spec: Any, records: Sequence[AttackResult], recs, images, labels,
                 seconds: float) -> List[Scored]:
    """Score a group's reconstructions: the metrics and the null's evidence run once over every
    image of the group (:func:`score_reconstructions`)."""
    records = [replace(record, time_s=round(seconds, 3)) for record in records]
    out: List[Optional[Scored]] = [None] * len(records)
    live = []
    for k, (record, rec) in enumerate(zip(records, recs)):
        if not rec.applicable:
            out[k] = replace(record, status=Status.NOT_APPLICABLE, why=rec.reason), None
        elif rec.inputs is None or not torch.isfinite(rec.inputs).all():
            out[k] = replace(record, status=Status.ERROR, reason=f"attack {spec.id!r} returned no finite images"), None
        else:
            live.append(k)
    scored = score_reconstructions([recs[k] for k in live], [images[k] for k in live],
                                   [labels[k] for k in live], run.null)
    for k, (metrics, unavailable, aligned) in zip(live, scored):
        record = replace(records[k], status=Status.OK, metrics=Scores.from_dict(metrics), unavailable=unavailable,
                         trace=trace_summary(recs[k].trace))
        out[k] = replace(record, **against_trained(run, recs[k], record, images[k], labels[k])), aligned
    return out


def record_for(run: BuiltRun, spec: Any, step: int, image: int) -> AttackResult:
    """The empty result record of ``spec`` on ``image`` at ``step``, with its derived seed."""
    return AttackResult(step=step, attack_id=spec.id, attack=spec.name, image=image, settings=spec.settings,
                        defaults=spec.defaults, seed=derive_seed(run.seed, "attack", step, spec.id, image),
                        defense=run.parts.defense.name, budget=run.attack_settings.budget)


def failed(defense: str, record: AttackResult, err: BaseException, step: int) -> AttackResult:
    """``record`` as the error ``err``: the defense's (named ``defense``) or the attack's."""
    kind = "defense" if isinstance(err, DefenseError) else "attack"
    reason = f"{type(err).__name__}: {err}"
    if kind == "defense" and defense not in reason:
        reason = f"defense {defense!r} at step {step}: {reason}"
    return replace(record, status=Status.ERROR, failed=kind, reason=reason)


def against_trained(run: BuiltRun, rec, record: AttackResult, images, labels) -> Dict[str, Any]:
    """For an input-transforming defense, the record's scores against the batch the client
    trained on (reproduced with the observation's seed); {} for other defenses."""
    try:
        trained = trained_batch(run.parts.defense, images.to(rec.inputs.device),
                                defense_seed(run.seed, record.step, record.image))
    except Exception as err:  # a broken transform_inputs: say so, keep the original's scores
        return {"trained_reference": f"unavailable: transform_inputs raised {type(err).__name__}: {err}"}
    return score_against_trained(rec, trained, labels.to(rec.inputs.device), run.null)


def share(progress: Optional[Callable], k: int, n: int) -> Optional[Callable]:
    """The group's ``progress`` seen from its ``k``-th of ``n`` members run one at a time."""
    if progress is None:
        return None
    return lambda done, total, loss: progress(k * total + done, n * total, loss)
