"""The audit engine: train with the *defended* updates, capture checkpoints, attack the
audited client's private batches at each checkpoint with the base and adaptive attacks,
score, store every finished (step, attack, image) result, and render the report.

``run(...)`` is ``audit.run``; ``gia-audit audit`` calls it. Private data = the data set's
*test* split; the FL clients train on the *train* split (disjoint), which is also the only
data learned attacks may use.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from adaptive import plan as plan_attacks  # importing adaptive registers its attacks in ATTACKS
from attacks import ATTACKS
from attacks.classic import classic_attacks
from attacks.presets import defaults_fingerprint
from audit.client.fl import train
from audit.client.observe import client_round, observe  # client_round: the round the Flower replay runs
from audit.core.defense_call import defense_timeout
from attacks.side_information import side_information
from audit.core.buffers import buffer_effect, has_running_stats, upload_statistics
from audit.core.errors import ConfigError, DefenseError, GiaError, NotApplicable
from audit.core.files import atomic_write_bytes
from audit.core.preflight import runs
from audit.core.records import AccuracySpread, AttackResult, Scores, Status, UtilityResult
from audit.engine.config import AuditConfig, default_of, make_config
from audit.engine.compose import AuditParts, build_parts, build_shared, check_model, reconstruct, resolve_defense
from audit.engine.control import CONTROL_DIR, SEARCH_START, PositiveControl, check_budget_search
from audit.engine.identity import data_identity, defense_identity, audited_model_identity, derive_seed, versions
from audit.engine.null import Null, null_evidence
from audit.engine.privacy import privacy_report
from audit.engine.scoring import (PSNR_CAP, score_against_trained, score_reconstructions, trace_summary,
                                  trained_batch)
from audit.engine.utility import PROTOCOL, measure_utility
from audit.engine.settings import (AttackSettings, DataSettings, FLSettings, ModelSettings, OutputSettings,
                                   model_settings)
from audit.report.audit_report import AuditReport
from audit.report.formats import remove_report
from audit.report.risk import default_delta
from audit.report.rule import LeakRule
from audit.report.store import ResultStore, to_jsonable

DEFAULT_DEFENSE = default_of("defense")
UNDEFENDED = "none"  # the positive control's defense
#: the resolved config, written beside the report: ``--config OUT/config.toml`` replays the run
CONFIG_FILE = "config.toml"
# the portfolio of plain strategies (docs/strength.md), and IG alone: at small budgets IG's full
# share can beat the portfolio's pick, and the verdict takes the strongest attack
BASE_ATTACKS = ("portfolio", "ig")
#: the stored utility record's layout and recipe (a record of another is measured again)
UTILITY_FORMAT = f"seeds; {PROTOCOL.recipe_key()}"


# --------------------------------------------------------------------------- the audit
@dataclass
class AttackSpec:
    """One attack of the audit: registry name, settings, why it runs, base or adaptive."""

    name: str
    settings: Dict[str, Any] = field(default_factory=dict)
    reason: str = ""
    kind: str = "base"

    @property
    def id(self) -> str:
        """The attack's name in the report; its settings are checked on resume instead."""
        return self.name

    @cached_property
    def defaults(self) -> str:
        """The fingerprint of what the attack runs with its settings left out (checked on resume;
        computed once per spec, as the registry does not change during an audit)."""
        return defaults_fingerprint(self.name)

    def as_dict(self) -> Dict[str, Any]:
        return {"id": self.id, **asdict(self)}


