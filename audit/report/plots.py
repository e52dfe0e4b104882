"""Matplotlib figures of the report (rendered off-screen to PNG bytes)."""
from __future__ import annotations

import io
from typing import Any, Dict


def psnr_vs_step_png(data: Dict[str, Any]) -> bytes:
    """Mean PSNR per attack against the training step, the worst case over attacks, and the
    mean chance level of the private images; the x axis is symmetric-log so step 0 and step 100 both show."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from audit.report.format import step_name

    steps = [s["step"] for s in data["steps"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    try:
        for attack in data["attacks"]:
            aid = attack["id"]
            ys = [s["attacks"].get(aid, {}).get("psnr") for s in data["steps"]]
            pts = [(x, y) for x, y in zip(steps, ys) if y is not None]
            if pts:
                style = "--" if attack.get("kind") == "adaptive" else "-"
                ax.plot(*zip(*pts), style, marker="o", ms=4, lw=1.2, label=aid)
        worst = [(x, s["worst_case"]["psnr"]) for x, s in zip(steps, data["steps"])
                 if s["worst_case"]["psnr"] is not None]
        if worst:
            ax.plot(*zip(*worst), color="black", lw=2.4, alpha=0.55, label="worst case")
        draw_chance_level(ax, data.get("chance_level"), x=1.0, ha="right")
        ax.set_xscale("symlog", linthresh=1)
        if steps:
            ax.set_xticks(steps)
            ax.set_xticklabels([str(s) for s in steps])
        ax.set_xlabel(step_name(data)["axis"])
        ax.set_ylabel("PSNR (dB), mean over private images")
        ax.set_title(f"{data['defense']['name']}: reconstruction quality over training", fontsize=10)
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
