"""Utility is measured, not assumed: train the same model with and without a defense for a
fixed budget, over several seeds, and compare test accuracy (mean and spread).

The numbers depend on the settings only: each run's seeds are derived from the setting's
seed, a defense that draws from the global random generator gets a seeded one, and on the
CPU training runs on ``UTILITY_THREADS`` intra-op threads (float reductions depend on the
thread count, and 100 rounds of training turn that last-bit difference into points of
accuracy), so an audit, a local sweep and a Ray sweep give identical numbers.
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from defenses import DEFENSES

from audit.client.fl import train
from audit.core.errors import ConfigError, DefenseError, NonFiniteUpdate
from audit.core.records import AccuracySpread, TrainingRun, UtilityResult
from audit.core.types import NoDefense
from audit.engine.compose import build_model, client_model, resolve_defense
from audit.engine.identity import derive_seed, torch_threads
from audit.engine.recipe import DEFAULT_SEEDS, PROTOCOL, SCHEDULES, Protocol  # noqa: F401  (re-exported)
from audit.engine.settings import model_settings
from audit.report.format import spread_text

UTILITY_THREADS = 1


def _dataset(dataset, size: Optional[int]):
    if isinstance(dataset, str):
        from audit.core.data import load_dataset

        return load_dataset(dataset, size=size or 32)
    return dataset


def utility_seeds(seed: int, seeds: int) -> List[int]:
    """The training seeds of a utility measurement (the same for defended and undefended runs)."""
    return [derive_seed(seed, "utility", k) for k in range(seeds)]


class _Diverged(Exception):
    def __init__(self, round_: int):
        super().__init__(round_)
        self.round = round_


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def accuracy_left(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, classes: int,
                  batch_size: int = 256) -> Tuple[float, int]:
    """Top-1 accuracy of ``model`` (eval mode, restored after) and how many test examples had
    non-finite outputs: each of those counts as a constant guess, 1/``classes`` correct (the
    expected accuracy of guessing one fixed class)."""
    device = next(iter(model.parameters()), torch.empty(0)).device
    was_training = model.training
    model.eval()
    correct, broken = 0.0, 0
    try:
        with torch.no_grad():
            for start in range(0, len(labels), batch_size):
                out = model(images[start:start + batch_size].to(device))
                y = labels[start:start + batch_size].to(device)
                ok = torch.isfinite(out).flatten(1).all(1)
                correct += int(((out.argmax(1) == y) & ok).sum()) + int((~ok).sum()) / classes
                broken += int((~ok).sum())
    finally:
        model.train(was_training)
    return correct / max(1, len(labels)), broken


def _train_once(defense, data, *, model, model_args, protocol: Protocol, seed, device) -> TrainingRun:
    """One training run: the accuracy of what it left. A run that diverges (a non-finite loss,
    shared update or parameters) stops there and is scored as it stands; a defense that fails
    otherwise is reported with the reason instead of an accuracy."""
    net = build_model(model_settings(model, model_args), data, seed).to(device)
    start = time.perf_counter()
    at = {"round": 0}
    diverged, why = None, ""
    steps = protocol.rounds

    def watch(step: int, current: nn.Module) -> None:
        at["round"] = step
        if step > 0 and not _finite(current):
            raise _Diverged(step - 1)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # a defense drawing from the global generator gets a seeded one
        try:
            net = client_model(defense, net, seed)
            losses = train(net, data, defense, steps, lr=protocol.lr, batch_size=protocol.batch_size,
                           clients=protocol.clients, local_steps=protocol.local_steps, seed=seed, device=device,
                           callback=watch, schedule=protocol.factor()).losses
        except _Diverged as stop:
            diverged, why, losses = stop.round, "the parameters became non-finite", []
        except NonFiniteUpdate as err:
            diverged, why, losses = at["round"], f"the shared update was not finite ({err})", []
        except DefenseError as err:
            return TrainingRun(seed, seconds=time.perf_counter() - start, error=f"training failed: {err}")
    bad_loss = next((k for k, v in enumerate(losses) if not math.isfinite(v)), None)
    if diverged is None and bad_loss is not None:
        diverged, why = bad_loss, "the training loss became non-finite"
    accuracy, broken = accuracy_left(net, data.test_images, data.test_labels, data.num_classes)
    note = f"diverged at round {diverged} of {steps}: {why}; the model it left was evaluated" if diverged is not None else ""
    if broken:
        note += (f"; {broken} of {len(data.test_labels)} test outputs were not finite and count as a constant "
                 f"guess (1/{data.num_classes} correct each)")
    final = next((v for v in reversed(losses) if math.isfinite(v)), None)
    return TrainingRun(seed, accuracy, final, time.perf_counter() - start, diverged, note.lstrip("; "))


def train_over_seeds(defense, data, seeds: Sequence[int], **setting: Any) -> AccuracySpread:
    """:func:`_train_once` for each seed, on ``UTILITY_THREADS`` threads on the CPU."""
    with torch_threads(UTILITY_THREADS, setting["device"]):
        return AccuracySpread(tuple(_train_once(defense, data, seed=s, **setting) for s in seeds))


def measure_utility(defense, model: Any = "cnn", dataset="embedded", steps: int = PROTOCOL.rounds, *,
                    defense_params: Optional[Dict[str, Any]] = None, model_args: Optional[Dict[str, Any]] = None,
                    lr: float = PROTOCOL.lr, batch_size: int = PROTOCOL.batch_size, schedule: str = PROTOCOL.schedule,
                    clients: int = PROTOCOL.clients, local_steps: int = PROTOCOL.local_steps,
                    size: Optional[int] = None, seed: int = 0, seeds: int = DEFAULT_SEEDS, device="cpu",
                    baseline: Optional[AccuracySpread] = None) -> UtilityResult:
    """Test accuracy after ``steps`` rounds of training with ``defense``, over ``seeds``
    seeds, next to the undefended runs on the same seeds (the recipe: :class:`Protocol`; the
    defaults are :data:`PROTOCOL`, chosen in ``docs/evidence.md``).

    ``model``: a model spec (``model_args`` its keywords) or
    :class:`~audit.engine.settings.ModelSettings` (both runs start from its checkpoint, if any);
    ``dataset`` is a registered name (loaded at ``size`` pixels) or a Dataset-like object;
    ``baseline`` reuses the undefended runs (see :func:`utility_table`).
    """
    if isinstance(seeds, bool) or not isinstance(seeds, int) or seeds < 1:
        raise ConfigError(f"utility seeds must be a positive integer (training runs per arm), got {seeds!r}")
    data = _dataset(dataset, size)
    described = model_settings(model, model_args).describe()
    protocol = Protocol(steps, lr, batch_size, schedule, clients, local_steps)
    setting = dict(model=model, model_args=model_args, protocol=protocol, device=torch.device(device))
    order = utility_seeds(seed, seeds)
    built = resolve_defense(defense, defense_params)
    base = baseline if baseline is not None else train_over_seeds(resolve_defense("none"), data, order, **setting)
    undefended = isinstance(built, NoDefense) and baseline is None  # the same runs: train them once
    run = base if undefended else train_over_seeds(built, data, order, **setting)
    return UtilityResult(
        built.name, built.params(),
        {"model": described["model"], "model_args": described["args"], "dataset": getattr(data, "name", str(dataset)),
         "steps": steps, "lr": lr, "schedule": schedule, "batch_size": batch_size, "clients": clients,
         "local_steps": local_steps, "seed": seed, "seeds": order,
         "threads": UTILITY_THREADS if setting["device"].type == "cpu" else None},
        run, base)


def utility_table(defenses: Sequence, model: str = "cnn", dataset="embedded", steps: int = PROTOCOL.rounds, *,
                  defense_params: Optional[Dict[str, Any]] = None, model_args: Optional[Dict[str, Any]] = None,
                  lr: float = PROTOCOL.lr, batch_size: int = PROTOCOL.batch_size, schedule: str = PROTOCOL.schedule,
                  clients: int = PROTOCOL.clients, local_steps: int = PROTOCOL.local_steps,
                  size: Optional[int] = None, seed: int = 0, seeds: int = DEFAULT_SEEDS,
                  device="cpu") -> List[UtilityResult]:
    """:func:`measure_utility` for several defenses sharing one undefended baseline.
    ``"all"`` in ``defenses`` means every registered defense except ``none``."""
    names: List = []
    for d in defenses:
        names += [n for n in DEFENSES.names() if n != "none"] if d == "all" else [d]
    data = _dataset(dataset, size)
    recipe = dict(lr=lr, batch_size=batch_size, schedule=schedule, clients=clients, local_steps=local_steps)
    base = train_over_seeds(resolve_defense("none"), data, utility_seeds(seed, seeds), model=model,
                            model_args=model_args, protocol=Protocol(steps, **recipe), device=torch.device(device))
    return [measure_utility(d, model, data, steps, defense_params=defense_params, model_args=model_args,
                            baseline=base, device=device, seed=seed, seeds=seeds, **recipe) for d in names]


def format_utility_table(rows: Sequence[UtilityResult]) -> str:
    """A plain-text table: defense, accuracy with its spread, undefended, ratio, time, params;
    diverged runs and failures on lines of their own."""
    if not rows:
        return "(no defenses)"
    s = rows[0].setting
    lines = [
        f"model {s['model']}, data {s['dataset']}, {s['steps']} steps, lr {s['lr']} ({s['schedule']}), batch "
        f"{s['batch_size']}, clients {s['clients']}, local steps {s['local_steps']}, seed {s['seed']} "
        f"({len(s['seeds'])} training seeds)",
        f"{'defense':<11} {'accuracy (mean ± std, min-max)':<36} {'undefended':<36} {'ratio':>6} {'time s':>7}  params",
    ]
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r.params.items())
        ratio = "n/a" if r.relative is None else f"{r.relative:.2f}"
        lines.append(f"{r.defense:<11} {spread_text(r.defended):<36} {spread_text(r.undefended):<36} "
                     f"{ratio:>6} {r.defended.seconds:>7.1f}  {params}")
        lines += [f"{'':<11} seed {run.seed}: {run.error or run.note}" for run in r.defended.runs
                  if run.error or run.note]
    return "\n".join(lines)


def utility_report(defenses: Sequence, defense_args: Sequence[str] = (), **kwargs) -> str:
    """What ``gia-audit utility`` prints: parse ``k=v`` defense arguments, measure, format
    (a keyword given as None takes the recipe's value, :data:`PROTOCOL`)."""
    from audit.core.registry import parse_kv_args

    params = parse_kv_args(list(defense_args))
    if params and (len(defenses) != 1 or defenses[0] == "all"):
        raise ConfigError("--defense-arg applies to a single --defense; give one defense with its arguments")
    given = {k: v for k, v in kwargs.items() if v is not None}
    return format_utility_table(utility_table(list(defenses), defense_params=params or None, **given))
