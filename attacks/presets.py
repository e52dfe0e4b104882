"""Named attacks (:data:`ATTACKS`): small settings dictionaries composed by one function.

Every optimisation preset accepts every knob of :data:`KNOBS` as a keyword, so
``ATTACKS.build("ig", restarts=4, tv=1e-3)`` or ``ATTACKS.build("dlg", tv=1e-4)`` compose
freely; an unknown keyword raises a ConfigError listing the valid ones. ``budget`` passed
to ``reconstruct`` overrides ``iterations``.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any, Callable, Dict, Iterable, Optional

from audit.core.errors import ConfigError
from audit.core.registry import Registry
from priors import PRIORS

from attacks.analytic import AnalyticInversion
from attacks.optimization import OptimizationAttack
from attacks.objectives import OBJECTIVES
from attacks.optimizers import OPTIMIZERS, Watchdog
from attacks.feature_rule import AUTO_FEATURES, FEATURES_MAX_CLASS_SHARE, FEATURES_WEIGHT, FEATURES_WEIGHT_DUMMY_SOFTMAX
from attacks.budget_rule import BUDGET_RULE
from attacks.tv_rule import AUTO_TV, RULE

ATTACKS = Registry("attack")

#: every setting of an optimisation attack, with its default and meaning
KNOBS: Dict[str, tuple] = {
    "objective": ("cosine", "gradient distance / likelihood: l2, l1, cosine, gaussian, laplacian, defense"),
    "sigma": (None, "noise std of the gaussian objective"),
    "b": (None, "noise scale of the laplacian objective"),
    "weights": (None, "per-layer objective weights (one per gradient tensor; 0 drops a layer)"),
    "masks": (None, "per-layer objective masks (tensors shaped like the gradients), or 'observed': the non-zeros "
                    "of each observed gradient"),
    "tv": (0.0, "total-variation weight, or 'auto': from the observation (attacks.tv_rule: grows with the "
                "private pixels and for BatchNorm in train mode)"),
    "tv_kind": ("anisotropic", "anisotropic or isotropic TV"),
    "l2": (0.0, "image-L2 weight"),
    "bn": (0.0, "BatchNorm-statistics weight (DeepInversion)"),
    "bn_upload": ("auto", "weight of the term on the batch statistics the client's uploaded BatchNorm buffers "
                          "reveal (shares=state): auto (the measured default), a number, or 0 (off)"),
    "features": (0.0, "weight of the term matching each image's last-layer features, read off the output "
                      "layer's gradient (priors.features; one image per label), or 'auto': where the observed "
                      "output layer is whole and the attack matches the plain gradient (attacks.feature_rule)"),
    "group": (0.0, "group-consistency weight (needs restarts > 1)"),
    "group_start": (0, "iteration from which group consistency is on"),
    "pixel_range": (0.0, "penalty weight on pixels outside [0, 1]"),
    "optimizer": ("adam", "adam or lbfgs"),
    "lr": (0.1, "learning rate (step size for lbfgs)"),
    "schedule": ("step", "lr schedule: step, cosine, exp, constant"),
    "nonmonotone": (1, "lbfgs: Armijo against the max of the last N losses (1: monotone)"),
    "history": (100, "lbfgs: curvature pairs kept"),
    "signed": (False, "adam on signed gradients"),
    "init": ("uniform", "dummy initialisation: uniform, randn, gray"),
    "box": ("clamp", "clamp, sigmoid or none"),
    "labels": ("infer", "infer, shared, optimize (DLG), idlg, counts"),
    "iterations": (1000, "optimisation iterations (the default budget)"),
    "restarts": (1, "independent restarts, batched; the lowest final loss wins"),
    "per_restart": (0, "gradient evaluations one restart needs ('unknowns': one per private pixel value); "
                       "a budget runs only the restarts it affords (0: off)"),
    "keep_best_after": (0.0, "fraction of the budget after which only each batch's best restart goes on (0: off)"),
    "simulator": (None, "a GradientSimulator (default: clean gradient, FedAvg unrolled)"),
    "execution": ("auto", "auto, batched or sequential"),
    "compile": (False, "torch.compile the loss and its image gradient: exact, about half the time per "
                       "iteration after a one-off compilation (docs/strength.md (Speed))"),
    "capture": ("auto", "the whole iteration as one program: auto (CUDA only, by the run's size), on, off, or a "
                        "route: eager, compiled, graph, compiled-graph (docs/performance.md, the capture rule)"),
}

_OBJECTIVE_KNOBS = ("sigma", "b", "weights", "masks")


#: knobs that belong to one optimiser
OPTIMIZER_KNOBS = {"nonmonotone": "lbfgs", "history": "lbfgs", "signed": "adam"}


def compose(name: str, explicit: Optional[Iterable[str]] = None, **s: Any) -> OptimizationAttack:
    """Build an :class:`OptimizationAttack` from a full set of :data:`KNOBS`. ``explicit``: the
    knobs the user set (None: all); a preset's own setting for an optimiser the user replaced
    (``dlg``'s ``history`` under ``optimizer=adam``) is dropped, a user's is an error."""
    for knob, owner in OPTIMIZER_KNOBS.items():
        if s["optimizer"] != owner and s[knob] != KNOBS[knob][0]:
            if explicit is None or knob in explicit:
                raise ConfigError(f"attack {name!r}: {knob}={s[knob]!r} applies to the {owner} optimizer only")
            s = {**s, knob: KNOBS[knob][0]}
    accepted = inspect.signature(OBJECTIVES.get(s["objective"])).parameters if isinstance(s["objective"], str) else {}
    objective_args = {}
    for knob in _OBJECTIVE_KNOBS:
        if s[knob] is None:
            continue
        if knob not in accepted:
            raise ConfigError(f"attack {name!r}: {knob}= does not apply to objective {s['objective']!r}")
        objective_args[knob] = s[knob]
    objective = OBJECTIVES.build(s["objective"], **objective_args) if isinstance(s["objective"], str) \
        else s["objective"]
    priors = [(PRIORS.build(key, **args), _weight(name, weight, s[weight])) for weight, key, args in (
        ("tv", "tv", {"kind": s["tv_kind"]}), ("l2", "l2", {}), ("bn", "bn", {}), ("features", "features", {}),
        ("group", "group", {"start": s["group_start"]}), ("pixel_range", "range", {}),
    ) if s[weight]]
    if s["optimizer"] == "adam":
        optimizer = OPTIMIZERS.build("adam", lr=s["lr"], schedule=s["schedule"], signed=s["signed"])
    else:
        extra = {"nonmonotone": s["nonmonotone"], "history": s["history"]} if s["optimizer"] == "lbfgs" else {}
        optimizer = OPTIMIZERS.build(s["optimizer"], lr=s["lr"], schedule=s["schedule"], **extra)
    return OptimizationAttack(
        objective, priors, init=s["init"], box=s["box"], optimizer=Watchdog(optimizer), iterations=s["iterations"],
        restarts=s["restarts"], label_strategy=s["labels"], simulator=s["simulator"], execution=s["execution"],
        name=name, keep_best_after=s["keep_best_after"], per_restart=s["per_restart"],
        compile=s["compile"], capture=s["capture"], bn_upload=s["bn_upload"],
    )


#: the prior weights that take ``"auto"``: resolved per observation
AUTO_WEIGHTS = {"tv": AUTO_TV, "features": AUTO_FEATURES}


def _weight(name: str, knob: str, value: Any) -> Any:
    """A prior's weight: a number >= 0, or (``tv``, ``features``) ``"auto"``, resolved per observation."""
    if knob in AUTO_WEIGHTS and value == "auto":
        return AUTO_WEIGHTS[knob]
    try:
        weight = float(value)
    except (TypeError, ValueError):
        weight = -1.0
    if weight < 0:
        hint = "a number >= 0" + (" or 'auto'" if knob in AUTO_WEIGHTS else "")
        raise ConfigError(f"attack {name!r}: {knob}={value!r} is not a prior weight; use {hint}")
    return weight


def _defaults(factory: Callable[..., Any]) -> Dict[str, Any]:
    defaults = getattr(factory, "defaults", None)
    if defaults is None:
        defaults = {k: p.default for k, p in inspect.signature(factory).parameters.items()
                    if p.default is not inspect.Parameter.empty}
    return defaults


def _base(name: str, settings: Dict[str, Any]) -> Optional[str]:
    """The registered attack that ``name`` builds on (an adaptive attack's ``base``), if any."""
    base = settings.get("base")
    return base if isinstance(base, str) and base != name and base in ATTACKS else None


def uses_budget(name: str) -> bool:
    """Whether attack ``name`` spends the budget (False where it declares ``uses_budget = False``:
    closed-form attacks, to which a larger budget gives nothing)."""
    try:
        attack = ATTACKS.build(name)
    except Exception:  # an attack that needs settings to build: it is judged by its own checks
        return True
    return bool(getattr(attack, "uses_budget", True))


def defaults_fingerprint(name: str) -> str:
    """A short hash of what attack ``name`` runs with the settings left out: a preset's
    :data:`KNOBS` defaults, another factory's keyword defaults, what it composes
    (``factory.composes()``, e.g. the portfolio's strategies) and the defaults of the attack it
    builds on (``base``). Stored with every result, so a release that changes a default redoes
    the results it computed, never reuses them."""
    factory = ATTACKS.get(name)
    defaults = _defaults(factory)
    composes = getattr(factory, "composes", None)
    base = _base(name, defaults)
    blob = json.dumps({"defaults": defaults, "composes": composes() if composes else None,
                       **({"base": defaults_fingerprint(base)} if base else {})}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def settings_fingerprint(name: str, settings: Optional[Dict[str, Any]] = None) -> str:
    """A short hash of what attack ``name`` runs with ``settings`` set and every other knob at
    its default (the attack it builds on too, with the knobs passed on to it): equal hashes run
    the same attack, so a result stored under it is redone when a default it relies on changes,
    and only then (a changed default that ``settings`` overrides keeps it)."""
    settings = dict(settings or {})
    factory = ATTACKS.get(name)
    merged = {**_defaults(factory), **settings}
    composes = getattr(factory, "composes", None)
    base = _base(name, merged)
    blob = {"settings": merged, "composes": composes() if composes else None}
    if base:
        blob["base"] = settings_fingerprint(base, {k: v for k, v in settings.items() if k in KNOBS})
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=repr).encode()).hexdigest()[:12]


