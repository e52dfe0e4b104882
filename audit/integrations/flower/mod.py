"""The Flower client mod: on an audited round, audit the global model the client received with
the client's own data and defense; hand back the client's reply untouched.

Add it to the ``ClientApp`` (``ClientApp(mods=[AuditMod(...)])``, or ``@app.train(mods=[...])``).
On a train message of an audited round it copies the arriving state, lets the client train,
draws the audited images from ``data(context)`` and writes the round's job under
``OUT/<client>/round-<r>/`` (:mod:`audit.integrations.flower.job`); the audit then runs in a
background process (or inline with ``blocking=True``) and writes the same report as
``gia-audit audit`` with the round in place of the training step, plus the client's per-round
report in ``OUT/<client>/``. The reply is the object the client returned, never read nor
changed, and nothing of the audit is sent anywhere: the reports stay in ``OUT`` on the
client's machine. Any failure of the audit is recorded in the round's report as incomplete
and logged; it never fails the client's round.
"""
from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Optional

from audit.core.errors import ConfigError
from audit.integrations.flower.defenses import flower_defense, is_flower_mod
from audit.integrations.flower.job import (LOG_FILE, PID_FILE, RoundJob, client_images, one_line, round_dir,
                                           save_job, write_status)
from audit.integrations.flower.rounds import finish_round
from audit.integrations.flower.settings import mod_settings
from audit.integrations.flower.worker import run_round

LOG = logging.getLogger("gia_audit.flower")
# the launcher: start argv[3:] in a new session, its output appended to the log argv[1], its
# process id written to argv[2], and exit
DETACH = ("import subprocess, sys; p = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL, "
          "stdout=open(sys.argv[1], 'ab'), stderr=subprocess.STDOUT, start_new_session=True); "
          "open(sys.argv[2], 'w').write(str(p.pid))")


