"""The audit: train with the *defended* updates, attack the audited client's private batches (the
test split; clients train on the disjoint train split) at each checkpoint, score and store every
(step, attack, image) result, and render the report. ``run(config)`` is ``audit.run``.

:class:`Audit` orchestrates, handing its parts what they use (its settings sections, its built
parts, or the whole run as built: :class:`~audit.engine.built.BuiltRun`): :mod:`~audit.engine.planning`,
:mod:`~audit.engine.training`, :mod:`~audit.engine.schedule`, :mod:`~audit.engine.runner`,
:mod:`~audit.engine.manifest`, :mod:`~audit.engine.control` (the positive control), :mod:`~audit.engine.stopping`."""
from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from audit.core.allocator import keep_freed_memory
from audit.client.observe import client_round  # noqa: F401  (the Flower replay's round)
from audit.core.defense_call import defense_timeout
from audit.core.jsonable import to_jsonable
from audit.core.records import AccuracySpread, UtilityResult
from audit.engine import manifest, planning, schedule, training
from audit.engine.built import BuiltRun
from audit.engine.clients import Client, SimulatedClient
from audit.engine.compose import AuditParts, own_parts
from audit.engine.config import AuditConfig, audit_settings, config_of_call, default_of  # noqa: F401  (re-exported)
from audit.engine.control import CONTROL_DIR, ControlInputs, PositiveControl
from audit.engine.identity import audited_model_identity, derive_seed
from audit.engine.manifest import CONFIG_FILE, buffer_note  # noqa: F401  (re-exported)
from audit.engine.null import Null
from audit.engine.planning import AttackSpec, planner_model  # noqa: F401  (re-exported)
from audit.engine.privacy import privacy_report
from audit.engine.settings import AttackSettings, DataSettings, FLSettings, OutputSettings, Sections, model_settings
from audit.engine.stopping import stop_safely
from audit.engine.training import UTILITY_FORMAT, private_batches as _private_batches, undefended_identity  # noqa: F401
from audit.report.audit_report import AuditReport
from audit.report.risk import default_delta
from audit.report.store import ResultStore


