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
