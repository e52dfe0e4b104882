"""The risk report: built from a run's result store, written as ``report.json``,
``report.md``, ``report.html`` (self-contained) and ``psnr_vs_step.png``.

``render(DIR)`` re-renders a finished (or interrupted) audit from disk; this is what
``gia-audit report DIR`` calls.
"""
from __future__ import annotations

import datetime as _dt
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional

from audit.core.errors import ConfigError
from audit.report.risk import Thresholds, empirical_risk, overall_verdict, step_verdict, summarize_attack, worst_case
from audit.report.store import ResultStore, atomic_write_bytes, atomic_write_json, to_jsonable

REPORT_FILES = ("report.json", "report.md", "report.html", "psnr_vs_step.png")


def build_report(manifest: Dict[str, Any], records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Every number of the report, as one JSON-able dictionary."""
    thresholds = Thresholds(**{k: v for k, v in manifest.get("thresholds", {}).items() if k != "rule"})
    delta = manifest["risk_delta"]["delta"]
    attack_ids = [a["id"] for a in manifest["attacks"]]
    by_step: Dict[int, Dict[str, List[Dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for rec in records:
        by_step[rec["step"]][rec["attack_id"]].append(rec)
    steps = []
    for step in manifest["steps"]:
        by_attack = {a: by_step[step].get(a, []) for a in attack_ids}
        wc = worst_case(by_attack, thresholds)
        steps.append({
            "step": step,
            "attacks": {a: summarize_attack(recs) for a, recs in by_attack.items()},
            "worst_case": wc,
            "risk": empirical_risk(by_attack, delta),
            "verdict": step_verdict(wc["per_image"]),
        })
    total = len(manifest["steps"]) * len(attack_ids) * int(manifest["images"])
    done = sum(1 for r in records if r["step"] in manifest["steps"] and r["attack_id"] in attack_ids)
    failures = list(manifest.get("failures", [])) + [
        {"step": r["step"], "attack": r["attack_id"], "image": r["image"],
         "defense": r.get("defense"), "error": r.get("reason", "")}
        for r in records if r["status"] == "error"
    ]
    return to_jsonable({
        "title": f"gia-audit report: {manifest['defense']['name']}",
        "generated": _dt.datetime.now().isoformat(timespec="seconds"),
        "run_key": manifest.get("run_key"),
        "status": manifest.get("status", "unknown"),
        "progress": {"done": done, "total": total},
        "verdict": overall_verdict(steps),
        "defense": manifest["defense"],
        "threat_model": manifest.get("threat_model", {}),
        "plan": manifest.get("plan", {}),
        "attacks": manifest["attacks"],
        "thresholds": thresholds.as_dict(),
        "risk_delta": manifest["risk_delta"],
        "metric_notes": manifest.get("metric_notes", []),
        "utility": manifest.get("utility", {}),
        "data": manifest.get("data", {}),
        "settings": manifest.get("settings", {}),
        "seeds": manifest.get("seeds", {}),
        "versions": manifest.get("versions", {}),
        "timing": manifest.get("timing", {}),
        "steps": steps,
        "failures": failures,
        "results": records,
    })


class AuditReport:
    """The result of an audit: ``data`` holds every number (the content of ``report.json``).

    ``report.verdict``, ``report.steps`` and ``report.psnr(step, attack)`` give quick access;
    ``report.write(out)`` writes the JSON, Markdown, HTML and plot files.
    """

    def __init__(self, data: Dict[str, Any], run_dir: Optional[Path] = None, out: Optional[Path] = None):
        self.data = data
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.out = Path(out) if out is not None else None

    @classmethod
    def from_store(cls, store: ResultStore) -> "AuditReport":
        manifest = store.load_manifest()
        if "attacks" not in manifest:
            raise ConfigError(f"the audit in {store.root} (run {store.key}) stopped before its attacks were "
                              "planned; rerun the same audit command to continue it")
        return cls(build_report(manifest, store.records()), store.dir, store.root)

    # ------------------------------------------------------------------ access
    @property
    def verdict(self) -> str:
        return self.data["verdict"]["label"]

    @property
    def steps(self) -> List[Dict[str, Any]]:
        return self.data["steps"]

    @property
    def failures(self) -> List[Dict[str, Any]]:
        return self.data["failures"]

    def step(self, step: int) -> Dict[str, Any]:
        for entry in self.steps:
            if entry["step"] == step:
                return entry
        raise KeyError(f"step {step} was not audited; audited steps: {[s['step'] for s in self.steps]}")

    def psnr(self, step: int, attack: Optional[str] = None) -> Optional[float]:
        """Mean PSNR of ``attack`` at ``step`` (default: the worst case over attacks)."""
        entry = self.step(step)
        return entry["worst_case"]["psnr"] if attack is None else entry["attacks"][attack]["psnr"]

    # ------------------------------------------------------------------ output
    def to_markdown(self) -> str:
        from audit.report.markdown import render_markdown

        return render_markdown(self.data)

    def to_html(self) -> str:
        from audit.report.html import render_html

        return render_html(self.data, self.run_dir)

    def plot_png(self) -> bytes:
        from audit.report.plots import psnr_vs_step_png

        return psnr_vs_step_png(self.data)

    def write(self, out: Optional[os.PathLike | str] = None) -> Dict[str, Path]:
        """Write ``report.json``, ``report.md``, ``report.html`` and ``psnr_vs_step.png``."""
        out = Path(out) if out is not None else self.out
        if out is None:
            raise ValueError("AuditReport.write needs an output directory")
        out.mkdir(parents=True, exist_ok=True)
        paths = {name: out / name for name in REPORT_FILES}
        atomic_write_bytes(paths["psnr_vs_step.png"], self.plot_png())
        atomic_write_json(paths["report.json"], self.data)
        atomic_write_bytes(paths["report.md"], self.to_markdown().encode())
        atomic_write_bytes(paths["report.html"], self.to_html().encode())
        self.out = out
        return paths

    def summary(self) -> str:
        """A few lines for the terminal."""
        lines = [f"{self.data['title']}  [{self.data['status']}, "
                 f"{self.data['progress']['done']}/{self.data['progress']['total']} results]"]
        for entry in self.steps:
            wc, risk = entry["worst_case"], entry["risk"]
            psnr = "n/a" if wc["psnr"] is None else f"{wc['psnr']:.2f} dB"
            success = "n/a" if risk["success"] is None else f"{risk['success']:.0%}"
            lines.append(f"  step {entry['step']:>5}: worst-case PSNR {psnr}, within delta {success}, "
                         f"verdict: {entry['verdict']['label']}")
        lines.append(f"verdict: {self.verdict}")
        if self.failures:
            lines.append(f"{len(self.failures)} failure(s); see the report's 'Failures' section")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"AuditReport(verdict={self.verdict!r}, steps={[s['step'] for s in self.steps]}, out={self.out})"

    def _repr_html_(self) -> str:  # notebooks
        return self.to_html()


def render(out: os.PathLike | str, run: Optional[str] = None) -> AuditReport:
    """Re-render the report of the audit stored in ``out`` (``run``: a run key; default latest)."""
    report = AuditReport.from_store(ResultStore.open_latest(out, run))
    report.write(out)
    return report
