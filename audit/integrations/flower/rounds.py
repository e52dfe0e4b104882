"""The client's per-round report: every audited round's report combined into one, written in
the audit report's formats into the client's folder (``report.{json,md,html}``,
``psnr_vs_step.png`` with the round on the x axis).

Each finished round contributes its judged step (the round), its results, its (epsilon,
delta) and its fidelity (the real reply against the declared training); a round whose reply the
declared training does not reproduce contributes a "not judged" row, one that failed, timed
out or has not finished an "incomplete" row, each with the reason, so the overall verdict (the
worst judged round) never reads private for missing evidence. ``thresholds`` re-judges every
round's stored evidence under another leak rule.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from audit.core.errors import ConfigError, GiaError
from audit.integrations.flower.job import (FINISHED, LOG_FILE, NOT_JUDGED, PENDING, one_line, read_status,
                                           round_of, worker_alive, write_status)
from audit.report.audit_report import AuditReport, not_applicable
from audit.report.risk import (default_delta, empirical_risk, overall_verdict, step_verdict, summarize_attack,
                               worst_case)
from audit.report.rule import LeakRule
from audit.report.store import ResultStore

#: why a round without a final status has no verdict
NOT_FINAL = {"queued": "the audit has not started", "running": "the audit is still running",
             None: "no status recorded: the audit never started"}
NO_UTILITY = "not measured here: the mod audits the deployment's own model as the federation trains it"
LOG = logging.getLogger("gia_audit.flower")


@dataclass
class RoundPart:
    """One round as the combined report sees it: its folder, final state, and report data."""

    round: int
    folder: Path
    state: str
    reason: str
    data: Optional[Dict[str, Any]] = None
    key: Optional[str] = None
    fidelity: Optional[Dict[str, Any]] = None
    pixels: Optional[int] = None


def _read_round(folder: Path, rule: Optional[LeakRule]) -> RoundPart:
    status = read_status(folder)
    state = status.get("state")
    part = RoundPart(round_of(folder), folder, state or "unknown", status.get("reason") or NOT_FINAL.get(state, ""),
                     fidelity=status.get("fidelity"), pixels=status.get("pixels"))
    if state != FINISHED:
        return part
    try:
        store = ResultStore.open_latest(folder)
        part.data, part.key = AuditReport.from_store(store, rule).data, store.key
    except GiaError as err:
        part.state, part.reason = "failed", f"its report could not be read ({err})"
    return part


def _missing_step(part: RoundPart, attack_ids: List[str], rule: LeakRule, delta: float) -> Dict[str, Any]:
    reason = f"{part.state}: {part.reason}" if part.reason and not part.reason.startswith(part.state) else \
        (part.reason or part.state)
    judged = step_verdict([], rule, [{"attack": "the round's audit", "images": [], "why": reason, "reasons": [reason]}])
    # not judged where no attack ran (the reply is not what the description trains), else incomplete
    verdict = {**judged, "reason": reason, **({"label": NOT_JUDGED} if part.state == NOT_JUDGED else {})}
    return {"step": part.round, "attacks": {a: {**summarize_attack([]), "status": "not run"} for a in attack_ids},
            "worst_case": worst_case({}, rule, {}), "verdict": verdict, "risk": empirical_risk({}, delta)}


def _round_step(part: RoundPart, attack_ids: List[str]) -> Dict[str, Any]:
    step = dict(part.data["steps"][0])
    step["attacks"] = {a: step["attacks"].get(a) or {**summarize_attack([]), "status": "not planned"}
                       for a in attack_ids}
    step["originals"] = f"{part.folder.name}/runs/{part.key}/originals"
    return step


def _results(part: RoundPart) -> List[Dict[str, Any]]:
    prefix = f"{part.folder.name}/runs/{part.key}/"
    return [{**r, **({"png": prefix + r["png"]} if r.get("png") else {})} for r in part.data["results"]]


def _privacy(done: List[RoundPart]) -> Dict[str, Any]:
    accounted = [p.data["privacy"] for p in done if p.data["privacy"].get("applicable")]
    if not accounted:
        return done[-1].data["privacy"] if done else {"applicable": False, "reason": "no audited round finished"}
    return {**accounted[-1], "per_step": [row for p in accounted for row in p.get("per_step", [])]}


def _progress(done: List[RoundPart]) -> Dict[str, int]:
    """The finished rounds' results: done and to do, the results that do not apply apart."""
    out = {k: sum(p.data["progress"].get(k, 0) for p in done) for k in ("done", "total", "not_applicable")}
    if not out["not_applicable"]:
        out.pop("not_applicable")
    return out


