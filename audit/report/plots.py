"""Matplotlib figures of the report (rendered off-screen to PNG bytes)."""
from __future__ import annotations

import io
from typing import Any, Dict, List, Optional, Tuple

from audit.report.record import Report

#: what the PSNR-versus-step figure plots: the leak rule's quantity, for the curves and chance alike
PLOTTED = "aligned PSNR"
Points = List[Tuple[int, float]]


def plain_text(text: Any) -> str:
    """``text`` as matplotlib draws it literally: a user's ``$`` (a defense or attack name)
    would otherwise start math text, and a name it cannot parse breaks the figure."""
    return str(text).replace("$", r"\$")


def psnr_vs_step_series(report: Any) -> Dict[str, Any]:
    """The data of the PSNR-versus-step figure, all in aligned PSNR (the leak rule's quantity):
    ``curves`` (attack id -> ``(step, mean aligned PSNR over its images)``), ``worst`` (the
    worst case over attacks), ``chance`` (per step, the mean chance level of the judged images;
    the report's mean chance level where a step judged none), ``adaptive`` (dashed curves);
    ``report``: a :class:`~audit.report.record.Report` or its JSON object."""
    report = Report.of(report)
    curves: Dict[str, Points] = {}
    for aid in report.attack_ids:
        pts = [(s.step, s.attacks[aid].aligned_psnr if aid in s.attacks else None) for s in report.steps]
        curves[aid] = [(x, y) for x, y in pts if y is not None]
    worst = [(s.step, s.worst_case.aligned_psnr) for s in report.steps]
    chance = [(s.step, _step_chance(s, report.chance_level)) for s in report.steps]
    return {"quantity": PLOTTED, "curves": {a: pts for a, pts in curves.items() if pts},
            "worst": [(x, y) for x, y in worst if y is not None],
            "chance": [(x, y) for x, y in chance if y is not None],
            "adaptive": {a["id"] for a in report.attacks if a.get("kind") == "adaptive"}}


def _step_chance(step, fallback: Optional[float]) -> Optional[float]:
    levels = [e["chance_level"] for e in step.per_image
              if e.get("image_class") is not None and e.get("chance_level") is not None]
    return sum(levels) / len(levels) if levels else fallback


def psnr_vs_step_png(report: Any) -> bytes:
    """Mean aligned PSNR per attack against the training step, the worst case over attacks and
    the chance level (:func:`psnr_vs_step_series`); the x axis is symmetric-log so step 0 and
    step 100 both show."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from audit.report.format import step_name

    report = Report.of(report)
    series = psnr_vs_step_series(report)
    steps = [s.step for s in report.steps]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    try:
        for aid, pts in series["curves"].items():
            style = "--" if aid in series["adaptive"] else "-"
            ax.plot(*zip(*pts), style, marker="o", ms=4, lw=1.2, label=plain_text(aid))
        if series["worst"]:
            ax.plot(*zip(*series["worst"]), color="black", lw=2.4, alpha=0.55, label="worst case")
        levels = {round(y, 9) for _, y in series["chance"]}
        if len(levels) == 1:
            draw_chance_level(ax, series["chance"][0][1], x=1.0, ha="right")
        elif levels:
            ax.plot(*zip(*series["chance"]), ":", color="tab:gray", marker=".", lw=1,
                    label="chance level (mean, aligned)")
        ax.set_xscale("symlog", linthresh=1)
        if steps:
            ax.set_xticks(steps)
            ax.set_xticklabels([str(s) for s in steps])
        ax.set_xlabel(step_name(report)["axis"])
        ax.set_ylabel(f"{series['quantity']} (dB), mean over private images")
        ax.set_title(f"{plain_text(report.defense['name'])}: reconstruction quality over training", fontsize=10)
        return png_bytes(fig, ax)
    finally:
        plt.close(fig)


def draw_chance_level(ax, level, *, x: float, ha: str) -> None:
    """The mean chance level (aligned PSNR of the best guess made without the update) as a
    dotted line labelled at axis position ``x``; nothing when there is none."""
    if level is None:
        return
    ax.axhline(level, color="tab:gray", ls=":", lw=1)
    ax.text(x, level, f" chance level {level:.1f} dB (mean, aligned)", color="tab:gray",
            transform=ax.get_yaxis_transform(), va="bottom", ha=ha, fontsize=8)


def png_bytes(fig, ax) -> bytes:
    """Grid, legend (when anything is labelled), tight layout; the figure as PNG bytes."""
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
