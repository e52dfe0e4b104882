"""Number formatting shared by the Markdown and HTML renderers (never prints NaN)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from audit.core.evidence import mean_difference
from audit.core.records import AccuracySpread, UtilityResult
from audit.core.step_records import AttackSummary, ControlSummary, Risk, StepBar, StepReport, StepVerdict
from audit.report.record import Report

UNAVAILABLE = "n/a"

# metric -> (column title, formatter)
COLUMNS = {
    "psnr": ("PSNR (dB)", lambda v: f"{v:.2f}"),
    "ssim": ("SSIM", lambda v: f"{v:.3f}"),
    "lpips": ("LPIPS", lambda v: f"{v:.3f}"),
    "label_acc": ("label acc.", lambda v: f"{v:.0%}"),
}


#: what a report's audited points are called: an audit's training steps, a federation's rounds
STEP_NAMES: Dict[str, Dict[str, str]] = {
    "step": {"column": "step", "title": "training step", "axis": "training step of the audited checkpoint",
             "spent": "DP-SGD steps spent"},
    "round": {"column": "round", "title": "federation round", "axis": "federation round of the audited global model",
              "spent": "noised updates spent"},
}


def step_name(report: Any) -> Dict[str, str]:
    """The words for the report's audited points (its ``step_name``, a key of :data:`STEP_NAMES`;
    its ``column`` is the key itself); ``report``: a :class:`Report` or its JSON object."""
    return STEP_NAMES[Report.of(report).step_name or "step"]


def fmt(metric: str, value: Optional[float]) -> str:
    return UNAVAILABLE if value is None else COLUMNS[metric][1](value)


def fmt_fraction(value: Optional[float]) -> str:
    return UNAVAILABLE if value is None else f"{value:.0%}"


def summary_header(column: str = "step"):
    """The per-step table's columns: worst case per metric (mean over images, each image at its
    most leaking attack), the best-recovered image, the positive control, the verdict."""
    return ([column] + [f"worst-case {COLUMNS[m][0]}" for m in COLUMNS]
            + ["best-recovered image PSNR (dB)", "within delta (strongest attack)", "without the defense (control)",
               "verdict"])


def summary_row(step: StepReport):
    wc = step.worst_case
    return ([step.step] + [fmt(m, getattr(wc, m)) for m in COLUMNS]
            + [fmt("psnr", wc.psnr_max), risk_text(step.risk), control_text(step.control), verdict_text(step.verdict)])


def attack_header(column: str = "step"):
    return [column] + [COLUMNS[m][0] for m in COLUMNS] + ["worst image PSNR", "PSNR vs original",
                                                         "PSNR vs trained-on batch", "ok/done"]


def attack_row(step: StepReport, attack: str):
    a = step.attacks[attack]
    return ([step.step] + [fmt(m, getattr(a, m)) for m in COLUMNS]
            + [fmt("psnr", a.psnr_max), fmt("psnr", a.psnr_original), fmt("psnr", a.psnr_trained), done_text(a)])


def done_text(summary: AttackSummary) -> str:
    """``ok/done`` of an attack at a step (not-applicable results counted apart), or why none applies."""
    if summary.status == "not applicable":
        return attack_cell(summary)
    skipped = summary.images_not_applicable
    return f"{summary.images_ok}/{summary.images_done}" + (f" ({skipped} not applicable)" if skipped else "")


def unavailable_notes(report: Report) -> Dict[str, str]:
    """``metric -> reason`` for metrics some attack could not compute (e.g. LPIPS weights)."""
    notes: Dict[str, str] = {}
    for step in report.steps:
        for summary in step.attacks.values():
            notes.update(summary.unavailable or {})
    return notes


def attack_cell(summary: AttackSummary) -> str:
    """The mean PSNR of an attack at a step (and its worst image when it differs), or why
    there is none."""
    if summary.status == "not applicable":
        return f"not applicable ({summary.reason or 'no reason given'})"
    if summary.images_ok:
        text = fmt("psnr", summary.psnr)
        if summary.psnr_max is not None and summary.psnr_max != summary.psnr:
            text += f" (max {fmt('psnr', summary.psnr_max)})"
        return text if summary.status == "ok" else f"{text} ({summary.status})"
    return summary.status


def progress_text(report: Any) -> str:
    """``4/4 (step, attack, image) results``, then the attacks that do not apply (counted
    neither as done nor as to do) with their steps and reason."""
    report = Report.of(report)
    column, progress = step_name(report)["column"], report.progress
    text = f"{progress['done']}/{progress['total']} ({column}, attack, image) results"
    skipped = report.not_applicable
    if skipped:
        text += "; not applicable: " + "; ".join(
            f"{n['attack']} at {column} {', '.join(map(str, n['steps']))} ({n['reason']})" for n in skipped)
    return text


def interval_text(interval: Optional[Dict[str, Any]]) -> str:
    """``k of n`` with the rate and its interval, e.g. ``1 of 8 (12%; 95% CI 0.3%-53%)``."""
    if not interval or not interval.get("n"):
        return UNAVAILABLE
    k, n = interval["k"], interval["n"]
    return (f"{k} of {n} ({k / n:.0%}; {interval.get('level', 0.95):.0%} CI "
            f"{interval['low']:.1%}-{interval['high']:.1%})")


def verdict_text(verdict: Any) -> str:
    """A step verdict (a :class:`StepVerdict` or its JSON object) in words: the label, the image
    counts with the recovery rate's interval, what a 'no recovered image' excludes, and why when
    not judged or incomplete."""
    verdict = StepVerdict.from_dict(verdict)
    label = verdict.label or "not judged"
    exact = f" ({verdict.exact} exact)" if verdict.exact else ""
    counts = (f"{verdict.recovered} recovered{exact}, {verdict.partially} partially, "
              f"{verdict.not_recovered} not recovered of {verdict.images} image(s)")
    if verdict.recovery_rate.get("n"):
        counts += f"; recovered {interval_text(verdict.recovery_rate)}"
    if verdict.buffers:  # whether the uploaded buffers' statistics carried the attacks
        counts += "; " + verdict.buffers
    if label == "incomplete":
        return f"incomplete ({verdict.reason}); finished attacks: {verdict.judged or 'nothing judged'}, {counts}"
    if label == "not judged":
        return f"not judged ({verdict.reason})"
    if label == "inconclusive":
        return f"inconclusive ({verdict.reason}); {counts}"
    if verdict.short_of:  # images that met a per-image class, fewer than the step's word needs
        counts += "; " + verdict.short_of
    if label == "no recovered image" and verdict.defense_effect:
        counts += "; " + effect_text(verdict.defense_effect)
    if verdict.excludes_rate_above is not None:
        need = verdict.images_to_exclude or {}
        counts += (f"; excludes a recovery rate above {verdict.excludes_rate_above:.0%} (one-sided 95%)"
                   + (f", {need['images']} images would exclude {need['rate']:.0%}" if need else ""))
    return f"{label} ({counts})"


def effect_text(effect: Dict[str, Any]) -> str:
    """``the defense stops 5 of the 5 images its control recovered (exact McNemar p = 0.031)``."""
    text = (f"the defense stops {effect['stopped']} of the {effect['control_recovered']} image(s) its control "
            f"recovered (exact McNemar p = {effect['p_value']:.2g}")
    if effect.get("let_through"):
        text += f"; {effect['let_through']} recovered only with the defense"
    return text + ")"


def control_text(control: Any) -> str:
    """The step's positive control (a :class:`ControlSummary`, its JSON object or None) in a few
    words: ``4 of 4 recovered (100%; 95% CI 40%-100%) at budget 800``."""
    if not control:
        return UNAVAILABLE
    control = ControlSummary.from_dict(control)
    if not control.available:
        return f"unavailable ({control.reason or 'not run'})"
    return f"{interval_text(control.recovery_rate)} recovered at budget {control.budget}"


def evidence_header(column: str = "step"):
    """The per-image evidence table: the leak rule's inputs and its class per private image."""
    return [column, "image", "class", "by attack", "aligned PSNR (dB)", "chance level (dB)", "above chance (dB)",
            "rank among K", "PSNR (dB)", "SSIM", "without the defense (control)"]


