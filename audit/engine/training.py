"""The audited client's world before any attack: its private batches (a seeded draw from the
test split), the model states at the audited steps (FL training with the defended updates,
stored as checkpoints) and the utility measurement, each from the audit's settings sections
and its parts as built."""
from __future__ import annotations

import copy
import functools
import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from audit.client.fl import train
from audit.core.errors import ConfigError, GiaError
from audit.core.records import AccuracySpread, UtilityResult
from audit.core.buffers import has_running_stats
from audit.core.jsonable import to_jsonable
from audit.engine.compose import AuditParts, build_parts, check_model, resolve_defense
from audit.engine.control import SEARCH_START, check_budget_search
from audit.engine.identity import defense_identity, derive_seed
from audit.engine.settings import OutputSettings, Sections
from audit.engine.utility import PROTOCOL, measure_utility
from audit.report.store import ResultStore

UNDEFENDED = "none"  # the positive control's defense
#: the stored utility record's layout and recipe (a record of another is measured again)
UTILITY_FORMAT = f"seeds; {PROTOCOL.recipe_key()}"


def private_batches(dataset, images: int, batch_size: int, seed: int):
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


def check_local_steps(defense, fl: Any) -> None:
    """A defense that transforms a round's whole one-step update (Flower's update mods, mirrored
    with ``whole_update = True``) cannot be applied to each of several local steps."""
    if (fl.local_steps > 1 or fl.local_epochs is not None) and getattr(defense, "whole_update", False):
        raise ConfigError(f"defense {defense.name!r} transforms the round's whole update of one local SGD step; "
                          f"audit it with local_steps=1 (--local-steps 1), got {fl.local_steps}")


def check_audit(sections: Sections, parts: AuditParts, simulates_client: bool) -> None:
    """What an audit of ``sections`` on ``parts`` cannot run, as a one-line ConfigError before
    any work: a whole-update defense over several local steps (when the audit simulates its
    client), a model that cannot run the client's batch or FL training, buffers to share
    without BatchNorm, a budget search that cannot help."""
    fl, data, attacks = sections.fl_settings, sections.data_settings, sections.attack_settings
    if simulates_client:
        check_local_steps(parts.defense, fl)
    trained = max(attacks.steps) > 0 or sections.output_settings.utility
    check_model(parts.base_model, sections.model, parts.dataset, data.batch_size, fl.client_mode,
                fl.batch_size if trained else None, parts.device)
    if fl.shares == "state" and not has_running_stats(parts.model):
        raise ConfigError("shares='state' needs buffers to share and the model has no BatchNorm running "
                          "statistics: use --shares update (shares='update')")
    if attacks.searches_budget:
        check_budget_search(attacks.names, attacks.max_budget, SEARCH_START)


def checkpoints(store: ResultStore, needed: Sequence[int], sections: Sections,
                parts: AuditParts) -> Tuple[Dict[int, Any], Optional[Dict[str, Any]]]:
    """Model states at the ``needed`` steps: from the store, else by FL training with the
    defended updates (:func:`train_to`). A defense that fails during training is returned as
    the failure; the steps before it are still audited."""
    states = {s: store.load_checkpoint(s) for s in needed}
    missing = [s for s, st in states.items() if st is None]
    failure = None
    if missing:
        captured, failure = train_to(sections, parts, max(missing), set(missing))
        for step, state in captured.items():
            store.save_checkpoint(step, state)
            states[step] = state
    return {s: st for s, st in states.items() if st is not None}, failure


def train_to(sections: Sections, parts: AuditParts, last_step: int,
             wanted: set) -> Tuple[Dict[int, Dict[str, torch.Tensor]], Optional[Dict[str, Any]]]:
    """FL training of the client's model (``parts``) with the defended updates up to
    ``last_step``; the states at ``wanted`` steps, and the failure (defense name, step, error)
    if the defense broke training."""
    model = copy.deepcopy(parts.model)
    captured = {0: state_of(model)} if 0 in wanted else {}
    done = {"step": 0}

    def capture(step: int, current: nn.Module) -> None:
        done["step"] = step
        if step in wanted:
            captured[step] = state_of(current)

    if last_step == 0:
        return captured, None
    try:
        fl = sections.fl_settings
        train(model, parts.dataset, parts.defense, last_step, lr=fl.lr, batch_size=fl.batch_size, clients=fl.clients,
              training=fl.client, seed=sections.seed, device=parts.device, callback=capture,
              server_optimizer=fl.server_optimizer)
    except GiaError as err:  # the defense failed on the model of step done["step"]
        failed = done["step"]
        return captured, {"phase": "training", "step": failed, "defense": parts.defense.name,
                          "error": f"FL training stopped at step {failed} (no later checkpoint): "
                                   f"{type(err).__name__}: {err}"}
    return captured, None


def state_of(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def utility(sections: Sections, parts: AuditParts, baseline: Optional[AccuracySpread] = None) -> UtilityResult:
    """Test accuracy after ``utility_steps`` rounds of the utility recipe
    (:data:`audit.engine.utility.PROTOCOL`, the same for every audit: the FL settings describe
    the audited client, not how utility is measured) with the defense and without it (or the
    given ``baseline`` runs), over ``utility_seeds`` seeds, with the audit's model and data;
    missing, with the reason, when switched off or when the defense fails."""
    out = sections.output_settings
    if not out.utility:
        return UtilityResult.missing("utility measurement was switched off (utility=False)")
    try:
        return measure_utility(parts.defense, model=sections.model, dataset=parts.dataset,
                               steps=out.utility_steps, seed=sections.seed, seeds=out.utility_seeds,
                               device=parts.device, baseline=baseline)
    except GiaError as err:
        return UtilityResult.missing(f"{type(err).__name__}: {err}")


def utility_due(store: ResultStore, out: OutputSettings) -> Optional[List[Any]]:
    """What a utility measured for ``out``'s settings and recipe (:data:`UTILITY_FORMAT`) is
    stored for, when the manifest holds none measured for them (then it is measured); else None."""
    measured_for = [out.utility, out.utility_steps, out.utility_seeds, UTILITY_FORMAT]
    return None if store.load_manifest().utility_for == measured_for else measured_for


def undefended_parts(parts: AuditParts, seed: int) -> AuditParts:
    """The undefended client's parts on the same shared parts (data, model) as ``parts``."""
    return build_parts(parts.shared, resolve_defense(UNDEFENDED, {}), UNDEFENDED, seed, undefended_identity())


@functools.lru_cache(maxsize=None)
def _undefended_identity() -> str:
    return json.dumps(to_jsonable(defense_identity(resolve_defense(UNDEFENDED, {}), UNDEFENDED)), sort_keys=True)


def undefended_identity() -> Dict[str, Any]:
    """The identity of the undefended client's defense (computed once per process)."""
    return json.loads(_undefended_identity())