class Audit:
    """One audit: resolve the settings, plan, train, attack, score, store, report.

    Use :func:`run`; the class exists so each phase is a small method. ``parts``: the device,
    data set, resolved defense and models built already (a sweep's cell); None builds them
    from ``defense``, ``model`` and the settings.
    """

    #: False in a subclass that supplies its own observation (a real client's reply): the
    #: client's training is not simulated, so the simulation's limits on it do not apply
    simulates_client = True

    def __init__(self, defense: Any = DEFAULT_DEFENSE, model: Union[str, nn.Module, ModelSettings] = default_of("model"), *,
                 defense_args: Optional[Dict[str, Any]] = None, model_args: Optional[Dict[str, Any]] = None,
                 data_settings: DataSettings = DataSettings(), fl_settings: FLSettings = FLSettings(),
                 attack_settings: AttackSettings = AttackSettings(),
                 output_settings: OutputSettings = OutputSettings(),
                 seed: int = default_of("seed"), device: Union[str, torch.device] = default_of("device"),
                 parts: Optional[AuditParts] = None, config: Optional[AuditConfig] = None):
        #: the config the audit was built from (None: built from settings objects), carried into the report
        self.config = config
        self.data_settings, self.fl_settings = data_settings, fl_settings
        self.attack_settings, self.output_settings = attack_settings, output_settings
        data, output = data_settings, output_settings
        self.seed = int(seed)
        self.defense_spec = defense
        self.model_settings = model_settings(model, model_args)
        self.model_spec, self.model_args = self.model_settings.model, self.model_settings.args
        if parts is None:
            shared = build_shared(self.model_settings, data, self.seed, device)
            resolved = resolve_defense(defense, defense_args or {})
            # hashes the defense's code and values and runs it on a fixed probe
            ident = defense_identity(resolved, defense, timeout=output.defense_timeout)
            parts = build_parts(shared, resolved, defense, self.seed, defense_ident=ident)
        self.parts = parts
        self.device, self.dataset, self.defense = parts.device, parts.dataset, parts.defense
        self.defense_ident = parts.defense_ident
        if self.simulates_client:
            _check_local_steps(self.defense, fl_settings)
        # the model as built (the planner compares it with the client's model to see what an
        # architectural defense such as PRECODE changed) and the client's model, wrapped once
        self.base_model, self.model = parts.base_model, parts.model
        trained = max(self.attack_settings.steps) > 0 or output.utility
        check_model(self.base_model, self.model_settings, self.dataset, data.batch_size, fl_settings.client_mode,
                    fl_settings.batch_size if trained else None, self.device)
        if fl_settings.shares == "state" and not has_running_stats(self.model):
            raise ConfigError("shares='state' needs buffers to share and the model has no BatchNorm running "
                              "statistics: use --shares update (shares='update')")
        self.model_ident = {**self.model_settings.describe(),
                            **audited_model_identity(self.model_settings, self.base_model)}
        self.numel = int(math.prod(self.dataset.input_shape))
        self.delta = output.delta if output.delta is not None else default_delta(self.numel)
        self.private = _private_batches(self.dataset, data.images, data.batch_size, self.seed)
        if self.attack_settings.searches_budget:
            check_budget_search(self.attack_settings.names, self.attack_settings.max_budget, SEARCH_START)
        # observations x restarts batched in one computation (chunks of at most this many)
        self.max_members = 256 if self.device.type == "cuda" else 64
        self._null: Optional[Null] = None
        self._planned: Optional[Tuple[List[AttackSpec], Dict[str, Any]]] = None
        #: the progress bar's name (the positive control's audit says "control")
        self.progress_label = "audit"

    @classmethod
    def from_config(cls, config: AuditConfig, parts: Optional[AuditParts] = None, **extra: Any) -> "Audit":
        """The audit of ``config`` (``parts``: built already, e.g. a sweep's cell)."""
        return cls(config.defense, defense_args=dict(config.defense_args or {}), parts=parts, config=config,
                   **config.sections(), **extra)

    @property
    def null(self) -> Null:
        """The audit's null (unrelated images, data-only guesses, candidates), built on first use."""
        if self._null is None:
            self._null = Null.build(self.dataset, derive_seed(self.seed, "null"), self.device)
        return self._null

    # ------------------------------------------------------------------ settings & identity
    def key_settings(self) -> Dict[str, Any]:
        """Every setting that changes a number. Steps, the image count and the attack list
        are left out on purpose: adding a step, an image or an attack reuses the rest."""
        return {
            "defense": self.defense_ident,
            "model": self.model_ident,
            "data": data_identity(self.dataset, self.data_settings.data_args, self.data_settings.image_size),
            "fl": asdict(self.fl_settings), "batch_size": self.data_settings.batch_size,
            "budget": self.attack_settings.budget_description(),
            "seed": self.seed, "share_labels": self.data_settings.share_labels, "device": self.device.type,
            "evidence": {"pool": self.null.pool_size, "candidates": self.null.candidates,
                         "similarity": self.null.similarity.name},
        }

    def settings(self) -> Dict[str, Any]:
        return {**self.key_settings(), "steps": list(self.attack_settings.steps), "images": self.data_settings.images,
                "checkpoint": None if self.model_settings.checkpoint is None else str(self.model_settings.checkpoint),
                "attacks": list(self.attack_settings.names), "attack_args": self.attack_settings.args,
                "utility": self.output_settings.utility, "utility_steps": self.output_settings.utility_steps,
                "utility_seeds": self.output_settings.utility_seeds, "risk_delta": self.delta}

    # ------------------------------------------------------------------ phases
    def planned(self) -> Tuple[List[AttackSpec], Dict[str, Any]]:
        """:meth:`plan`, computed once per audit (the control and the audit share it)."""
        if self._planned is None:
            self._planned = self.plan()
        return self._planned

    def plan(self) -> Tuple[List[AttackSpec], Dict[str, Any]]:
        """The attacks to run (base + the planner's adaptive ones) and the plan for the report."""
        probe_model, probe_note = planner_model(self.base_model, self.dataset)
        try:
            client_probe, _ = planner_model(self.model, self.dataset)
            plan = _plan(self.defense, probe_model, client_probe, self.dataset, self.seed, self.device,
                         self.attack_settings.steps)
            plan_dict = {**plan.to_dict(), **({"model_mode": probe_note} if probe_note else {})}
        except GiaError as err:  # e.g. the defense fails on the planner's probe batch
            plan, plan_dict = None, {"error": f"probing the defense failed: {type(err).__name__}: {err}"}
        plan_dict["side_information"] = self.side_information()
        proposed = [] if plan is None else [
            AttackSpec(a.name, dict(a.settings), a.reason, "adaptive" if a.adaptive else "base")
            for a in plan.attacks]
        classic = [AttackSpec(n, {}, f"the model's classic attack: {why}") for n, why in classic_attacks(self.base_model)]
        auto = [AttackSpec(n, {}, "base attack: always run") for n in BASE_ATTACKS] + classic
        auto = [s for k, s in enumerate(auto) if s.name not in {p.name for p in proposed}
                and s.name not in {a.name for a in auto[:k]}] + proposed
        by_name = {p.name: p for p in proposed}
        specs: Dict[str, AttackSpec] = {}
        for name in self.attack_settings.names:  # "auto" may be combined with names
            for spec in auto if name == "auto" else [by_name.get(name) or AttackSpec(name, {}, "requested by the user")]:
                specs.setdefault(spec.id, spec)
        _check_attacks([*specs.values(), *(AttackSpec(n, kv) for n, kv in self.attack_settings.args.items())])
        for spec in specs.values():  # the user's settings override the planner's
            spec.settings.update(self.attack_settings.args.get(spec.name, {}))
        return list(specs.values()), plan_dict

    def side_information(self) -> Dict[str, str]:
        """What the attacks use beyond the shared weights, read off the first observation
        (:mod:`attacks.side_information`): the optimisation attacks (ig, gi, the portfolio and
        the adaptive attacks built on them) add each term; the others ignore it."""
        x, y = self.private[0]
        try:
            obs = self.observe(self.model, x, y, 0, 0)
        except GiaError as err:
            return {"unavailable": f"the defense failed on the first observation: {err}"}
        notes = side_information(obs, "auto").notes
        return {k: (v + "; added by every optimisation attack (ig, gi, portfolio, the adaptive attacks built on them)"
                    if v.startswith("used") else v) for k, v in notes.items()}

    def threat_model(self, specs: Sequence[AttackSpec]) -> Dict[str, Any]:
        """What the attacker was given; from a real observation of step 0, image 0."""
        x, y = self.private[0]
        obs = None
        try:
            obs = self.observe(self.model, x, y, 0, 0)
            declared = obs.threat_model()
        except GiaError as err:
            declared = {"unavailable": f"the defense failed on the first observation: {err}"}
        return {
            **declared,
            "private_data": f"{self.dataset.name} test split: {self.data_settings.images} private batch(es) of "
                            f"{self.data_settings.batch_size} image(s) of the audited client, never given to the attacker",
            "training_data": f"{self.dataset.name} train split ({len(self.dataset.train_labels)} images), "
                             f"split between {self.fl_settings.clients} client(s); disjoint from the private test split",
            "attacker_auxiliary_data": f"the {self.dataset.name} train split "
                                       f"({len(self.dataset.train_labels)} images and labels), declared to "
                                       "every attack as extras aux_images / aux_labels; the only data "
                                       "learned attacks may use",
            "attacks_run": [s.id for s in specs],
            "client_mode": CLIENT_MODE_TEXT[self.fl_settings.client_mode],
            "model_state": _state_description(self.model_settings, self.seed),
            "client_training": self.fl_settings.training_description(),
            **buffer_note(obs, self.defense, self.fl_settings.shares),
        }

    def observe(self, model: nn.Module, images, labels, step: int, image: int):
        return observe(model, images, labels, self.defense, share_labels=self.data_settings.share_labels,
                       training=self.fl_settings.client, step=step, seed=self.defense_seed(step, image),
                       extra=self.auxiliary_data())

    def auxiliary_data(self) -> Dict[str, Any]:
        """The extras every observation declares: the data set's *train* split (the same tensors
        each time, so learned attacks hash them once)."""
        return {"aux_images": self.dataset.train_images, "aux_labels": self.dataset.train_labels}

    def utility(self, baseline: Optional[AccuracySpread] = None) -> UtilityResult:
        """Accuracy after training with the defense against training without it (or the given
        undefended ``baseline`` runs), over seeds."""
        if not self.output_settings.utility:
            return UtilityResult.missing("utility measurement was switched off (utility=False)")
        try:
            return _measure_utility(self, baseline)
        except GiaError as err:
            return UtilityResult.missing(f"{type(err).__name__}: {err}")

    def utility_for(self) -> List[Any]:
        """What the stored utility was measured for (a change measures it again)."""
        out = self.output_settings
        return [out.utility, out.utility_steps, out.utility_seeds, UTILITY_FORMAT]

    def checkpoints(self, store: ResultStore, needed: Sequence[int]) -> Tuple[Dict[int, Any], Optional[Dict[str, Any]]]:
        """Model states at the ``needed`` steps: from the store, else by FL training with the
        defended updates. A defense that fails during training is recorded in the manifest
        and the steps before the failure are still audited."""
        states = {s: store.load_checkpoint(s) for s in needed}
        missing = [s for s, st in states.items() if st is None]
        failure = None
        if missing:
            captured, failure = _train(self, max(missing), set(missing))
            for step, state in captured.items():
                store.save_checkpoint(step, state)
                states[step] = state
        return {s: st for s, st in states.items() if st is not None}, failure

    def attack_one(self, spec: AttackSpec, obs, images, labels, step: int, image: int,
                   progress: Optional[Callable] = None) -> Tuple[AttackResult, Optional[torch.Tensor]]:
        """Run one attack on one observation and score it; failures become records.
        ``progress(done, total, loss)`` is forwarded to attacks that report progress."""
        record = self._record(spec, step, image)
        start = time.perf_counter()
        try:
            attack = ATTACKS.build(spec.name, **spec.settings)
            rec = reconstruct(attack, obs, self.attack_settings.budget, record.seed, progress)
        except NotApplicable as err:
            return replace(record, status=Status.NOT_APPLICABLE, reason=str(err)), None
        except Exception as err:  # an attack, or a defense inside an adaptive attack, failed
            return self._failed(record, err, step), None
        return self._scored(spec, record, rec, images, labels, time.perf_counter() - start)

    def attack_group(self, spec: AttackSpec, group: Sequence[Tuple[int, Any, torch.Tensor, torch.Tensor]],
                     step: int, progress: Optional[Callable] = None
                     ) -> List[Tuple[AttackResult, Optional[torch.Tensor]]]:
        """One attack on every pending ``(image, observation, x, y)`` of a step: as one batched
        computation when the attack can group observations (``reconstruct_many``), else (or
        when the grouped run fails) one at a time through :meth:`attack_one`, so every
        failure is recorded against its own image."""
        if len(group) == 1:
            image, obs, x, y = group[0]
            return [self.attack_one(spec, obs, x, y, step, image, progress=progress)]
        records = [self._record(spec, step, image) for image, _, _, _ in group]
        start = time.perf_counter()
        recs, why = None, f"no: {spec.name} has no grouped path (reconstruct_many)"
        try:
            attack = ATTACKS.build(spec.name, **spec.settings)
            many = getattr(attack, "reconstruct_many", None)
            if many is not None:
                recs = many([obs for _, obs, _, _ in group], self.attack_settings.budget, [r.seed for r in records],
                            progress=progress, max_members=self.max_members)
        except Exception as err:  # NotApplicable or a failure: attribute it image by image
            why = f"no: the grouped run failed ({type(err).__name__}: {str(err)[:120]}); one at a time"
        if recs is None:
            out = [self.attack_one(spec, obs, x, y, step, image, progress=_share(progress, k, len(group)))
                   for k, (image, obs, x, y) in enumerate(group)]
            for record, _ in out:
                record.trace.setdefault("grouped", why)
            return out
        seconds = (time.perf_counter() - start) / len(group)
        return self._scored_group(spec, records, recs, [x for *_, x, _ in group], [y for *_, y in group], seconds)

    def _scored(self, spec: AttackSpec, record: AttackResult, rec, images, labels,
                seconds: float) -> Tuple[AttackResult, Optional[torch.Tensor]]:
        return self._scored_group(spec, [record], [rec], [images], [labels], seconds)[0]

    def _scored_group(self, spec: AttackSpec, records: Sequence[AttackResult], recs, images, labels,
                      seconds: float) -> List[Tuple[AttackResult, Optional[torch.Tensor]]]:
        """Score a group's reconstructions: the metrics and the null's evidence run once over
        every image of the group (:func:`score_reconstructions`)."""
        records = [replace(record, time_s=round(seconds, 3)) for record in records]
        out: List[Optional[Tuple[AttackResult, Optional[torch.Tensor]]]] = [None] * len(records)
        live = []
        for k, (record, rec) in enumerate(zip(records, recs)):
            if not rec.applicable:
                out[k] = replace(record, status=Status.NOT_APPLICABLE, reason=rec.reason), None
            elif rec.inputs is None or not torch.isfinite(rec.inputs).all():
                out[k] = replace(record, status=Status.ERROR, reason=f"attack {spec.id!r} returned no finite images"), None
            else:
                live.append(k)
        scored = score_reconstructions([recs[k] for k in live], [images[k] for k in live],
                                       [labels[k] for k in live], self.null)
        for k, (metrics, unavailable, aligned) in zip(live, scored):
            record = replace(records[k], status=Status.OK, metrics=Scores.from_dict(metrics), unavailable=unavailable,
                             trace=trace_summary(recs[k].trace))
            out[k] = replace(record, **self.against_trained(recs[k], record, images[k], labels[k])), aligned
        return out

    def _record(self, spec: AttackSpec, step: int, image: int) -> AttackResult:
        return AttackResult(step=step, attack_id=spec.id, attack=spec.name, image=image, settings=spec.settings,
                            defaults=spec.defaults, seed=derive_seed(self.seed, "attack", step, spec.id, image),
                            defense=self.defense.name, budget=self.attack_settings.budget)

    def _failed(self, record: AttackResult, err: BaseException, step: int) -> AttackResult:
        kind = "defense" if isinstance(err, DefenseError) else "attack"
        reason = f"{type(err).__name__}: {err}"
        if kind == "defense" and self.defense.name not in reason:
            reason = f"defense {self.defense.name!r} at step {step}: {reason}"
        return replace(record, status=Status.ERROR, failed=kind, reason=reason)

    def against_trained(self, rec, record: AttackResult, images, labels) -> Dict[str, Any]:
        """For an input-transforming defense, the record's scores against the batch the client
        trained on (reproduced with the observation's seed); {} for other defenses."""
        try:
            trained = trained_batch(self.defense, images.to(rec.inputs.device),
                                    self.defense_seed(record.step, record.image))
        except Exception as err:  # a broken transform_inputs: say so, keep the original's scores
            return {"trained_reference": f"unavailable: transform_inputs raised {type(err).__name__}: {err}"}
        return score_against_trained(rec, trained, labels.to(rec.inputs.device), self.null)

    def defense_seed(self, step: int, image: int) -> int:
        """The seed of the defense's generator in the observation of ``(step, image)``."""
        return derive_seed(self.seed, "defense", step, image)

    # ------------------------------------------------------------------ the whole audit
    def run(self) -> AuditReport:
        """Every phase under the per-call defense timeout: plan, find the budget on the positive
        control when it is "auto", run the control and the audit at that budget. The status is
        'complete' only when no (step, attack, image) result is an error (else the report says
        'incomplete'); every finished result is on disk when it is interrupted."""
        started = time.perf_counter()
        store: Optional[ResultStore] = None
        try:
            with defense_timeout(self.output_settings.defense_timeout):
                control, search = PositiveControl(self), None
                if self.attack_settings.searches_budget:  # the key holds the budget: found first
                    search = control.search(self.planned()[0], SEARCH_START, self.attack_settings.max_budget)
                    self.attack_settings = replace(self.attack_settings, budget=search.budget)
                store = ResultStore.create(self.output_settings.out, self.key_settings(),
                                           retry_errors=self.output_settings.retry_errors)
                specs = self._prepare(store)
                budget = self.attack_settings.budget
                control_store = control.run(specs, budget, self.attack_settings.steps)
                store.update_manifest(control=control.describe(control_store, specs, budget, search))
                self._attack_all(store, specs)
        except KeyboardInterrupt:  # every finished result is already on disk
            if store is not None:
                store.update_manifest(status="interrupted")
                if "attacks" in store.load_manifest():
                    AuditReport.from_store(store).write(self.output_settings.out)
            raise
        except Exception as err:  # a full disk, a broken store: the manifest must not say "running"
            if store is not None:
                store.record_stop(err)
            remove_report("audit", self.output_settings.out)  # an older report would claim more than is stored
            raise
        store.update_manifest(status="complete", timing={"last_invocation_s": round(time.perf_counter() - started, 1)})
        report = AuditReport.from_store(store)  # its status: 'incomplete (...)' when evidence is missing
        report.write(self.output_settings.out)
        return report

    # ------------------------------------------------------------------ the positive control
    def is_undefended(self) -> bool:
        """Whether the audited defense behaves as the identity: then the audit is its own control."""
        return to_jsonable(self.defense_ident) == undefended_identity()

    def control_out(self) -> Path:
        """The folder of the control's result store (a sweep points it at its undefended cell)."""
        return Path(self.output_settings.out) / CONTROL_DIR

    def control_description(self) -> str:
        return ("the same attacks' base forms, budget, seeds and private images against the client without the "
                "defense: its uploads and its training between audited steps without it, everything else as audited")

    def control_audit(self, budget: int, steps: Sequence[int], out: Path) -> "Audit":
        """The audit of the undefended client at ``budget`` on ``steps``, writing to ``out``."""
        control = Audit(UNDEFENDED, self.model_settings, data_settings=self.data_settings,
                        fl_settings=self.fl_settings,
                        attack_settings=replace(self.attack_settings, steps=tuple(steps), budget=int(budget)),
                        output_settings=replace(self.output_settings, out=Path(out), utility=False),
                        seed=self.seed, parts=self.control_parts())
        return self.adopt_control(control)

    def control_parts(self) -> AuditParts:
        """The undefended client's parts: this audit's own when it is undefended, else built on
        the same shared parts (a sweep hands over its undefended cell's)."""
        if self.is_undefended():
            return self.parts
        none = resolve_defense(UNDEFENDED, {})
        return build_parts(self.parts.shared, none, UNDEFENDED, self.seed, undefended_identity())

    def adopt_control(self, control: "Audit") -> "Audit":
        """Share what the control computes the same way (the null) and name its progress bar."""
        control._null = self.null
        control.progress_label = "control"
        return control

    def run_attacks(self, store: ResultStore, specs: Sequence[AttackSpec]) -> None:
        """Compute every (step, attack, image) result of ``specs`` not yet in ``store`` (the
        control's use: no manifest, no report)."""
        self._attack_all(store, specs)

    def _prepare(self, store: ResultStore) -> List[AttackSpec]:
        """Plan the attacks and write the manifest (threat model, settings, utility, ...)."""
        manifest = store.load_manifest()
        specs, plan = self.planned()
        store.update_manifest(
            run_key=store.key, status="running", settings=self.settings(), steps=self.attack_settings.steps,
            images=self.data_settings.images, attacks=[s.as_dict() for s in specs], plan=plan,
            defense=self.defense_ident, differences=list(getattr(self.defense, "differences", ()) or ()),
            privacy=self.privacy(),
            threat_model=self.threat_model(specs), thresholds=self.output_settings.thresholds.as_dict(),
            null={"description": self.null.describe(),
                  "images": [[e.to_dict() for e in batch] for batch in null_evidence(self.null, self.private)]},
            risk_delta={"delta": self.delta, "description": _delta_description(self.delta, self.dataset)},
            data=_data_description(self.dataset, self.private),
            seeds={"seed": self.seed, "model_init": self.seed, "private_batches": self.seed,
                   "per_task": "derive_seed(seed, kind, step, attack, image) (sha256)"},
            versions=versions(), failures=manifest.get("failures", []),
            metric_notes=[f"PSNR per image on [0, 1]; an exact reconstruction (infinite PSNR) counts as {PSNR_CAP:g} dB",
                          "batch reconstructions are matched to the private images by an optimal assignment on MSE",
                          "label accuracy: the fraction of private labels recovered (as a multiset)"])
        self.write_config(store)
        for i, (x, _) in enumerate(self.private):
            store.save_original(i, x)
        if manifest.get("utility_for") != self.utility_for():
            store.update_manifest(utility=self.utility().as_dict(), utility_for=self.utility_for())
        return specs

    def write_config(self, store: ResultStore) -> None:
        """The config as one manifest record and, when a file can hold it, as ``OUT/config.toml``
        (``gia-audit audit --config OUT/config.toml`` replays the run and resumes it)."""
        if self.config is None:
            return
        record = self.config.record()
        store.update_manifest(config=record)
        if record["replayable"]:
            atomic_write_bytes(Path(self.output_settings.out) / CONFIG_FILE, self.config.toml().encode())

    def privacy(self) -> Dict[str, Any]:
        """Per audited step, the (epsilon, delta) spent before it, for a defense that accounts
        (:func:`audit.engine.privacy.privacy_report`)."""
        return privacy_report(self.defense, self.fl_settings, len(self.dataset.train_labels),
                              self.attack_settings.steps, candidates=self.null.candidates)

    def _attack_all(self, store: ResultStore, specs: Sequence[AttackSpec]) -> None:
        pending = [(s, i, a) for s in self.attack_settings.steps for i in range(self.data_settings.images) for a in specs
                   if not store.has(s, a.id, i, settings=a.settings, defaults=a.defaults)]
        total = len(self.attack_settings.steps) * self.data_settings.images * len(specs)
        if not pending:
            return
        pending_steps = sorted({s for s, _, _ in pending})
        states, failure = self.checkpoints(store, pending_steps)
        known = store.load_manifest().get("failures", [])
        if failure is not None and failure not in known:
            store.update_manifest(failures=known + [failure])
        cost = self.result_cost()
        bar = _progress(total * cost, (total - len(pending)) * cost, self.output_settings.progress, self.progress_label)
        try:
            for step in pending_steps:
                todo = [(i, a) for s, i, a in pending if s == step]
                observations = self._observations(states.get(step), failure, step, sorted({i for i, _ in todo}))
                for spec in specs:  # one (step, attack) group: every pending image at once
                    images = [i for i, a in todo if a is spec]
                    if images:
                        self._attack_step(store, spec, observations, step, images, bar)
        finally:
            bar.close()

    def result_cost(self) -> int:
        """The progress bar's unit count for one result: image-iterations, i.e. gradient
        evaluations (the budget) times the private images in a batch."""
        return max(1, self.attack_settings.budget) * self.data_settings.batch_size

    def _observations(self, state, failure, step: int, images: Sequence[int]) -> Dict[int, Any]:
        """The observation of each private batch at ``step`` (or why there is none)."""
        out: Dict[int, Any] = {}
        for image in images:
            x, y = self.private[image]
            if state is None:
                out[image] = failure["error"] if failure else "no checkpoint for this step"
                continue
            model = copy.deepcopy(self.model)
            model.load_state_dict(state)
            try:
                out[image] = self.observe(model, x, y, step, image)
            except GiaError as err:
                out[image] = f"{type(err).__name__}: {err}"
        return out

    def _attack_step(self, store, spec: AttackSpec, observations: Dict[int, Any], step: int,
                     images: Sequence[int], bar) -> None:
        """Attack ``images`` of ``step`` with ``spec`` as one group; store each result."""
        with store.claim(step, spec.id):  # another process attacking this group: wait, then reuse its results
            self._attack_claimed(store, spec, observations, step, images, bar)

    def _attack_claimed(self, store, spec: AttackSpec, observations: Dict[int, Any], step: int,
                        images: Sequence[int], bar) -> None:
        cost = self.result_cost()
        done = [i for i in images if store.has(step, spec.id, i, settings=spec.settings, defaults=spec.defaults)]
        bar.update(cost * len(done))
        images = [i for i in images if i not in done]
        failed = [i for i in images if isinstance(observations[i], str)]
        for image in failed:  # the defense failed on this batch: nothing to attack
            store.save_result(replace(self._record(spec, step, image), status=Status.ERROR, failed="defense",
                                      reason=observations[image]))
            bar.update(cost)
        group = [(i, observations[i], *self.private[i]) for i in images if i not in failed]
        if not group:
            return
        label = f"step {step} {spec.id} images {','.join(str(i) for i, *_ in group)}"
        bar.set_postfix_str(label)
        credit = _GroupCredit(bar, label, cost * len(group))
        results = self.attack_group(spec, group, step, credit.progress)
        store.save_group(results)  # one unit: a rerun after a cut between its writes redoes the group
        credit.settle(len(results) * cost)