def evidence_rows(step: StepReport):
    rows = []
    control = step.control or ControlSummary()
    by_image = {(c["image"], c["index"]): c["recovered"] for c in control.per_image or []}
    for e in step.per_image:
        seen = by_image.get((e["image"], e.get("index", 0)))
        above = (None if e.get("aligned_psnr") is None or e.get("chance_level") is None
                 else e["aligned_psnr"] - e["chance_level"])
        where = f"{e['image']}" if not e.get("index") else f"{e['image']}.{e['index']}"
        rank = UNAVAILABLE if e.get("rank") is None else f"{e['rank']} of {e['candidates']}"
        rows.append([step.step, where, e.get("image_class") or "no evidence", e.get("best_attack") or UNAVAILABLE,
                     fmt("psnr", e.get("aligned_psnr")), fmt("psnr", e.get("chance_level")),
                     UNAVAILABLE if above is None else f"{above:+.2f}", rank, fmt("psnr", e.get("psnr")),
                     fmt("ssim", e.get("ssim")),
                     UNAVAILABLE if seen is None else "recovered" if seen else "not recovered"])
    return rows


def evidence_notes(report: Report) -> List[str]:
    """The null and the rule's measured false-positive rates, in words."""
    null, fpr = report.null or {}, report.false_positive_rate or {}
    notes = []
    if null:
        notes.append(f"Null (what an attacker gets without the update): {null.get('pool')} unrelated images "
                     f"({null.get('source', '')}) and the data-only guesses {', '.join(null.get('guesses', []))}; "
                     f"identification among K = {null.get('candidates')} candidates by {null.get('similarity')}"
                     + (f" (LPIPS unavailable: {null['lpips_unavailable']})" if null.get("lpips_unavailable") else ""))
    if fpr.get("unavailable"):
        notes.append(f"False-positive rate of the rule: unavailable ({fpr['unavailable']})")
    elif fpr:
        notes.append(f"False-positive rate of the rule on this audit's data ({fpr['how']}): recovered "
                     f"{interval_text(fpr['recovered'])}; partially or worse {interval_text(fpr['partially_or_worse'])}")
    seen = set()
    for step in report.steps:
        text = bars_text(step.verdict.bars or [])
        if text and text not in seen:
            seen.add(text)
            notes.append(text)
    control = report.control or {}
    if control.get("description"):
        search = (control.get("search") or {}).get("reason")
        notes.append(f"Positive control at budget {control.get('budget')}: {control['description']}"
                     + (f"; budget searched: {search}" if search else ""))
    return notes