class Audit:
    """One audit: plan, train, attack, score, store, report (see the module docstring).
    ``parts``: the device, data set, resolved defense and models built already (a sweep's
    cell); None builds them. ``config``: what the report carries back (None: built from
    settings sections, as a Flower round is). ``null``: shared with the audit it controls."""

    #: False in a subclass that supplies its own observation (a real client's reply): the
    #: client's training is not simulated, so the simulation's limits on it do not apply
    simulates_client = True
    #: what the positive control runs, as a code the report words (audit.report.control)
    control_code = "simulated"
    cancel = None  # an event that, once set, stops the audit at its next progress report

    def __init__(self, defense: Any = default_of("defense"), model: Any = default_of("model"), *,
                 data_settings=DataSettings(), fl_settings=FLSettings(), attack_settings=AttackSettings(),
                 output_settings=OutputSettings(), seed: int = default_of("seed"), device: Any = default_of("device"),
                 defense_args: Optional[Dict[str, Any]] = None, model_args: Optional[Dict[str, Any]] = None,
                 parts: Optional[AuditParts] = None, config: Optional[AuditConfig] = None,
                 null: Optional[Null] = None, progress_label: str = "audit"):
        self.config, self.seed, self.defense_spec, self.data_settings = config, int(seed), defense, data_settings
        self.fl_settings, self.attack_settings, self.output_settings = fl_settings, attack_settings, output_settings
        self.model_settings = model = model_settings(model, model_args)  # a spec, or ModelSettings as is
        if parts is None:
            parts = own_parts(defense, defense_args, model, data_settings, self.seed, device,
                              output_settings.defense_timeout)
        self.parts, self.device, self.dataset, self.defense = parts, parts.device, parts.dataset, parts.defense
        # the model as built (the planner compares it with the client's, wrapped once by the defense)
        self.defense_ident, self.base_model, self.model = parts.defense_ident, parts.base_model, parts.model
        training.check_audit(self.sections(), parts, self.simulates_client)
        self.model_ident = {**model.describe(), **audited_model_identity(model, self.base_model)}
        self.delta = output_settings.delta or default_delta(int(math.prod(self.dataset.input_shape)))
        self.private = _private_batches(self.dataset, data_settings.images, data_settings.batch_size, self.seed)
        self.max_members = 256 if self.device.type == "cuda" else 64  # observations x restarts batched at most
        self._null, self._planned, self.progress_label = null, None, progress_label  # the progress bar's name

    @classmethod
    def from_config(cls, config: AuditConfig, parts: Optional[AuditParts] = None, **extra: Any) -> "Audit":
        """The audit of ``config`` (``parts``: built already, e.g. a sweep's cell)."""
        return cls(config.defense, defense_args=dict(config.defense_args or {}), parts=parts, config=config,
                   **config.sections().as_kwargs(), **extra)

    @property
    def null(self) -> Null:
        """The audit's null (unrelated images, data-only guesses, candidates), built on first use."""
        if self._null is None:
            self._null = Null.build(self.dataset, derive_seed(self.seed, "null"), self.device)
        return self._null

    # ------------------------------------------------------------------ the phases (subclasses change some)
    def key_settings(self) -> Dict[str, Any]:  # what a run key is made of
        return manifest.key_settings(self.built())

    def planned(self) -> Tuple[List[AttackSpec], Dict[str, Any]]:  # planning.plan, made once per audit
        if self._planned is None:  # the plan with the side information the attacks use (manifest.side_information)
            specs, plan = planning.plan(self.built(), self.key_settings())
            self._planned = specs, {**plan, "side_information": manifest.side_information(self.built())}
        return self._planned

    def threat_model(self, specs: Sequence[AttackSpec]) -> Dict[str, Any]:
        return manifest.threat_model(self.built(), specs)

    def privacy(self) -> Dict[str, Any]:  # per audited step, the (epsilon, delta) spent before it
        return privacy_report(self.defense, self.fl_settings, len(self.dataset.train_labels),
                              self.attack_settings.steps, candidates=self.null.candidates)

    def client(self) -> Client:  # what the audit observes: the simulated client (a subclass may observe another)
        return SimulatedClient.of(self.sections(), self.defense, self.dataset)

    def observe(self, model, images, labels, step: int, image: int):
        return self.client().observe(model, images, labels, step, image)

    def sections(self) -> Sections:  # the settings as they are now (a budget search sets the budget)
        return Sections(self.model_settings, self.data_settings, self.fl_settings, self.attack_settings,
                        self.output_settings, self.seed, self.device)

    def built(self) -> BuiltRun:  # what the attack phases run on, read off the audit now
        return BuiltRun(**self.sections().as_kwargs(), parts=self.parts, model_ident=self.model_ident,
                        private=tuple(self.private), delta=self.delta, null=self.null, client=self.client(),
                        max_members=self.max_members, label=self.progress_label, cancel=self.cancel)

    def utility(self, baseline: Optional[AccuracySpread] = None) -> UtilityResult:
        return training.utility(self.sections(), self.parts, baseline)

    def checkpoints(self, store: ResultStore, needed: Sequence[int]):
        return training.checkpoints(store, needed, self.sections(), self.parts)

    def run_attacks(self, store: ResultStore, specs: Sequence[AttackSpec]) -> None:  # the pending results, no manifest
        run = self.built()
        todo = schedule.pending(run, store, specs)
        schedule.attack_all(run, store, specs, todo, *self.checkpoints(store, schedule.steps_of(todo)))

    def _prepare(self, store: ResultStore) -> List[AttackSpec]:
        """Plan the attacks; write the manifest, the config, the originals and the utility."""
        specs, plan = self.planned()
        manifest.write_manifest(store, self.built(), specs, plan, key=self.key_settings(), privacy=self.privacy(),
                                threat_model=self.threat_model(specs))
        manifest.write_config(store, self.config, self.output_settings.out)
        for i, (x, _) in enumerate(self.private):
            store.save_original(i, x)
        if (due := training.utility_due(store, self.output_settings)) is not None:
            store.update_manifest(utility=self.utility().to_dict(), utility_for=due)
        return specs

    # ------------------------------------------------------------------ the positive control
    def is_undefended(self) -> bool:  # the audited defense behaves as the identity: its own control
        return to_jsonable(self.defense_ident) == undefended_identity()

    def control_out(self) -> Path:  # the control's result store (a sweep points it at its undefended cell)
        return Path(self.output_settings.out) / CONTROL_DIR

    def control_kind(self) -> Tuple[type, Dict[str, Any]]:  # the audit class of the control, its keywords
        return Audit, {}

    def control_parts(self) -> AuditParts:  # the undefended client's (a sweep hands over its undefended cell's)
        return self.parts if self.is_undefended() else training.undefended_parts(self.parts, self.seed)

    def control_inputs(self) -> ControlInputs:  # what the positive control shares with this audit, read once
        same_run, (kind, extra) = self.simulates_client and self.is_undefended(), self.control_kind()
        return ControlInputs.of(self.sections(), self.control_parts(), self.null, self.private, self.control_out(),
                                same_run, self.control_code, kind, extra)

    # ------------------------------------------------------------------ the whole audit
    def run(self) -> AuditReport:
        """Every phase under the per-call defense timeout: plan, find the budget on the positive
        control when it is "auto", run the control and the audit at that budget. The status is
        'complete' only when no (step, attack, image) result is an error; every finished result
        is on disk when it is interrupted (:mod:`~audit.engine.stopping`)."""
        keep_freed_memory()  # the attacks' steps reuse their freed activations (audit.core.allocator)
        started, out = time.perf_counter(), self.output_settings.out
        with stop_safely(out) as guard, defense_timeout(self.output_settings.defense_timeout):
            control, search = PositiveControl(self.control_inputs()), None
            if self.attack_settings.searches_budget:  # the key holds the budget: found first
                search = control.search_budget(self.planned()[0], self.attack_settings)
                self.attack_settings = replace(self.attack_settings, budget=search.budget)
            store = guard.store = ResultStore.create(out, self.key_settings(),
                                                     retry_errors=self.output_settings.retry_errors)
            specs, budget = self._prepare(store), self.attack_settings.budget
            control_store = control.run(specs, budget, self.attack_settings.steps)
            store.update_manifest(control=control.describe(control_store, specs, budget, search))
            self.run_attacks(store, specs)
        store.update_manifest(status="complete", timing={"last_invocation_s": round(time.perf_counter() - started, 1)})
        report = AuditReport.from_store(store)  # its status: 'incomplete (...)' when evidence is missing
        report.write(out)
        return report


def run(config: Any = None, /, **fields: Any) -> AuditReport:
    """Audit a defense: how much of the audited client's private data leaks, per training step.

    ``config``: an :class:`~audit.engine.config.AuditConfig` (``fields`` change some of its
    values), or the defense itself (short for ``defense=``); ``fields``: the config's fields by
    name (``images=4, budget=200, ...``; each one's meaning and default: ``gia-audit audit
    --help``). An unknown name is a one-line error naming the nearest valid one. Results are
    stored under ``out`` as they finish (a rerun resumes); the report is written there and returned.
    """
    return Audit.from_config(config_of_call(config, **fields)).run()


def _train(audit: Audit, last_step: int, wanted: set):  # training.train_to of the audit's client
    return training.train_to(audit.sections(), audit.parts, last_step, wanted)
