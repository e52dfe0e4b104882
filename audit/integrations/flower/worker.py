"""Run the audit of one round (:mod:`audit.integrations.flower.job`) under its timeout.

``python -m audit.integrations.flower ROUND_DIR`` is the background process the mod
starts; :func:`run_round` is also what the blocking mode calls inline. Whatever happens, the
round's status ends as ``finished``, ``failed`` (with the error) or ``timed out``, and the
client's per-round report is rebuilt: a failed or timed-out round reads "incomplete", never
private.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict

import torch

from audit.core.data import Dataset
from audit.engine.settings import AttackSettings, DataSettings, ModelSettings, OutputSettings
from audit.engine.state import audit_state
from audit.integrations.flower.job import FINISHED, JOB, STATE, RoundJob, load_job, one_line, write_status
from audit.integrations.flower.rounds import finish_round


def _classes(job: RoundJob, model: ModelSettings, shape) -> int:
    """The class count: the mod's ``num_classes``, else the width of the model's output."""
    if job.settings.num_classes is not None:
        return job.settings.num_classes
    from audit.core.model_source import build_audited_model

    net = build_audited_model(model.model, model.args, shape, 2, mean=(0.5,) * shape[0], std=(0.5,) * shape[0],
                              normalize="none")
    with torch.no_grad():
        return int(net.eval()(job.reference[0][:1]).shape[-1])


def client_dataset(job: RoundJob, model: ModelSettings) -> Dataset:
    """The round's data set: the audited images as its test split, the reference images as its
    train split (the null and the attacker's auxiliary data)."""
    (xp, yp), (xr, yr) = job.private, job.reference
    classes = _classes(job, model, tuple(xr.shape[1:]))
    mean, std = xr.mean((0, 2, 3)), xr.std((0, 2, 3)).clamp_min(1e-6)
    return Dataset(f"flower client {job.client}", xr, yr, xp, yp, [str(c) for c in range(classes)],
                   tuple(mean.tolist()), tuple(std.tolist()))


def audit_job(job: RoundJob, folder: Path):
    """The engine's audit of the round's state with the client's images; its report."""
    s = job.settings
    model = ModelSettings(s.model.model, s.model.args, s.model.normalize, checkpoint=folder / STATE)
    data = DataSettings(client_dataset(job, model), images=s.data.images, batch_size=s.data.batch_size,
                        share_labels=s.data.share_labels)
    return audit_state(job.defense, model, job.round, origin=job.origin, defense_args=job.defense_args,
                       data_settings=data, fl_settings=s.fl,
                       attack_settings=AttackSettings((job.round,), s.attacks.names, s.attacks.args, s.attacks.budget),
                       output_settings=OutputSettings(folder, False, thresholds=s.output.thresholds, progress=False,
                                                      defense_timeout=s.output.defense_timeout),
                       seed=s.seed, device=s.device)


def _attempt(job: RoundJob, folder: Path, outcome: Dict[str, Any]) -> None:
    try:
        report = audit_job(job, folder)
        outcome.update(verdict=report.verdict, report_status=report.data["status"])
    except Exception as err:  # any failure of the audit is the round's result, never the client's
        outcome["error"] = one_line(err)


def run_round(folder: Path) -> str:
    """Audit the job in ``folder`` under its timeout; write the final status, rebuild the
    client's per-round report; the final state."""
    folder = Path(folder)
    started = time.time()
    try:
        job = load_job(folder)
    except Exception as err:
        finish_round(folder, state="failed", reason=f"the round's job could not be read ({one_line(err)})")
        return "failed"
    write_status(folder, state="running", pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    outcome: Dict[str, Any] = {}
    thread = threading.Thread(target=_attempt, args=(job, folder, outcome), daemon=True,
                              name=f"gia-audit round {job.round}")
    thread.start()
    thread.join(job.settings.timeout)
    if thread.is_alive():
        final = {"state": "timed out", "reason": f"the audit ran past its timeout of {job.settings.timeout:g} s"}
    elif "error" in outcome:
        final = {"state": "failed", "reason": outcome["error"]}
    else:
        final = {"state": FINISHED, "reason": "", **outcome}
    (folder / JOB).unlink(missing_ok=True)
    finish_round(folder, seconds=round(time.time() - started, 1), **final)
    return final["state"]


def main(argv=None) -> None:
    """The background process: one round, on ``GIA_AUDIT_THREADS`` torch threads; it exits
    as soon as the round's status is final (an audit past its timeout is stopped with it)."""
    args = sys.argv[1:] if argv is None else argv
    torch.set_num_threads(int(os.environ.get("GIA_AUDIT_THREADS", "1")))
    state = run_round(Path(args[0]))
    print(f"gia-audit: round audit {state}", flush=True)
    sys.stderr.flush()
    os._exit(0)