def bars_text(bars: Sequence[Any]) -> str:
    """What a step's words need (:class:`~audit.core.step_records.StepBar` records or their JSON) and
    their false-positive rate for the step, in words."""
    parts = []
    for bar in map(StepBar.from_dict, bars):
        measured = bar.measured or {}
        seen = (f"; at the null items' measured rate {measured['rate']:.2%} ({measured['low']:.2%}-{measured['high']:.2%})"
                if measured else "")
        parts.append(f"'{bar.word}' needs {bar.needed} of {bar.images} images: false-positive rate for the step at most "
                     f"{bar.step_rate:.2%} (per image {bar.per_image:.2%}, {bar.basis}){seen}")
    if not parts:
        return ""
    similarity = StepBar.from_dict(bars[0]).similarity
    return "Step words, calibrated as a whole" + (f" ({similarity})" if similarity else "") + ": " + "; ".join(parts)


def overall_text(verdict: Dict[str, Any], column: str = "step") -> str:
    """The overall verdict with the worst step, and the steps that were not judged (``column``:
    what a step is called, e.g. "round")."""
    label = verdict.get("label", "not judged")
    text = label
    if verdict.get("worst_step") is not None:
        text += f" (worst at {column} {verdict['worst_step']})"
    if label in ("incomplete", "not judged", "inconclusive") and verdict.get("reason"):
        text += f": {verdict['reason']}"
    skipped = verdict.get("not_judged_steps") or []
    if skipped and label != "not judged":
        text += "; not judged: " + "; ".join(f"{column} {n['step']} ({n['reason']})" for n in skipped)
    if verdict.get("incomplete_steps") and label != "incomplete":
        text += f"; incomplete {column}s: " + ", ".join(map(str, verdict["incomplete_steps"]))
    if verdict.get("inconclusive_steps") and label != "inconclusive":
        text += f"; inconclusive {column}s (attack power): " + ", ".join(map(str, verdict["inconclusive_steps"]))
    return text