def _share(progress: Optional[Callable], k: int, n: int) -> Optional[Callable]:
    """The group's ``progress`` seen from its ``k``-th of ``n`` members run one at a time."""
    if progress is None:
        return None
    return lambda done, total, loss: progress(k * total + done, n * total, loss)


class _GroupCredit:
    """Moves the audit's bar (image-iterations) while one (step, attack) group runs: its
    share grows with the attack's ``progress(done, total, loss)``; ``settle`` tops it up to
    the finished results' full cost (attacks that stop early, or cost less than the budget)."""

    def __init__(self, bar, label: str, cost: int, every_s: float = 0.5):
        self.bar, self.label, self.cost, self.every_s = bar, label, cost, every_s
        self.credited, self.last = 0, 0.0

    def settle(self, units: int) -> None:
        """Move the bar to ``units`` of the group's cost (never back, never past it)."""
        units = min(self.cost, units)
        if units > self.credited:
            self.bar.update(units - self.credited)
            self.credited = units

    def progress(self, done: int, total: int, loss: float) -> None:
        self.settle(int(self.cost * done / max(total, 1)))
        now = time.perf_counter()
        if now - self.last >= self.every_s or done == total:
            self.last = now
            self.bar.set_postfix_str(f"{self.label}: {done}/{total}, loss {float(loss):.3g}")