class Preset:
    """A registered preset: called with knob overrides, it composes its attack
    (:func:`compose`). Its keyword-only parameters, with their defaults, are the :data:`KNOBS`
    (``__signature__``, which the registry checks a call against); ``defaults``: the preset's
    settings; ``composes()``: the rules its defaults follow (None: none)."""

    def __init__(self, name: str, description: str, settings: Dict[str, Any], rules: Dict[str, Any]):
        self.name, self.defaults, self.rules = name, dict(settings), rules
        self.__name__, self.__doc__ = name.replace("-", "_"), description

    def __call__(self, **overrides: Any) -> OptimizationAttack:
        return compose(self.name, explicit=overrides, **{**self.defaults, **overrides})

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.Signature([inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
                                  for k, v in self.defaults.items()])

    @property
    def composes(self) -> Optional[Callable[[], Dict[str, Any]]]:
        return (lambda: self.rules) if self.rules else None


def register_preset(name: str, description: str, **defaults: Any) -> Preset:
    """Register a preset: :data:`KNOBS` defaults overridden by ``defaults``."""
    unknown = set(defaults) - set(KNOBS)
    if unknown:
        raise ConfigError(f"preset {name!r}: unknown settings {sorted(unknown)}")
    settings = {k: defaults.get(k, default) for k, (default, _) in KNOBS.items()}
    rules = {**({"tv_rule": RULE} if settings["tv"] == "auto" else {}),
             **({"features_rule": [FEATURES_WEIGHT, FEATURES_WEIGHT_DUMMY_SOFTMAX, FEATURES_MAX_CLASS_SHARE,
                                   BUDGET_RULE]}
                if settings["features"] == "auto" else {})}
    factory = Preset(name, description, settings, rules)
    ATTACKS.add(name, factory, description)
    return factory