def privacy_rows(privacy: Dict[str, Any], steps: Sequence[StepReport] = ()):
    """``[step, DP-SGD steps, epsilon, delta, identification bound, measured identification]``
    rows of the (epsilon, delta) the run's steps spend next to the bound on identifying a
    private image and the rate measured at that step, or ``None`` with why not."""
    if not privacy or not privacy.get("applicable"):
        return None, f"not applicable: {(privacy or {}).get('reason', 'the defense declares no privacy accounting')}"
    bound = privacy.get("identification_bound") or {}
    measured = {s.step: s.verdict.identification_rate for s in steps}
    rows = [[p["step"], p["rounds"], "inf" if p["epsilon"] is None else f"{p['epsilon']:.3g}", f"{p['delta']:g}",
             UNAVAILABLE if bound.get("bound") is None else f"{bound['bound']:.1%}",
             interval_text(measured.get(p["step"]))]
            for p in privacy.get("per_step", [])]
    note = privacy.get("description", "")
    if bound.get("description"):
        note += "; identification bound: " + bound["description"]
    return rows, note


def privacy_header(column: str = "step") -> List[str]:
    """The privacy table's columns for a report whose audited points are ``column``s (:data:`STEP_NAMES`)."""
    return [f"audited {column}", STEP_NAMES[column]["spent"], "epsilon", "delta", "identification bound (Hayes et al.)",
            "identified (measured, strongest attack per image)"]



def clean_rounds_text(plan: Dict[str, Any]) -> Optional[str]:
    """How often probing saw the defense share the clean gradient (or a multiple of it)."""
    rounds = (plan.get("traits") or {}).get("rounds_probe") or {}
    if not rounds.get("calls"):
        return None
    clean = rounds.get("clean_calls", 0)
    where = ", ".join(map(str, rounds.get("clean_rounds", []))) or "none"
    return (f"the defense shared the clean gradient (or an exact multiple) in {clean} of {rounds['calls']} "
            f"probe calls ({len(rounds.get('rounds', []))} rounds x {rounds.get('checkpoints', 0)} "
            f"checkpoints); at rounds: {where}")


#: the report's sections listed under "Settings, seeds and versions", in order
SETTINGS_SECTIONS = ("defense", "data", "settings", "seeds", "versions", "timing")


def failure_header(report: Report) -> List[str]:
    """The failures table's columns."""
    return [step_name(report)["column"], "attack", "image", "defense", "status", "error"]


def failure_rows(report: Report) -> List[List[Any]]:
    """One row per failure of the report (an attack's result, or a phase of the run)."""
    return [[f.get("step", ""), f.get("attack", ""), f.get("image", ""), f.get("defense", ""),
             f.get("status", f.get("phase", "")), f.get("error", "")] for f in report.failures]


def risk_text(risk: Any) -> str:
    """The strongest attack's success within delta (a :class:`Risk` or its JSON object)."""
    risk = Risk.from_dict(risk)
    if risk.success is None:
        return UNAVAILABLE
    return f"{risk.success:.0%} ({risk.strongest_attack})"


