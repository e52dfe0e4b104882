"""Run the audit of one round (:mod:`audit.integrations.flower.job`) under its timeout.

``python -m audit.integrations.flower ROUND_DIR`` is the background process the mod
starts; :func:`run_round` is also what the blocking mode calls inline. The fidelity check
runs first: a reply the declared training does not reproduce is ``not judged`` and no attack
runs. Whatever happens, the round's status ends as ``finished``, ``not judged``, ``failed``
(with the error) or ``timed out``, and the client's per-round report is rebuilt: such a round
never reads private. An inline audit past its timeout is cancelled (it stops at its next
progress report) and whatever it writes after that is discarded.
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
from audit.engine.clients import defense_seed
from audit.engine.settings import ModelSettings
from audit.integrations.flower.fidelity import (NOT_REPRODUCED, Fidelity, compare, replay,
                                                tolerance_text, unverifiable)
from audit.integrations.flower.job import (FINISHED, JOB, NOT_JUDGED, STATE, RoundJob, load_job, one_line,
                                           read_status, write_status)
from audit.integrations.flower.reply import NamedArrays, deployment_module, digest, named_arrays
from audit.integrations.flower.round_audit import Cancelled, ReplyAudit, audit_config_of
from audit.integrations.flower.rounds import finish_round

GRACE_S = 30.0  # how long a cancelled inline audit is given to stop before the round is finalised
LATE = ("report.md", "report.html", "report.json", "psnr_vs_step.png")  # what a late audit may write


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
    """The round's data set: the trained images as its test split (the audited batch), the
    reference images as its train split (the null and the attacker's auxiliary data)."""
    (xp, yp), (xr, yr) = job.trained, job.reference
    classes = _classes(job, model, tuple(xr.shape[1:]))
    mean, std = xr.mean((0, 2, 3)), xr.std((0, 2, 3)).clamp_min(1e-6)
    return Dataset(f"flower client {job.client}", xr, yr, xp, yp, [str(c) for c in range(classes)],
                   tuple(mean.tolist()), tuple(std.tolist()))


def round_audit(job: RoundJob, folder: Path, cancel: threading.Event) -> ReplyAudit:
    """The engine's audit of the round's reply (built, not run)."""
    s = job.settings
    model = ModelSettings(s.model.model, s.model.args, s.model.normalize, checkpoint=folder / STATE)
    job.dataset = client_dataset(job, model)
    config = audit_config_of(job, folder).replace(shares="state" if _has_buffers(job, s.model.model) else None)
    return ReplyAudit.from_config(config, round=job.round, origin=job.origin, global_arrays=job.global_arrays,
                                  reply=job.reply, trained=job.trained, reply_key=digest(job.reply), cancel=cancel)


def _has_buffers(job: RoundJob, spec) -> bool:
    from audit.core.buffers import has_running_stats
    from audit.core.model_source import build_audited_model

    shape = tuple(job.trained[0].shape[1:])
    net = build_audited_model(spec, job.settings.model.args, shape, job.dataset.num_classes, mean=(0.5,) * shape[0],
                              std=(0.5,) * shape[0], normalize="none")
    return has_running_stats(net) and bool(named_arrays(job.reply, net, "the reply").buffers)


def fidelity(audit: ReplyAudit, job: RoundJob) -> Fidelity:
    """The real reply against the declared training replayed from the global state
    (:mod:`audit.integrations.flower.fidelity`)."""
    defense, fl = audit.defense, audit.fl_settings
    whole = getattr(defense, "whole_update", False)
    if not whole and getattr(defense, "stochastic", True):
        return unverifiable(f"the defense {defense.name!r} is stochastic and declares no noise model the reply can be "
                            "checked against")
    net = deployment_module(audit.model)
    before = named_arrays(job.global_arrays, net, "the train message")
    real = named_arrays(job.reply, net, "the reply")
    x, y = job.trained
    # a Flower mod is replayed without its noise (its clipping of the whole reply included): the residual is the noise
    replayed = replay(audit.model, x.to(audit.device), y.to(audit.device),
                      defense=defense.without_noise() if whole else defense, training=fl.client, round=job.round,
                      seed=defense_seed(audit.seed, job.round, 0))
    replayed = NamedArrays({n: v.cpu() for n, v in replayed.weights.items()},
                           {n: v.cpu() for n, v in replayed.buffers.items() if n in real.buffers and n in before.buffers},
                           {})
    noise = float(getattr(defense, "noise_std", 0.0)) if whole else 0.0
    return compare(before, real, replayed, noise)


def _attempt(job: RoundJob, folder: Path, outcome: Dict[str, Any], cancel: threading.Event) -> None:
    try:
        audit = round_audit(job, folder, cancel)
        check = fidelity(audit, job)
        outcome["fidelity"] = {**check.to_dict(), "summary": check.summary()}
        if not check.reproduces:
            why = check.summary() if check.reproduces is False else check.reason
            outcome["not_judged"] = f"{NOT_REPRODUCED} ({why})"
            return
        audit.extra_threat = {"fidelity": f"the declared training reproduces the reply: {check.summary()} "
                                          f"(tolerance: {tolerance_text(check.noise is not None)})"}
        report = audit.run()
        outcome.update(verdict=report.data["verdict"], report_status=report.data["status"])
    except Cancelled:
        outcome["error"] = "cancelled"
    except Exception as err:  # any failure of the audit is the round's result, never the client's
        outcome["error"] = one_line(err)
    finally:
        if cancel.is_set():  # a late result of an abandoned audit: discarded
            for name in LATE:
                (folder / name).unlink(missing_ok=True)


def run_round(folder: Path) -> str:
    """Audit the job in ``folder`` under its timeout; write the final status, rebuild the
    client's per-round report; the final state."""
    folder = Path(folder)
    started = time.time()
    try:
        job = load_job(folder)
    except Exception as err:
        recorded = read_status(folder)
        if recorded.get("state") == "failed":  # the mod recorded why before the job was written
            finish_round(folder, state="failed", reason=recorded.get("reason", ""))
            return "failed"
        finish_round(folder, state="failed", reason=f"the round's job could not be read ({one_line(err)})")
        return "failed"
    write_status(folder, state="running", pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%S"))
    outcome: Dict[str, Any] = {}
    cancel = threading.Event()
    thread = threading.Thread(target=_attempt, args=(job, folder, outcome, cancel), daemon=True,
                              name=f"gia-audit round {job.round}")
    thread.start()
    thread.join(job.settings.timeout)
    if thread.is_alive():
        cancel.set()
        thread.join(GRACE_S)
        final = {"state": "timed out", "reason": f"the audit ran past its timeout of {job.settings.timeout:g} s"
                                                 + ("" if not thread.is_alive() else "; it was cancelled")}
        final.update({k: v for k, v in outcome.items() if k == "fidelity"})
    elif "error" in outcome:
        final = {"state": "failed", "reason": outcome["error"], **({"fidelity": outcome["fidelity"]}
                                                                     if "fidelity" in outcome else {})}
    elif "not_judged" in outcome:
        final = {"state": NOT_JUDGED, "reason": outcome["not_judged"], "fidelity": outcome["fidelity"]}
    else:
        verdict = outcome["verdict"]
        final = {"state": FINISHED, "reason": "", "fidelity": outcome["fidelity"], "report_status":
                 outcome["report_status"], "verdict": verdict.get("label"), "verdict_reason": verdict.get("reason", "")}
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