def _status(parts: List[RoundPart]) -> str:
    missing = [f"round {p.round}: {p.state}" for p in parts if p.state != FINISHED]
    missing += [f"round {p.round}: {p.data['status']}" for p in parts
                if p.state == FINISHED and p.data["status"] != "complete"]
    return "complete" if not missing else f"incomplete ({'; '.join(missing)})"


def _empty(defense: str, rule: LeakRule, pixels: Optional[int]) -> Dict[str, Any]:
    """The report's sections when no round finished (``pixels``: values per image, for the
    risk radius, when a round recorded them)."""
    why = "no audited round finished"
    delta = default_delta(pixels) if pixels else float("nan")
    return {"defense": {"name": defense}, "differences": [], "threat_model": {}, "plan": {}, "attacks": [],
            "thresholds": rule.to_dict(), "false_positive_rate": {"unavailable": why}, "null": {},
            "chance_level": None, "risk_delta": {"delta": delta, "description": "per-pixel RMSE 0.1 (no round measured "
                                                                               "it: " + why + ")"},
            "metric_notes": [], "data": {}, "settings": {}, "seeds": {}, "versions": {}}


def _title(client: str, defense: str) -> str:
    return f"gia-audit per-round report of {client}: " + ("no defense" if defense == "none" else f"defense {defense}")


def _fidelity_lines(parts: List[RoundPart]) -> Dict[str, str]:
    """The threat model's line per round on the fidelity check."""
    out = {}
    for p in parts:
        f = p.fidelity
        if f:
            verdict = {True: "reproduced", False: "NOT reproduced", None: "not checked"}[f.get("reproduces")]
            out[f"fidelity, round {p.round}"] = f"{verdict}: {f.get('summary', '')} (tolerance: {f.get('tolerance')})"
    return out


