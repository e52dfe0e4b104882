"""Kernels per iteration: the audit's grouped iteration beside the floor's (used by
``bench_throughput.py --ops``). On a launch-bound GPU every ATen operation that computes is a
kernel launch, and operations can be counted on any machine. View operations (an alias of their
input: ``view``, ``expand``, ``select``, ...) and the profiler's markers launch nothing: they are
counted apart, on both sides, and the ratio is of kernels.

The audit's iteration is counted inside a real grouped run (``reconstruct_many``) between two
progress calls: the whole loop step, with the program's function called as is (the ``eager``
capture route: the operations a CUDA graph would capture) where the run can be captured, else
the eager batched loop. The floor is ``bench_throughput.floor_step``: the IG loss (cosine
distance + TV) as one plain vmapped program, its Adam step and the clamp.
"""
from __future__ import annotations

import collections
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adaptive  # noqa: F401  (registers the adaptive attacks)
from attacks import ATTACKS, observe
from audit.core.models import build_model
from defenses import build_defense

#: (attack, defense and its settings, models x client modes, the most ops x the floor's; None: stated only)
ROWS: Sequence[Tuple[str, Optional[Tuple[str, dict]], Sequence[Tuple[str, str]], Optional[float]]] = (
    ("ig", None, (("cnn", "eval"), ("cnn", "train")), 1.15),
    ("ig without its watchdog", None, (("cnn", "eval"),), None),
    ("ig", None, (("convnet", "eval"), ("convnet", "train"), ("resnet18", "eval"), ("resnet18", "train")), 1.10),
    ("mask-replay", ("prune", {"ratio": 0.9}), (("convnet", "train"),), None),
    ("through-defense", ("gaussian", {"sigma": 0.01}), (("convnet", "train"),), None),
    ("gi", None, (("convnet", "train"),), None),
    ("ig + features", None, (("cnn", "train"), ("convnet", "train")), None),
)
#: row name -> (attack, settings): ``ig`` with the floor's loss (cosine + TV, its features term off),
#: and ``ig`` as preset, with the features term, as a stated row
BUILDS = {"ig": ("ig", {"features": 0.0}), "ig without its watchdog": ("ig", {"features": 0.0}),
          "ig + features": ("ig", {})}
#: row name -> a change to the built attack: ``ig`` with plain signed Adam, to show what the watchdog costs
ADJUST: Dict[str, Callable] = {"ig without its watchdog": lambda attack: setattr(attack, "optimizer",
                                                                              attack.optimizer.inner)}
#: operations that launch no kernel besides the view operations: the profiler's markers, a reshape
#: of a fresh tensor, allocations left uninitialised
NOT_KERNELS = ("_record_function_enter_new", "_record_function_exit", "_unsafe_view", "empty", "empty_like",
               "empty_strided", "new_empty", "new_empty_strided")
#: what an attack's operations beyond the IG floor are for
EXTRA = {
    "ig": "the watchdog's per-restart bookkeeping with no host synchronisation (best loss and point, stall "
          "test, recoveries applied by mask and logged: where, masked_fill_, lt / ge / eq, scatter_, any, "
          "nan_to_num; the next row without it), signed Adam (sign), the program's learning rate and iteration "
          "written in (fill_), the loss copied out (clone)",
    "ig without its watchdog": "ig's less the watchdog (plain signed Adam): no stalled or diverging restart is "
                               "sent back and retried, no failure to optimise is reported; stated to show the "
                               "watchdog's share of ig's extra kernels",
    "mask-replay": "each masked layer's mask (the observed zeros) applied to the dummy gradient and its backward",
    "through-defense": "the defense on every EOT draw (noise drawn and added) and the objective per draw",
    "gi": "L2 objective, image-L2, BatchNorm-statistics and group-consistency priors over 4 restarts; "
          "the eager loop (the group prior cannot be captured)",
    "ig + features": "ig's, and each image's features read off the output layer (the dummy's softmax, its "
                     "reading, the per-image error, and their backward)",
}


def is_kernel(func) -> bool:
    """Whether an ATen operation launches work: not a view of its input nor a profiler marker."""
    return not func.is_view and func.overloadpacket.__name__ not in NOT_KERNELS