# --------------------------------------------------------------------------- composition helpers
def _private_batches(dataset, images: int, batch_size: int, seed: int):
    """The audited client's private batches: a seeded draw from the test split. Batch ``i``
    does not depend on ``images``, so adding images keeps the earlier ones."""
    need = images * batch_size
    available = len(dataset.test_labels)
    if need > available:
        raise ConfigError(f"images x batch_size = {need} private images, but the {dataset.name} test "
                          f"split has {available}; lower images or batch_size")
    order = torch.randperm(available, generator=torch.Generator().manual_seed(derive_seed(seed, "private")))
    return [(dataset.test_images[idx].clone(), dataset.test_labels[idx].clone())
            for idx in order[:need].view(images, batch_size)]


def _plan(defense, model, wrapped, dataset, seed: int, device, steps: Sequence[int] = ()):
    """The planner's probe and plan of ``model`` and the client's model ``wrapped``; the
    audited steps are among the FL rounds it probes."""
    return plan_attacks(defense, model, dataset.input_shape, dataset.num_classes, seed=seed, device=device,
                        rounds=steps, client_model=wrapped)


def planner_model(model: nn.Module, dataset) -> Tuple[nn.Module, Optional[str]]:
    """A copy of ``model`` for the planner, whose probe runs single images too: in eval mode
    (with the reason) when train-mode BatchNorm cannot run a batch of 1 (a 1x1 feature map)."""
    probe = copy.deepcopy(model)
    if runs(probe, dataset.input_shape, dataset.num_classes, 1, "train"):
        return probe, None
    return probe.eval(), ("eval: the model cannot run one image in train mode (BatchNorm over a 1x1 feature "
                          "map), so the planner probed the defense on it in eval mode")


