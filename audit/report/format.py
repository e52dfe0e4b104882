"""Number formatting shared by the Markdown and HTML renderers (never prints NaN)."""
from __future__ import annotations

from typing import Any, Dict, Optional

UNAVAILABLE = "n/a"

# metric -> (column title, formatter)
COLUMNS = {
    "psnr": ("PSNR (dB)", lambda v: f"{v:.2f}"),
    "ssim": ("SSIM", lambda v: f"{v:.3f}"),
    "lpips": ("LPIPS", lambda v: f"{v:.3f}"),
    "label_acc": ("label acc.", lambda v: f"{v:.0%}"),
}


def fmt(metric: str, value: Optional[float]) -> str:
    return UNAVAILABLE if value is None else COLUMNS[metric][1](value)


def fmt_fraction(value: Optional[float]) -> str:
    return UNAVAILABLE if value is None else f"{value:.0%}"


def summary_header():
    """The per-step table's columns: worst case per metric (mean over images), the worst image."""
    return (["step"] + [f"worst-case {COLUMNS[m][0]}" for m in COLUMNS]
            + ["worst image PSNR (dB)", "within delta (strongest attack)", "verdict"])


def summary_row(step: Dict[str, Any]):
    wc = step["worst_case"]
    return ([step["step"]] + [fmt(m, wc[m]) for m in COLUMNS]
            + [fmt("psnr", wc.get("psnr_max")), risk_text(step["risk"]), verdict_text(step["verdict"])])


def attack_header():
    return ["step"] + [COLUMNS[m][0] for m in COLUMNS] + ["worst image PSNR", "PSNR vs original",
                                                         "PSNR vs trained-on batch", "ok/done"]


def attack_row(step: Dict[str, Any], attack: str):
    a = step["attacks"][attack]
    return ([step["step"]] + [fmt(m, a[m]) for m in COLUMNS]
            + [fmt("psnr", a.get("psnr_max")), fmt("psnr", a.get("psnr_original")),
               fmt("psnr", a.get("psnr_trained")), f"{a['images_ok']}/{a['images_done']}"])


def unavailable_notes(data: Dict[str, Any]) -> Dict[str, str]:
    """``metric -> reason`` for metrics some attack could not compute (e.g. LPIPS weights)."""
    notes: Dict[str, str] = {}
    for step in data["steps"]:
        for summary in step["attacks"].values():
            notes.update(summary.get("unavailable", {}))
    return notes


def attack_cell(summary: Dict[str, Any]) -> str:
    """The mean PSNR of an attack at a step (and its worst image when it differs), or why
    there is none."""
    if summary["images_ok"]:
        text = fmt("psnr", summary["psnr"])
        if summary.get("psnr_max") is not None and summary["psnr_max"] != summary["psnr"]:
            text += f" (max {fmt('psnr', summary['psnr_max'])})"
        return text if summary["status"] == "ok" else f"{text} ({summary['status']})"
    return summary["status"]


def verdict_text(verdict: Dict[str, Any]) -> str:
    """A step verdict in words: the label, the image counts, and why when not judged or incomplete."""
    label = verdict.get("label", "not judged")
    counts = (f"{verdict.get('recovered', 0)} recovered, {verdict.get('partially', 0)} partially, "
              f"{verdict.get('not_recovered', 0)} not recovered of {verdict.get('images', 0)} image(s)")
    if label == "incomplete":
        found = verdict.get("judged") or "nothing judged"
        return f"incomplete ({verdict.get('reason', '')}); finished attacks: {found}, {counts}"
    if label == "not judged":
        return f"not judged ({verdict.get('reason', '')})"
    return f"{label} ({counts})"


def overall_text(verdict: Dict[str, Any]) -> str:
    """The overall verdict with the worst step, and the steps that were not judged."""
    label = verdict.get("label", "not judged")
    text = label
    if verdict.get("worst_step") is not None:
        text += f" (worst at step {verdict['worst_step']})"
    if label in ("incomplete", "not judged") and verdict.get("reason"):
        text += f": {verdict['reason']}"
    skipped = verdict.get("not_judged_steps") or []
    if skipped and label != "not judged":
        text += "; not judged: " + "; ".join(f"step {n['step']} ({n['reason']})" for n in skipped)
    if verdict.get("incomplete_steps") and label != "incomplete":
        text += "; incomplete steps: " + ", ".join(map(str, verdict["incomplete_steps"]))
    return text


def privacy_rows(privacy: Dict[str, Any]):
    """``[step, epsilon, delta]`` rows of the (epsilon, delta) the run's steps spend, or
    ``None`` with why not."""
    if not privacy or not privacy.get("applicable"):
        return None, f"not applicable: {(privacy or {}).get('reason', 'the defense declares no privacy accounting')}"
    rows = [[p["step"], p["rounds"], "inf" if p["epsilon"] is None else f"{p['epsilon']:.3g}", f"{p['delta']:g}"]
            for p in privacy.get("per_step", [])]
    return rows, privacy.get("description", "")


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


def risk_text(risk: Dict[str, Any]) -> str:
    if risk["success"] is None:
        return UNAVAILABLE
    return f"{risk['success']:.0%} ({risk['strongest_attack']})"


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


def utility_rows(utility: Dict[str, Any]):
    """``[quantity, with the defense, without it]`` rows, or ``None`` with the reason why not."""
    if not utility or utility.get("unavailable"):
        return None, (utility or {}).get("unavailable", "not measured")

    def num(v: Any, spec: str) -> str:
        return UNAVAILABLE if not isinstance(v, (int, float)) else format(v, spec)

    rows = [["test accuracy", num(utility.get("accuracy"), ".1%"), num(utility.get("baseline_accuracy"), ".1%")],
            ["final training loss", num(utility.get("final_loss"), ".3f"), num(utility.get("baseline_final_loss"), ".3f")],
            ["training time (s)", num(utility.get("seconds"), ".1f"), num(utility.get("baseline_seconds"), ".1f")]]
    setting = ", ".join(f"{k} {v}" for k, v in (utility.get("setting") or {}).items())
    note = f"relative accuracy (defended / undefended): {num(utility.get('relative'), '.2f')}"
    return rows, note + (f"; trained with {setting}" if setting else "")
