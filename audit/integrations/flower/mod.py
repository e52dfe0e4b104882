"""The Flower client mod: on an audited round, audit the reply the client sends (after the
mods inside this one) against the images it trained on; hand the reply back untouched.

Add it to the ``ClientApp`` first (``ClientApp(mods=[AuditMod(...), LocalDpMod(...)])``, or
``@app.train(mods=[...])``). On a train message of an audited round it copies the arriving
state, lets the client train, copies the outgoing reply's arrays, asks ``data`` for the
client's images and the rows the round trained on, and writes the round's job under
``OUT/<client>/round-<r>/`` (:mod:`audit.integrations.flower.job`); the audit then runs in a
background process (or inline with ``blocking=True``): first the fidelity check
(:mod:`audit.integrations.flower.fidelity`), then the engine's attacks on the reply. The reply
is the object the client returned, never changed; nothing of the audit is sent anywhere, and
the client's global random states are left as they were. Any failure of the audit is
recorded in the round's report as incomplete, logged once on Flower's logger, and never fails
the client's round.
"""
from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Optional

from audit.core.errors import ConfigError, DataError
from audit.integrations.flower.defenses import clipping_failure, flower_defense, is_flower_mod
from audit.integrations.flower.job import (FINISHED, LOG_FILE, PENDING, PID_FILE, RoundJob, one_line, read_status,
                                           round_dir, round_images, save_job, write_status)
from audit.integrations.flower.randomness import preserved_random_state
from audit.integrations.flower.reply import message_arrays, named_arrays
from audit.integrations.flower.rounds import finish_round, round_folders
from audit.integrations.flower.settings import deployment_model, in_mod_terms, mod_settings
from audit.integrations.flower.worker import run_round

LOG = logging.getLogger("flwr")  # Flower's logger: the client's log
# the launcher: start argv[3:] in a new session, its output appended to the log argv[1], its
# process id written to argv[2], and exit
DETACH = ("import subprocess, sys; p = subprocess.Popen(sys.argv[3:], stdin=subprocess.DEVNULL, "
          "stdout=open(sys.argv[1], 'ab'), stderr=subprocess.STDOUT, start_new_session=True); "
          "open(sys.argv[2], 'w').write(str(p.pid))")