def _state_description(settings: ModelSettings, seed: int) -> str:
    """What the model of audited step 0 is, for the threat model."""
    if settings.checkpoint is not None:
        start = f"the weights of checkpoint {settings.checkpoint}"
    elif isinstance(settings.model, nn.Module):
        start = "the weights of the given module"
    else:
        start = f"a fresh initialisation (seed {seed})"
    return f"step 0 is {start}; step N is N FL rounds of defended training after it"


CLIENT_MODE_TEXT = {
    "train": "train: the client computes its update in train mode (BatchNorm normalises with the private "
             "batch's own statistics, as clients train)",
    "eval": "eval: the client computes its update in eval mode (BatchNorm uses the running statistics in the "
            "model's buffers, which the attacker sees)",
}


def buffer_note(obs, defense, shares: str) -> Dict[str, str]:
    """The threat model's lines on the uploaded buffers (shares="state" only): what the defense
    declares it does to them (:func:`audit.core.buffers.buffer_effect`) and whether the upload
    of ``obs`` (None: no observation) reveals the batch's statistics (:func:`upload_statistics`)."""
    if shares != "state":
        return {}
    effect = buffer_effect(defense)
    std = getattr(defense, "buffer_noise_std", None)
    if std is not None and effect.name == "noised":
        effect = replace(effect, text=effect.text.replace("std buffer_noise_std", f"std {float(std):.3g}"))
    if obs is None:
        return {"buffers": f"{effect.name}: {effect.text}", "buffers_reveal": "not judged: no observation"}
    revealed, why = upload_statistics(obs)
    return {"buffers": f"{effect.name}: {effect.text}",
            "buffers_reveal": revealed.describe() if revealed is not None else f"nothing: {why}"}


