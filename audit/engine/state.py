"""Audit one model state supplied from outside: a federation's global model at round ``r``,
attacked with the client's own data.

Nothing is trained: the audited step *is* the round, the model is the state the client received
(``ModelSettings.checkpoint``), the private batches are drawn from the data set's test split
and its train split serves as the null and the attacker's auxiliary data, as in every audit.
The report is the audit's report with the round in place of the training step
(``step_name="round"``), so reports of several rounds line up as one per-round report.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Sequence, Tuple

from audit.engine.audit import Audit
from audit.engine.privacy import privacy_report
from audit.engine.settings import AttackSettings, DataSettings, FLSettings, ModelSettings, OutputSettings
from audit.engine.training import state_of
from audit.report.audit_report import AuditReport
from audit.report.store import ResultStore

STEP_NAME = "round"


class StateAudit(Audit):
    """An :class:`~audit.engine.audit.Audit` of the given model state at ``round`` (see the
    module docstring); ``origin`` says where the state came from, for the threat model."""

    control_code = "state"

    def __init__(self, defense: Any, model: ModelSettings, round: int, *, origin: str,
                 defense_args: Optional[Dict[str, Any]] = None, data_settings: DataSettings = DataSettings(),
                 fl_settings: FLSettings = FLSettings(), attack_settings: AttackSettings = AttackSettings(),
                 output_settings: OutputSettings = OutputSettings(), seed: int = 0, device: Any = "cpu",
                 **parts: Any):
        self.round, self.origin = int(round), origin  # parts: Audit's parts= and config=
        super().__init__(defense, model, defense_args=defense_args, data_settings=data_settings,
                         fl_settings=fl_settings, attack_settings=replace(attack_settings, steps=(self.round,)),
                         output_settings=replace(output_settings, utility=False), seed=seed, device=device, **parts)

    def checkpoints(self, store: ResultStore, needed: Sequence[int]) -> Tuple[Dict[int, Any], Optional[Dict[str, Any]]]:
        """The given state is the one checkpoint: nothing is trained."""
        return {self.round: state_of(self.model)}, None

    def threat_model(self, specs) -> Dict[str, Any]:
        reference = len(self.dataset.train_labels)
        return {**super().threat_model(specs),
                "training_data": "none trained here: the model is the state the client received",
                "attacker_auxiliary_data": f"the client's {reference} reference images and labels (not the audited "
                                           "batches), declared to every attack as extras aux_images / aux_labels",
                "model_state": self.origin}

    def privacy(self) -> Dict[str, Any]:
        """The (epsilon, delta) after the client's noised updates of rounds 1 .. round (one per round,
        every example in each: sample rate 1), and the identification bound of one update."""
        reference = len(self.dataset.train_labels)
        out = privacy_report(self.defense, FLSettings(batch_size=reference, clients=1), reference, [self.round],
                             candidates=self.null.candidates)
        if out.get("applicable"):
            out["description"] = (f"RDP accountant ({out['accountant']}) of the Gaussian mechanism: noise multiplier "
                                  f"{out['noise_multiplier']:.4g}, one update per round for rounds 1 to {self.round} "
                                  "(if the client took part in each), every example in each update (sample rate 1), "
                                  f"delta {out['delta']:g}")
        return out

    def control_kind(self) -> Tuple[type, Dict[str, Any]]:
        """The undefended client at the same given state: nothing is trained here either."""
        return StateAudit, {"round": self.round, "origin": self.origin}

    def _prepare(self, store: ResultStore):
        specs = super()._prepare(store)
        store.update_manifest(step_name=STEP_NAME)
        return specs


def audit_state(defense: Any, model: ModelSettings, round: int, *, origin: str, **settings: Any) -> AuditReport:
    """Audit ``model`` (its ``checkpoint`` is the state) at federation round ``round`` with
    :class:`StateAudit`; ``settings`` are its keyword settings (``data_settings`` with the data
    set as ``data``, ``fl_settings``, ``attack_settings``, ``output_settings``, ``seed``,
    ``device``, ``defense_args``). The report is written to ``output_settings.out`` and returned."""
    return StateAudit(defense, model, round, origin=origin, **settings).run()