def kv_rows(obj: Any, prefix: str = ""):
    """Flatten nested dicts into ``(dotted key, value)`` rows for settings tables."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from kv_rows(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), obj


def plan_traits(plan: Dict[str, Any]) -> Dict[str, Any]:
    """The probed traits worth reading (the per-layer probe table stays in report.json)."""
    traits = dict(plan.get("traits") or {})
    traits.pop("layers", None)
    traits.pop("rounds_probe", None)
    clean = clean_rounds_text(plan)
    if clean:
        traits["clean gradient shared"] = clean
    if plan.get("error"):
        traits["planner"] = plan["error"]
    missing = [a.get("name", "?") for a in plan.get("unavailable") or []]
    if missing:
        traits["proposed but not installed"] = ", ".join(missing)
    return traits


def spread_text(spread: Optional[AccuracySpread]) -> str:
    """``41.2% ± 3.1 (37.5-44.4%, 3 seeds)``: mean ± standard deviation (points), min-max;
    ``n/a`` when no run has an accuracy."""
    if spread is None or spread.mean is None:
        return UNAVAILABLE
    std = "" if spread.std is None else f" ± {100 * spread.std:.1f}"
    n = len(spread.accuracies)
    return f"{spread.mean:.1%}{std} ({100 * spread.min:.1f}-{spread.max:.1%}, {n} seed{'s' * (n != 1)})"


def difference_text(defended: Optional[AccuracySpread], undefended: Optional[AccuracySpread]) -> str:
    """``-9.4 points, 95% CI -29.6 to +10.8 (Welch t over 3 and 3 seeds)``: the difference of
    the mean accuracies with its interval; ``n/a`` (with the reason) without two seeds per arm."""
    if defended is None or undefended is None or defended.mean is None or undefended.mean is None:
        return UNAVAILABLE
    diff = mean_difference(defended.accuracies, undefended.accuracies)
    if diff is None:
        return f"{100 * (defended.mean - undefended.mean):+.1f} points (fewer than two seeds per arm: no interval)"
    n, m = diff.sizes
    return (f"{100 * diff.estimate:+.1f} points, {diff.level:.0%} CI {100 * diff.low:+.1f} to {100 * diff.high:+.1f} "
            f"(Welch t over {n} and {m} seeds)")


def diverged_text(spread: Optional[AccuracySpread]) -> str:
    """``seed 7 at round 3, seed 9 at round 5`` or ``no``."""
    runs = spread.diverged if spread else []
    return ", ".join(f"seed {r.seed} at round {r.diverged_at}" for r in runs) or "no"


def utility_rows(utility: Dict[str, Any]):
    """``[quantity, with the defense, without it]`` rows, or ``None`` with the reason why not."""
    result = UtilityResult.from_dict(utility)
    if result.unavailable or result.defended is None:
        return None, result.unavailable or "not measured"
    arms = (result.defended, result.undefended)

    def row(label: str, value) -> List[str]:
        return [label] + [UNAVAILABLE if a is None else value(a) for a in arms]

    def num(v: Any, spec: str) -> str:
        return UNAVAILABLE if not isinstance(v, (int, float)) else format(v, spec)

    rows = [row("test accuracy: mean ± std (min-max)", spread_text),
            row("per seed", lambda a: ", ".join(num(r.accuracy, ".1%") for r in a.runs)),
            row("diverged", diverged_text),
            row("final training loss (mean)", lambda a: num(a.final_loss, ".3f")),
            row("training time (s, all seeds)", lambda a: num(a.seconds, ".1f"))]
    setting = ", ".join(f"{k} {v}" for k, v in result.setting.items() if k != "seeds")
    note = (f"difference of mean accuracies (defended - undefended): {difference_text(*arms)}; "
            f"relative accuracy (mean defended / mean undefended): {num(result.relative, '.2f')}")
    notes = [f"seed {r.seed}: {r.error or r.note}" for r in result.defended.runs if r.error or r.note]
    return rows, "; ".join([note + (f"; trained with {setting}" if setting else "")] + notes)