def merge_rounds(parts: List[RoundPart], rule: Optional[LeakRule] = None, defense: str = "defense",
                 client: str = "the client") -> Dict[str, Any]:
    """The report data of the rounds ``parts`` (in order) as one per-round report."""
    done = [p for p in parts if p.data is not None]
    pixels = next((p.pixels for p in parts if p.pixels), None)
    base = done[-1].data if done else _empty(defense, rule or LeakRule(), pixels)
    rule = rule or LeakRule.from_dict(base.get("thresholds"))
    attack_ids = list(dict.fromkeys(a["id"] for p in done for a in p.data["attacks"]))
    attacks = list({a["id"]: a for p in done for a in p.data["attacks"]}.values())
    steps = [_round_step(p, attack_ids) if p.data is not None
             else _missing_step(p, attack_ids, rule, base["risk_delta"]["delta"]) for p in parts]
    levels = [p.data["chance_level"] for p in done if p.data.get("chance_level") is not None]
    failures = [f for p in done for f in p.data["failures"]] + [
        {"step": p.round, "attack": "", "image": "", "defense": base["defense"].get("name", defense),
         "status": p.state, "error": p.reason} for p in parts if p.data is None]
    return {
        **base,
        "title": _title(client, base["defense"].get("name", defense)),
        "step_name": "round",
        "generated": _dt.datetime.now().isoformat(timespec="seconds"),
        "run_key": ", ".join(f"round {p.round}: {p.key}" for p in done) or "none (no audited round finished)",
        "threat_model": {**base.get("threat_model", {}), **_fidelity_lines(parts)},
        "status": _status(parts),
        "progress": _progress(done),
        "not_applicable": not_applicable(steps),
        "verdict": overall_verdict(steps),
        "attacks": attacks,
        "privacy": _privacy(done),
        "chance_level": sum(levels) / len(levels) if levels else None,
        "utility": {"unavailable": NO_UTILITY},
        "timing": {f"round {p.round}": p.data.get("timing", {}) for p in done},
        "steps": steps,
        "failures": failures,
        "results": [r for p in done for r in _results(p)],
        "rounds": [{"round": p.round, "state": p.state, "reason": p.reason, "folder": p.folder.name,
                    "fidelity": p.fidelity, "verdict": p.data["verdict"]["label"] if p.data else
                    (NOT_JUDGED if p.state == NOT_JUDGED else "incomplete")} for p in parts],
    }


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One writer of the client's report at a time (rounds may finish together)."""
    try:
        import fcntl
    except ImportError:  # no advisory locks on this platform: the writes are atomic, the last one wins
        yield
        return
    with open(folder / ".report.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def round_folders(client_dir: Path) -> List[Path]:
    """The client's ``round-<r>`` folders, by round."""
    return sorted((p for p in Path(client_dir).iterdir() if p.is_dir() and round_of(p) is not None), key=round_of)


def combine_rounds(client_dir, thresholds: Any = None) -> AuditReport:
    """Combine the audited rounds in ``client_dir`` into its per-round report, write it there in
    every report format and return it; ``thresholds`` (a LeakRule, dict or ``"margin_db=2,..."``)
    re-judges the stored evidence."""
    client_dir = Path(client_dir)
    folders = round_folders(client_dir) if client_dir.is_dir() else []
    if not folders:
        inside = client_folders(client_dir)
        if inside:
            raise ConfigError(f"{client_dir} is the mod's output folder; point at one of its client folders: "
                              + ", ".join(str(p) for p in inside))
        raise ConfigError(f"{client_dir} holds no round-<r> folder; point at a client's folder of the mod's output "
                          "(OUT/<client>), after an audited round")
    rule = None if thresholds is None else LeakRule.of(thresholds)
    with _locked(client_dir):
        parts = [_read_round(f, rule) for f in folders]
        defense = next((read_status(f).get("defense") for f in folders if read_status(f).get("defense")), "defense")
        report = AuditReport(merge_rounds(parts, rule, defense, client_dir.name), run_dir=client_dir, out=client_dir)
        report.write(client_dir)
    return report


def finish_round(folder: Path, **final: Any) -> None:
    """Write the round's final status, then rebuild the client's per-round report from it; the
    status says ``report: pending`` until the report is written (what :func:`wait_for_audits`
    waits for)."""
    write_status(folder, report="pending", **final)
    try:
        combine_rounds(folder.parent)
        write_status(folder, report="written")
    except Exception as err:  # the round's own report and status are written; say why the summary is not
        write_status(folder, report=f"not written: {one_line(err)}")
        LOG.warning("gia-audit: the per-round report of %s was not rebuilt: %s", folder.parent, one_line(err))


def _settle(folder: Path, status: Dict[str, Any]) -> Dict[str, Any]:
    """A pending round whose background process is gone ends failed (it died without a status)."""
    if status.get("state") in PENDING and worker_alive(folder) is False:
        finish_round(folder, state="failed", reason=f"the audit process ended without a final status; see its "
                                                    f"{LOG_FILE}")
        return read_status(folder)
    return status


def client_folders(out) -> List[Path]:
    """The client folders under the mod's output folder ``out`` (those holding an audited round)."""
    out = Path(out)
    return sorted(p for p in out.iterdir() if p.is_dir() and round_folders(p)) if out.is_dir() else []


def wait_for_audits(out, timeout: Optional[float] = None, poll: float = 1.0) -> Dict[str, str]:
    """Wait until no audited round under ``out`` is queued, running or has its client's report
    still to write (at most ``timeout`` seconds); the state of every round folder, by path."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        statuses = {str(f): _settle(f, read_status(f)) for c in client_folders(out) for f in round_folders(c)}
        busy = any(s.get("state") in PENDING or s.get("report") == "pending" for s in statuses.values())
        if not busy or (deadline is not None and time.monotonic() > deadline):
            return {path: s.get("state", "unknown") for path, s in statuses.items()}
        time.sleep(poll)
