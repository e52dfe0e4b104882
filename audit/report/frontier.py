"""The sweep's frontier plot: worst-case PSNR against mean test accuracy, one line per
defense (one point per setting), the accuracy's seed-to-seed spread as error bars (± one
standard deviation; the min-max range as a thin line), runs that diverged marked, the
undefended point, Pareto-optimal points ringed (the noise-aware rule of
:data:`~audit.report.sweep_report.DOMINANCE_RULE`)
(rendered off-screen to PNG bytes)."""
from __future__ import annotations

from typing import Any

from audit.report.plots import plain_text, png_bytes
from audit.report.sweep_record import Sweep


def _short(setting: str) -> str:
    """``ratio=0.9`` -> ``0.9`` (one parameter); several stay ``k=v`` pairs."""
    parts = setting.split(", ")
    return parts[0].partition("=")[2] if len(parts) == 1 and "=" in parts[0] else setting


def _spread(ax, cells, color) -> None:
    """± one standard deviation (capped bars) and the min-max range (a thin line) of each cell's accuracy."""
    for c in cells:
        if c.accuracy_min is not None and c.accuracy_max is not None:
            ax.plot([c.accuracy_min, c.accuracy_max], [c.psnr] * 2, color=color, lw=0.6, alpha=0.6)
        if c.accuracy_std is not None:
            ax.errorbar([c.accuracy], [c.psnr], xerr=[c.accuracy_std], fmt="none", ecolor=color,
                        elinewidth=1.2, capsize=3)


def frontier_png(sweep: Any) -> bytes:
    """The frontier of ``sweep`` (a :class:`~audit.report.sweep_record.Sweep`, or its JSON object)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    sweep = Sweep.from_dict(sweep)
    cells = [c for c in sweep.cells if c.psnr is not None and c.accuracy is not None]
    fig, ax = plt.subplots(figsize=(6.8, 4.4), dpi=110)
    try:
        for family in sweep.defenses:
            pts = [c for c in cells if c.defense == family and not c.undefended]
            if not pts:
                continue
            line, = ax.plot([c.accuracy for c in pts], [c.psnr for c in pts], "-o", ms=5, lw=1.3, label=plain_text(family))
            _spread(ax, pts, line.get_color())
            for c in pts:
                ax.annotate(plain_text(_short(c.setting)), (c.accuracy, c.psnr), textcoords="offset points",
                            xytext=(4, 4), fontsize=7, color=line.get_color())
        for c in (c for c in cells if c.undefended):
            ax.plot([c.accuracy], [c.psnr], "*", color="black", ms=13, label="undefended")
            _spread(ax, [c], "black")
        diverged = [c for c in cells if c.diverged_runs]
        if diverged:
            ax.scatter([c.accuracy for c in diverged], [c.psnr for c in diverged], marker="x", s=60,
                       color="tab:red", label="training diverged (seeds scored on what they left)", zorder=4)
        pareto = [c for c in cells if c.pareto]
        if pareto:
            ax.scatter([c.accuracy for c in pareto], [c.psnr for c in pareto], s=190, facecolors="none",
                       edgecolors="black", linewidths=1.1, label="Pareto-optimal", zorder=3)
        step = sweep.step
        ax.set_ylabel("worst-case PSNR (dB)" + (" at each cell's worst step" if step == "worst" else f" at step {step}"))
        steps = sweep.settings.get("utility_steps")
        seeds = sweep.settings.get("utility_seeds")
        ax.set_xlabel((f"test accuracy after {steps} FL rounds with the defense" if steps else "test accuracy")
                      + (f" (mean ± std over {seeds} seeds)" if seeds else ""))
        ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_title("privacy-utility frontier (lower and to the right is better)", fontsize=10)
        if not cells:
            ax.text(0.5, 0.5, "no cell has both a PSNR and an accuracy yet", transform=ax.transAxes, ha="center")
        return png_bytes(fig, ax)
    finally:
        plt.close(fig)