class AuditMod:
    """A Flower client mod ``(msg, context, call_next) -> Message`` that audits the global
    model of the ``rounds`` given (``docs/flower.md`` has every option with its default).

    ``model``: the deployment's model: a factory (``model_args`` its keywords),
    ``"package.module:attr"`` or an ``nn.Module``; ``model_normalize``: the inputs it expects
    ("none": the images as ``data`` returns them, or ``"m1,m2,m3/s1,s2,s3"``); ``num_classes``:
    the model's output width unless given. ``data``: ``data(context) -> (images, labels)``, the
    client's images ``(N, C, H, W)`` in [0, 1], or None to leave this client unaudited;
    ``images`` batches of ``batch_size`` are audited, up to ``reference`` others are the null
    and the attacker's auxiliary data. ``defense``: as for ``gia-audit audit`` (a built-in name
    with ``defense_args``, a Defense, any defended-gradient callable, ``"package.module:attr"``),
    or the Flower privacy mod the ``ClientApp`` runs, mirrored at its settings; ``lr``: the
    client's local learning rate (update = -lr x gradient). ``budget``, ``attacks``,
    ``attack_args``, ``thresholds``, ``client_mode``, ``share_labels``, ``defense_timeout``,
    ``seed``, ``device``: as for ``gia-audit audit``. ``out``: the output folder on the
    client's machine. ``blocking``: audit inline before the reply is returned (default: a
    detached process after it). ``timeout``: seconds before a round's audit is given up and
    reported incomplete (a background audit is stopped; an inline one's thread is left to end
    on its own, its round stays timed out). ``threads``: torch threads of a background audit.
    ``arrays_key`` / ``round_key``: the train message's ArrayRecord (when it holds several) and
    the ConfigRecord key of the round (Flower's strategies send ``server-round``).
    """

    def __init__(self, *, rounds: Any, model: Any, data: Callable, **options: Any):
        known = set(inspect.signature(mod_settings).parameters)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown AuditMod option(s) {', '.join(unknown)}; valid options: "
                              f"{', '.join(sorted(known))}")
        self.data = data
        self.settings = mod_settings(rounds=rounds, model=model, data=data, **options)

    # ------------------------------------------------------------------ the mod
    def __call__(self, msg: Any, context: Any, call_next: Any) -> Any:
        began = time.perf_counter()
        planned = self._plan(msg)
        planned_s = time.perf_counter() - began
        reply = call_next(msg, context)
        if planned is not None:
            self._start(planned, msg, context, planned_s)
        return reply

    def _plan(self, msg: Any) -> Optional[Dict[str, Any]]:
        """The round and a copy of the arriving state when ``msg`` is a train message of an
        audited round (before the client trains, which may consume the message's arrays)."""
        try:
            if not str(msg.metadata.message_type).startswith("train"):
                return None
            round_ = self._round(msg)
            if round_ not in self.settings.rounds:
                return None
            return {"round": round_, "state": self._state(msg)}
        except Exception as err:  # reading the message must never fail the client's round
            LOG.warning("gia-audit: no audit of this train message: %s", one_line(err))
            return None

    def _round(self, msg: Any) -> Optional[int]:
        for record in msg.content.config_records.values():
            if self.settings.round_key in record:
                return int(record[self.settings.round_key])
        return None

    def _state(self, msg: Any) -> Dict[str, Any]:
        records = msg.content.array_records
        key = self.settings.arrays_key
        if key is None:
            if len(records) != 1:
                raise ValueError(f"the train message holds {len(records)} ArrayRecords ({', '.join(records)}); give "
                                 "the mod arrays_key=")
            key = next(iter(records))
        return {k: v.clone() for k, v in records[key].to_torch_state_dict().items()}

    # ------------------------------------------------------------------ the round's audit
    def _start(self, planned: Dict[str, Any], msg: Any, context: Any, planned_s: float) -> None:
        """Prepare the round's audit and start it; ``planned_s``: the seconds :meth:`_plan` took."""
        began = time.perf_counter()
        round_, client = planned["round"], client_name(context)
        folder = round_dir(self.settings.out, client, round_)
        try:
            got = self.data(context)
            if got is None:  # the data function leaves this client (or this round) unaudited
                return
            folder.mkdir(parents=True, exist_ok=True)
            spec, args = self._defense(msg)
            write_status(folder, fresh=True, state="queued", round=round_, client=client, defense=_name(spec))
            private, reference = client_images(got, self.settings)
            origin = (f"round {round_}: the global model the server sent to this client ({client}) in the train "
                      "message of that round, loaded into the deployment's model")
            save_job(folder, RoundJob(round_, client, origin, self.settings, spec, args, private, reference),
                     planned["state"])
            # what the mod adds to the client's round before the audit starts
            write_status(folder, prepared_s=round(planned_s + time.perf_counter() - began, 3))
            if self.settings.blocking:
                run_round(folder)
            else:
                self._spawn(folder)
        except Exception as err:  # recorded as the round's result; the client's round goes on
            LOG.warning("gia-audit: the audit of round %s (%s) failed: %s", round_, client, one_line(err))
            try:
                finish_round(folder, state="failed", round=round_, client=client, reason=one_line(err))
            except Exception as report_err:
                LOG.warning("gia-audit: and its failure could not be recorded: %s", one_line(report_err))

    def _defense(self, msg: Any):
        s = self.settings
        if is_flower_mod(s.defense):
            return flower_defense(s.defense, msg, s.fl.lr)
        return s.defense, dict(s.defense_args)

    def _spawn(self, folder) -> None:
        """Start the round's audit as a detached process: a launcher starts it in its own
        process group and exits, so the audit outlives the client process (a simulation's
        workers end, and take their children with them, when the federation does)."""
        threads = str(self.settings.threads)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "GIA_AUDIT_THREADS": threads,
               "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        subprocess.run([sys.executable, "-I", "-S", "-c", DETACH, str(folder / LOG_FILE), str(folder / PID_FILE),
                        sys.executable, "-m", "audit.integrations.flower", str(folder)], env=env, check=True,
                       timeout=120, stdin=subprocess.DEVNULL, capture_output=True)

def client_name(context: Any) -> str:
    """The client's folder name: its partition in a simulation, else its node id."""
    partition = (getattr(context, "node_config", None) or {}).get("partition-id")
    return f"partition-{partition}" if partition is not None else f"node-{context.node_id}"


def _name(spec: Any) -> str:
    return spec if isinstance(spec, str) else getattr(spec, "name", None) or getattr(spec, "__name__", type(spec).__name__)