register_preset("dlg", "DLG: L2 gradient matching, L-BFGS, labels optimised jointly",
                objective="l2", optimizer="lbfgs", lr=1.0, nonmonotone=10, history=200, per_restart="unknowns",
                schedule="constant", box="none",
                init="data-randn", labels="optimize", iterations=500, restarts=4)
register_preset("idlg", "iDLG: DLG with the label inferred from the last-layer gradient",
                objective="l2", optimizer="lbfgs", lr=1.0, nonmonotone=10, history=200, per_restart="unknowns",
                schedule="constant", box="none",
                init="data-randn", labels="infer", iterations=500, restarts=4)
register_preset("ig", "Inverting Gradients: cosine + TV (5e-2 at 32x32 batch 1, from the observation: "
                "attacks.tv_rule) + each image's features read off the output layer (attacks.feature_rule), both "
                "moved by the run's length where the buffers reveal the batch's statistics (attacks.budget_rule), "
                "signed Adam 0.1 annealed by a cosine (1-2 dB above the paper's step decay at 200-1,600 "
                "evaluations on held-out images: bench/results/strength/strength.md (How the defaults were chosen)), [0,1] box",
                objective="cosine", tv="auto", features="auto", optimizer="adam", lr=0.1, schedule="cosine", signed=True,
                box="clamp", init="uniform", iterations=1000)
register_preset("gi", "GradInversion: L2 + TV + image L2 + BN statistics + group consistency, 4 restarts",
                objective="l2", tv=5e-2, l2=1e-4, bn=1e-2, group=1e-2, group_start=100, optimizer="adam",
                lr=0.1, schedule="step", box="clamp", init="uniform", restarts=4, iterations=1000)
for _kind, _objective in (("l2", "l2"), ("l1", "l1"), ("cos", "cosine")):
    register_preset(f"bayes-{_kind}", f"the Bayes paper's {_objective} baseline: {_objective} + anisotropic TV, "
                    "Adam with exponential decay, 200 iterations",
                    objective=_objective, tv=1e-2, optimizer="adam", lr=0.1, schedule="exp", box="clamp",
                    init="uniform", iterations=200)


@ATTACKS.register("analytic", "analytic inversion of the first fully connected layer's input (batch 1, MLPs)")
def analytic() -> AnalyticInversion:
    return AnalyticInversion()