class OpCounter(TorchDispatchMode):
    """Counts the ATen operations dispatched while it is active, by name: kernels in ``ops``,
    views and markers in ``views``."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.ops if is_kernel(func) else self.views)[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def grouped_observations(model, images, labels, mode: str, defense=None) -> List:
    """One observation per image of ``model`` (through ``defense``), sharing one model copy."""
    first = observe(model, images[:1], labels[:1], defense, client_mode=mode)
    out = [first]
    for i in range(1, images.shape[0]):
        o = observe(model, images[i:i + 1], labels[i:i + 1], defense, client_mode=mode, seed=i)
        o.model = first.model
        out.append(o)
    return out


def audit_ops(attack, observations, at: int = 4) -> OpCounter:
    """Operations of the grouped run's iteration ``at`` (counted between its progress calls)."""
    counter = OpCounter()

    def progress(done, total, loss):
        if done == at:
            counter.__enter__()
        elif done == at + 1:
            counter.__exit__(None, None, None)

    composed = attack.compose(observations[0]) if hasattr(attack, "compose") else attack  # an adaptive attack
    cost = composed.evaluation_cost(observations[0])
    attack.reconstruct_many(observations, (at + 2) * cost, list(range(len(observations))), progress=progress,
                            max_members=len(observations) * composed.restarts)
    return counter


def floor_ops(step: Callable[[], None]) -> OpCounter:
    step()
    with OpCounter() as counter:
        step()
    return counter


def count(floor_step: Callable, device: torch.device, members: int, seed: int = 0) -> List[Dict]:
    """One row per (attack, model, client mode) of :data:`ROWS`: the audit's and the floor's
    operations per iteration for ``members`` images (32x32, 10 classes)."""
    shape = (3, 32, 32)
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand(members, *shape, generator=gen).to(device)
    labels = torch.randint(0, 10, (members,), generator=gen).to(device)
    rows = []
    for attack_name, defense_spec, cases, target in ROWS:
        for model_name, mode in cases:
            model = build_model(model_name, shape, 10, seed=seed).to(device)
            defense = None if defense_spec is None else build_defense(defense_spec[0], **defense_spec[1])
            obs = grouped_observations(model, images, labels, mode, defense)
            name, settings = BUILDS.get(attack_name, (attack_name, {}))
            attack = ATTACKS.build(name, capture="eager", **settings)
            ADJUST.get(attack_name, lambda a: None)(attack)
            audit = audit_ops(attack, obs)
            floor = floor_ops(floor_step(model, mode, images, labels))
            rows.append({"attack": attack_name, "model": model_name, "mode": mode, "audit": sum(audit.ops.values()),
                         "floor": sum(floor.ops.values()), "audit views": sum(audit.views.values()),
                         "floor views": sum(floor.views.values()), "target": target,
                         "extra": extra(audit.ops, floor.ops)})
            print(rows[-1], flush=True)
    return rows


def extra(audit: collections.Counter, floor: collections.Counter, most: int = 6) -> str:
    """The kernels the audit runs more often than the floor, most frequent first."""
    diff = {k: audit[k] - floor.get(k, 0) for k in audit if audit[k] > floor.get(k, 0)}
    return ", ".join(f"+{v} {k}" for k, v in sorted(diff.items(), key=lambda kv: (-kv[1], kv[0]))[:most])


def table(rows: List[Dict], members: int) -> str:
    lines = [f"Kernels (ATen operations less those that launch nothing) per iteration, {members} images (32x32), "
             "the audit's grouped iteration beside the floor's IG iteration on the same model and client mode:", "",
             "| attack | model | client mode | audit kernels | floor kernels | x floor | target | no-kernel ops (views, markers, allocations): audit / floor | "
             "most frequent extra kernels | what they are for |", "|---|---|---|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        ratio = r["audit"] / r["floor"]
        target = f"<= {r['target']:.2f} ({'met' if ratio <= r['target'] else 'not met'})" if r["target"] else "stated"
        lines.append(f"| {r['attack']} | {r['model']} | {r['mode']} | {r['audit']:,} | {r['floor']:,} | "
                     f"{ratio:.3f} | {target} | {r['audit views']:,} / {r['floor views']:,} | {r['extra']} | "
                     f"{EXTRA[r['attack']]} |")
    return "\n".join(lines)
