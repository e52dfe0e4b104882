"""Utility is measured, not assumed: train the same model with and without a defense for a
fixed budget and compare test accuracy."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from defenses import DEFENSES

from audit.client.fl import evaluate, train
from audit.core.errors import DefenseError
from audit.engine.compose import build_model, client_model, resolve_defense
from audit.engine.settings import model_settings


def _dataset(dataset, size: Optional[int]):
    if isinstance(dataset, str):
        from audit.core.data import load_dataset

        return load_dataset(dataset, size=size or 32)
    return dataset


def _run(defense, data, *, model, model_args, steps, lr, batch_size, clients, local_steps, seed,
         device) -> Dict[str, Any]:
    """One training run; a defense that fails (or makes training diverge) is reported, with
    the reason, instead of an accuracy."""
    net = build_model(model_settings(model, model_args), data, seed).to(device)
    start = time.perf_counter()
    try:
        net = client_model(defense, net, seed)
        history = train(net, data, defense, steps, lr=lr, batch_size=batch_size, clients=clients,
                        local_steps=local_steps, seed=seed, device=device)
    except DefenseError as err:
        return {"accuracy": None, "final_loss": None, "seconds": time.perf_counter() - start,
                "error": f"training failed: {err}"}
    return {
        "accuracy": evaluate(history.model, data.test_images, data.test_labels),
        "final_loss": history.losses[-1] if history.losses else None,
        "seconds": time.perf_counter() - start,
        "error": None,
    }


def measure_utility(defense, model: Any = "cnn", dataset="embedded", steps: int = 300, *,
                    defense_params: Optional[Dict[str, Any]] = None, model_args: Optional[Dict[str, Any]] = None,
                    lr: float = 0.05,
                    batch_size: int = 16, clients: int = 1, local_steps: int = 1, size: Optional[int] = None,
                    seed: int = 0, device="cpu", baseline: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Test accuracy after ``steps`` rounds of training with ``defense`` next to the undefended run.

    ``model``: a model spec (``model_args`` its keywords) or
    :class:`~audit.engine.settings.ModelSettings` (both runs start from its checkpoint, if any);
    ``dataset`` is a registered name (loaded at ``size`` pixels) or a Dataset-like object;
    ``baseline`` reuses an undefended result (see :func:`utility_table`). Returns a dict with
    ``accuracy``, ``baseline_accuracy``, ``relative`` (defended / undefended), losses and times;
    ``accuracy`` is None, with the reason in ``error``, when training with the defense failed.
    """
    data = _dataset(dataset, size)
    described = model_settings(model, model_args).describe()
    setting = dict(model=model, model_args=model_args, steps=steps, lr=lr, batch_size=batch_size, clients=clients,
                   local_steps=local_steps, seed=seed, device=torch.device(device))
    built = resolve_defense(defense, defense_params)
    base = baseline if baseline is not None else _run(resolve_defense("none"), data, **setting)
    run = _run(built, data, **setting)
    ok = run["accuracy"] is not None and base["accuracy"]
    return {
        "defense": built.name,
        "params": built.params(),
        "accuracy": run["accuracy"],
        "baseline_accuracy": base["accuracy"],
        "relative": run["accuracy"] / base["accuracy"] if ok else None,
        "error": run["error"],
        "final_loss": run["final_loss"],
        "baseline_final_loss": base["final_loss"],
        "seconds": run["seconds"],
        "baseline_seconds": base["seconds"],
        "setting": {"model": described["model"], "model_args": described["args"], "dataset": getattr(data, "name", str(dataset)), "steps": steps, "lr": lr,
                    "batch_size": batch_size, "clients": clients, "local_steps": local_steps, "seed": seed},
    }


def utility_table(defenses: Sequence, model: str = "cnn", dataset="embedded", steps: int = 300, *,
                  defense_params: Optional[Dict[str, Any]] = None, model_args: Optional[Dict[str, Any]] = None,
                  lr: float = 0.05, batch_size: int = 16,
                  clients: int = 1, local_steps: int = 1, size: Optional[int] = None, seed: int = 0,
                  device="cpu") -> List[Dict[str, Any]]:
    """:func:`measure_utility` for several defenses sharing one undefended baseline run.
    ``"all"`` in ``defenses`` means every registered defense except ``none``."""
    names: List = []
    for d in defenses:
        names += [n for n in DEFENSES.names() if n != "none"] if d == "all" else [d]
    data = _dataset(dataset, size)
    setting = dict(lr=lr, batch_size=batch_size, clients=clients, local_steps=local_steps, seed=seed)
    base = _run(resolve_defense("none"), data, model=model, model_args=model_args, steps=steps, device=torch.device(device),
                **setting)
    return [measure_utility(d, model, data, steps, defense_params=defense_params, model_args=model_args,
                            baseline=base, device=device, **setting) for d in names]


def format_utility_table(rows: Sequence[Dict[str, Any]]) -> str:
    """A plain-text table: defense, parameters, accuracy, undefended accuracy, ratio, time."""
    if not rows:
        return "(no defenses)"
    s = rows[0]["setting"]
    lines = [
        f"model {s['model']}, data {s['dataset']}, {s['steps']} steps, lr {s['lr']}, batch {s['batch_size']}, "
        f"clients {s['clients']}, local steps {s['local_steps']}, seed {s['seed']}",
        f"{'defense':<11} {'accuracy':>8} {'undefended':>10} {'ratio':>6} {'loss':>7} {'time s':>7}  params",
    ]
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items())
        lines.append(f"{r['defense']:<11} {_num(r['accuracy'], 8, 3)} {_num(r['baseline_accuracy'], 10, 3)} "
                     f"{_num(r['relative'], 6, 2)} {_num(r['final_loss'], 7, 3)} {r['seconds']:>7.1f}  {params}")
        if r.get("error"):
            lines.append(f"{'':<11} n/a: {r['error']}")
    return "\n".join(lines)


def _num(value, width: int, digits: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def utility_report(defenses: Sequence, defense_args: Sequence[str] = (), **kwargs) -> str:
    """What ``gia-audit utility`` prints: parse ``k=v`` defense arguments, measure, format."""
    from audit.core.errors import ConfigError
    from audit.core.registry import parse_kv_args

    params = parse_kv_args(list(defense_args))
    if params and (len(defenses) != 1 or defenses[0] == "all"):
        raise ConfigError("--defense-arg applies to a single --defense; give one defense with its arguments")
    return format_utility_table(utility_table(list(defenses), defense_params=params or None, **kwargs))