class AuditMod:
    """A Flower client mod ``(msg, context, call_next) -> Message`` that audits the reply of the
    ``rounds`` given (``docs/flower.md`` has every option with its default).

    ``model``: the deployment's model: a factory (``model_args`` its keywords; ``input_shape``
    when it takes one), ``"package.module:attr"`` or an ``nn.Module``, built and checked now;
    ``model_normalize``: the inputs it expects ("none": the images as ``data`` returns them, or
    ``"m1,m2,m3/s1,s2,s3"``); ``num_classes``: the model's output width unless given.
    ``data``: ``data(context)`` or ``data(context, round)`` -> ``(images, labels, trained)``:
    the client's images ``(N, C, H, W)`` in [0, 1], their labels, and the rows the round
    trained on in training order (indices or a mask); the other rows (up to ``reference``) are
    the null and the attacker's auxiliary data; None leaves the client (or round) unaudited.
    The client's training, as the engine describes it: ``local_steps`` or ``local_epochs`` over
    the trained rows in mini-batches of ``local_batch_size`` (None: all at once), ``local_lr``
    (or ``lr``), ``local_optimizer`` (``"sgd:momentum=0.9,weight_decay=5e-4"``, ``"adam"``, ...),
    ``client_mode``. ``defense``: as for ``gia-audit audit`` (a built-in name with
    ``defense_args``, a Defense, any defended-gradient callable, ``"package.module:attr"``), or
    the Flower privacy mod the ``ClientApp`` runs inside this one, mirrored at its settings.
    ``budget``, ``attacks``, ``attack_args``, ``thresholds``, ``share_labels``,
    ``defense_timeout``, ``seed``, ``device``: as for ``gia-audit audit``. ``out``: the output
    folder on the client's machine. ``blocking``: audit inline before the reply is returned
    (default: a detached process after it). ``timeout``: seconds before a round's audit is
    given up and reported incomplete (a background audit is stopped; an inline one stops at its
    next progress report and its late result is discarded). ``threads``: torch threads of a
    background audit. ``arrays_key`` / ``round_key``: the messages' ArrayRecord (when they hold
    several) and the ConfigRecord key of the round (Flower's strategies send ``server-round``).
    """

    def __init__(self, *, rounds: Any, model: Any, data: Callable, **options: Any):
        self.data = data
        self.settings = mod_settings(rounds=rounds, model=model, data=data, **options)
        self.net = deployment_model(self.settings)
        self._check_forward()

    def _check_forward(self) -> None:
        """One train-mode forward and backward of two inputs of ``input_shape`` (when given)."""
        shape = self.settings.input_shape
        if shape is None:
            return
        import copy

        import torch

        net = copy.deepcopy(self.net).train()
        try:
            with preserved_random_state():
                out = net(torch.rand(2, *shape, generator=torch.Generator().manual_seed(0)))
                out.float().sum().backward()
        except Exception as err:
            raise ConfigError(f"the model fails on inputs of input_shape={shape}: {one_line(err)}; fix model=, "
                              "model_args= or input_shape=") from None
        if out.dim() != 2:
            raise ConfigError(f"the model returns {tuple(out.shape)} for 2 inputs, not (2, classes) logits; fix model=")

    # ------------------------------------------------------------------ the mod
    def __call__(self, msg: Any, context: Any, call_next: Any) -> Any:
        began = time.perf_counter()
        planned = self._plan(msg, context)
        planned_s = time.perf_counter() - began
        try:
            reply = call_next(msg, context)
        except Exception as err:
            why = clipping_failure(err)
            if why is None:
                raise
            return self._refused(msg, context, planned, why)
        if planned is not None:
            self._quietly("the audit of this round", self._start, planned, msg, reply, context, planned_s)
        return reply

    @staticmethod
    def _quietly(what: str, work: Callable, *args: Any) -> None:
        """The mod's own bookkeeping ``work(*args)`` (status files, the job, the launch, the log
        lines): whatever it raises (a full disk, a read-only folder) is one warning on the
        client's log, never the client's round's failure."""
        try:
            work(*args)
        except Exception as err:
            LOG.warning("gia-audit: %s could not be recorded: %s", what, one_line(err))

    def _plan(self, msg: Any, context: Any) -> Optional[Dict[str, Any]]:
        """The round and a copy of the arriving arrays when ``msg`` is a train message of an
        audited round (before the client trains, which may consume the message's arrays); the
        outcomes of earlier rounds not logged yet go to the client's log."""
        try:
            if not str(msg.metadata.message_type).startswith("train"):
                return None
            self._quietly("the outcome of earlier rounds", self._log_outcomes, context)
            round_ = self._round(msg)
            if round_ not in self.settings.rounds:
                return None
            return {"round": round_, "arrays": message_arrays(msg, self.settings.arrays_key, "the train message")}
        except Exception as err:  # reading the message must never fail the client's round
            LOG.warning("gia-audit: no audit of this train message: %s", one_line(err))
            return None

    def _round(self, msg: Any) -> Optional[int]:
        for record in msg.content.config_records.values():
            if self.settings.round_key in record:
                return int(record[self.settings.round_key])
        return None

    # ------------------------------------------------------------------ the round's audit
    def _start(self, planned: Dict[str, Any], msg: Any, reply: Any, context: Any, planned_s: float) -> None:
        """Prepare the round's audit and start it; ``planned_s``: the seconds :meth:`_plan` took."""
        began = time.perf_counter()
        round_, client = planned["round"], client_name(context)
        folder = round_dir(self.settings.out, client, round_)
        try:
            got = self.data(context) if self.settings.data_arity == 1 else self.data(context, round_)
            if got is None:  # the data function leaves this client (or this round) unaudited
                return
            folder.mkdir(parents=True, exist_ok=True)
            spec, args = self._defense(msg)
            write_status(folder, fresh=True, state="queued", round=round_, client=client, defense=_name(spec))
            if reply.has_error():
                raise DataError(f"the client's reply is an error message ({reply.error.reason}); nothing was sent to "
                                "audit")
            sent = message_arrays(reply, self.settings.arrays_key, "the reply")
            received = named_arrays(planned["arrays"], self.net, "the train message")
            named_arrays(sent, self.net, "the reply")
            trained, reference = round_images(got, self.settings)
            write_status(folder, pixels=int(trained[0][0].numel()), trained=len(trained[1]))
            origin = (f"round {round_}: the global model the server sent to this client ({client}) in the train "
                      "message of that round, loaded into the deployment's model")
            job = RoundJob(round_, client, origin, self.settings, spec, args, trained, reference, planned["arrays"],
                           sent)
            save_job(folder, job, {**self.net.state_dict(), **received.state()})
            if self.settings.blocking:  # what the mod adds to the round before the audit starts
                write_status(folder, prepared_s=round(planned_s + time.perf_counter() - began, 3))
                with preserved_random_state():
                    run_round(folder)
            else:
                self._spawn(folder)
                write_status(folder, prepared_s=round(planned_s + time.perf_counter() - began, 3))
        except Exception as err:  # recorded as the round's result; the client's round goes on
            self._failed(folder, round_, client, err)
        self._quietly("the outcome of earlier rounds", self._log_outcomes, context)

    def _refused(self, msg: Any, context: Any, planned: Optional[Dict[str, Any]], why: str) -> Any:
        """A reply the mods inside this one could not make (:func:`clipping_failure`): one line on
        the client's log, the audited round recorded as failed, and an error reply with the reason
        (what Flower's runtime sends for a raising ClientApp) instead of a traceback."""
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        LOG.error("gia-audit: the client's reply failed: %s", why)
        if planned is not None:
            self._quietly("the failed round", self._record_refusal, planned, context, why)
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=why), reply_to=msg)

    def _record_refusal(self, planned: Dict[str, Any], context: Any, why: str) -> None:
        round_, client = planned["round"], client_name(context)
        folder = round_dir(self.settings.out, client, round_)
        try:
            got = self.data(context) if self.settings.data_arity == 1 else self.data(context, round_)
        except Exception:  # the round is audited unless the data function says it is not
            got = True
        if got is not None:
            self._failed(folder, round_, client, reason=f"the client's reply failed: {why}")
            write_status(folder, logged=True)  # logged above

    def _failed(self, folder, round_: int, client: str, err: Optional[BaseException] = None,
                reason: str = "") -> None:
        """Record a failure (``err``, or a ``reason`` as it is) before the audit started; the
        client's report is rebuilt outside the round."""
        if err is not None:
            reason = one_line(in_mod_terms(err)) if isinstance(err, ConfigError) else one_line(err)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "job.pkl").unlink(missing_ok=True)
            if self.settings.blocking:
                finish_round(folder, state="failed", round=round_, client=client, reason=reason)
            else:
                write_status(folder, state="failed", round=round_, client=client, reason=reason, report="pending")
                self._spawn(folder)
        except Exception as report_err:
            LOG.warning("gia-audit: the failure of round %s (%s) could not be recorded: %s", round_, client,
                        one_line(report_err))

    def _log_outcomes(self, context: Any) -> None:
        """One line on the client's log per round of this client whose audit failed, timed out,
        was not judged or is incomplete, once each."""
        client_dir = self.settings.out / client_name(context)
        if not client_dir.is_dir():
            return
        for folder in round_folders(client_dir):
            self._quietly(f"the outcome of {folder.name}", self._log_outcome, folder)

    @staticmethod
    def _log_outcome(folder) -> None:
        """:meth:`_log_outcomes` for one round's folder."""
        status = read_status(folder)
        state = status.get("state")
        if status.get("logged") or state in PENDING or state is None:
            return
        if state == FINISHED and status.get("report_status", "complete") == "complete":
            return
        what = state if state != FINISHED else f"incomplete ({status.get('report_status')})"
        LOG.warning("gia-audit: the audit of round %s (%s) %s: %s; see %s", status.get("round"),
                    status.get("client"), what, status.get("reason") or status.get("verdict_reason", ""), folder)
        write_status(folder, logged=True)

    def _defense(self, msg: Any):
        s = self.settings
        if is_flower_mod(s.defense):
            return flower_defense(s.defense, msg, s.lr)
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