def _check_local_steps(defense, fl: FLSettings) -> None:
    """A defense that transforms a round's whole one-step update (Flower's update mods, mirrored
    with ``whole_update = True``) cannot be applied to each of several local steps."""
    if (fl.local_steps > 1 or fl.local_epochs is not None) and getattr(defense, "whole_update", False):
        raise ConfigError(f"defense {defense.name!r} transforms the round's whole update of one local SGD step; "
                          f"audit it with local_steps=1 (--local-steps 1), got {fl.local_steps}")


def _check_attacks(specs: Sequence[AttackSpec]) -> None:
    for spec in specs:
        ATTACKS.get(spec.name)  # an unknown name raises ConfigError listing the valid ones
        if spec.reason == "":  # the user's settings: a bad one is an error now, not in every result
            ATTACKS.build(spec.name, **spec.settings)


def _train(audit: "Audit", last_step: int, wanted: set) -> Tuple[Dict[int, Dict[str, torch.Tensor]], Optional[Dict[str, Any]]]:
    """FL training with the defended updates up to ``last_step``; the states at ``wanted``
    steps, and the failure (defense name, step, error) if the defense broke training."""
    model = copy.deepcopy(audit.model)
    captured = {0: _state(model)} if 0 in wanted else {}
    done = {"step": 0}

    def capture(step: int, current: nn.Module) -> None:
        done["step"] = step
        if step in wanted:
            captured[step] = _state(current)

    if last_step == 0:
        return captured, None
    try:
        fl = audit.fl_settings
        train(model, audit.dataset, audit.defense, last_step, lr=fl.lr, batch_size=fl.batch_size, clients=fl.clients,
              training=fl.client, seed=audit.seed, device=audit.device, callback=capture,
              server_optimizer=fl.server_optimizer)
    except GiaError as err:  # the defense failed on the model of step done["step"]
        failed = done["step"]
        return captured, {"phase": "training", "step": failed, "defense": audit.defense.name,
                          "error": f"FL training stopped at step {failed} (no later checkpoint): "
                                   f"{type(err).__name__}: {err}"}
    return captured, None


