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


def unavailable_notes(data: Dict[str, Any]) -> Dict[str, str]:
    """``metric -> reason`` for metrics some attack could not compute (e.g. LPIPS weights)."""
    notes: Dict[str, str] = {}
    for step in data["steps"]:
        for summary in step["attacks"].values():
            notes.update(summary.get("unavailable", {}))
    return notes


def attack_cell(summary: Dict[str, Any]) -> str:
    """The PSNR of an attack at a step, or why there is none."""
    if summary["images_ok"]:
        text = fmt("psnr", summary["psnr"])
        return text if summary["status"] == "ok" else f"{text} ({summary['status']})"
    return summary["status"]


def verdict_text(verdict: Dict[str, Any]) -> str:
    if not verdict.get("images"):
        return "unavailable (no reconstruction)"
    return (f"{verdict['label']} ({verdict['recovered']} recovered, {verdict['partially']} partially, "
            f"{verdict['not_recovered']} not recovered of {verdict['images']})")


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