@functools.lru_cache(maxsize=None)
def _undefended_identity() -> str:
    return json.dumps(to_jsonable(defense_identity(resolve_defense(UNDEFENDED, {}), UNDEFENDED)), sort_keys=True)


def undefended_identity() -> Dict[str, Any]:
    """The identity of the undefended client's defense (computed once per process)."""
    return json.loads(_undefended_identity())


def _state(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _measure_utility(audit: "Audit", baseline: Optional[AccuracySpread]) -> UtilityResult:
    """Test accuracy after ``utility_steps`` rounds of the utility recipe
    (:data:`audit.engine.utility.PROTOCOL`, the same for every audit: the FL settings describe
    the audited client, not how utility is measured) with the defense and without it (or the
    given ``baseline`` runs), over ``utility_seeds`` seeds, with the audit's model and data."""
    return measure_utility(audit.defense, model=audit.model_settings, dataset=audit.dataset,
                           steps=audit.output_settings.utility_steps, seed=audit.seed,
                           seeds=audit.output_settings.utility_seeds, device=audit.device, baseline=baseline)


def _delta_description(delta: float, dataset) -> str:
    c, h, w = dataset.input_shape
    rmse = delta / math.sqrt(c * h * w)
    psnr = -20 * math.log10(rmse) if rmse > 0 else float("inf")
    return (f"l2 norm over the {c}x{h}x{w} pixels of an image in [0, 1]; = per-pixel RMSE {rmse:.3g}, "
            f"i.e. PSNR {psnr:.1f} dB")


def _data_description(dataset, private) -> Dict[str, Any]:
    return {"name": dataset.name, "input_shape": list(dataset.input_shape), "classes": dataset.num_classes,
            "train_images": len(dataset.train_labels), "test_images": len(dataset.test_labels),
            "private_labels": [y.tolist() for _, y in private],
            "splits": "FL clients train on the train split; the private batches come from the disjoint test split"}


def _progress(total: int, initial: int, enabled: bool, label: str = "audit"):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=label, unit=" image-it", unit_scale=True,
                disable=not enabled, dynamic_ncols=True)


# --------------------------------------------------------------------------- public entry point
def run(config: Any = None, /, **fields: Any) -> AuditReport:
    """Audit a defense: how much of the audited client's private data leaks, per training step.

    ``config``: an :class:`~audit.engine.config.AuditConfig` (``fields`` change some of its
    values), or the defense itself (short for ``defense=``); ``fields``: the config's fields by
    name (``images=4, budget=200, ...``; each one's meaning and default: the config's fields, or
    ``gia-audit audit --help``). An unknown name is a one-line error naming the nearest valid
    one. The report is written under ``out`` (results are stored as they finish, and a rerun
    resumes) and returned.
    """
    if config is not None and not isinstance(config, AuditConfig):
        if "defense" in fields:
            raise ConfigError("the defense is given twice (as the first argument and as defense=); give it once")
        config, fields = None, {**fields, "defense": config}
    return Audit.from_config(make_config(config, **fields)).run()


def audit_settings(**flat: Any) -> Dict[str, Any]:
    """The engine's settings sections (:func:`audit.engine.settings.sections_of`) of a dict of
    config fields (a sweep's, a bench's), the defense aside; names checked."""
    return make_config(**flat).sections()
