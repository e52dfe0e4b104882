"""Flower's own client-side update defenses as audit defenses, at the deployment's settings.

The mod given as the defense (the very object the ``ClientApp`` runs) is read for its
settings: ``LocalDpMod`` carries its clipping norm, sensitivity, epsilon and delta;
``fixedclipping_mod`` and ``adaptiveclipping_mod`` take the round's clipping norm from the
train message's ConfigRecord (key ``clipping_norm``, sent by the server-side wrapper). Each
maps to the built-in defense that applies the same transform to the update
(:mod:`defenses.flower`), expressed in gradient units with the client's learning rate.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Dict, Optional, Tuple

from audit.core.errors import ConfigError

KEY_CLIPPING_NORM = "clipping_norm"  # flwr.supercore.differential_privacy.KEY_CLIPPING_NORM


def _clipping_norm_of(msg: Any) -> float:
    for record in msg.content.config_records.values():
        if KEY_CLIPPING_NORM in record:
            return float(record[KEY_CLIPPING_NORM])
    raise ConfigError(f"the train message carries no {KEY_CLIPPING_NORM!r} in its ConfigRecord; Flower's clipping "
                      "mods need the server-side DifferentialPrivacyClientSide...Clipping wrapper, which sends it")


def _local_dp(mod: Any, msg: Any) -> Tuple[str, Dict[str, Any]]:
    return "flower-localdp", {"clipping_norm": float(mod.clipping_norm), "sensitivity": float(mod.sensitivity),
                              "epsilon": float(mod.epsilon), "delta": float(mod.delta)}


def _clipping(mod: Any, msg: Any) -> Tuple[str, Dict[str, Any]]:
    return "flower-fixedclipping", {"clipping_norm": _clipping_norm_of(msg)}


#: Flower mod (class or function name, in flwr.client.mod or flwr.clientapp.mod) -> the built-in
#: defense and its settings for a train message
FLOWER_MODS: Dict[str, Callable[[Any, Any], Tuple[str, Dict[str, Any]]]] = {
    "LocalDpMod": _local_dp,
    "fixedclipping_mod": _clipping,
    "adaptiveclipping_mod": _clipping,
}


def _mod_name(obj: Any) -> Optional[str]:
    kind = obj if callable(obj) and hasattr(obj, "__name__") else type(obj)
    module = getattr(kind, "__module__", "") or ""
    name = getattr(kind, "__name__", "")
    return name if module.startswith("flwr.") and name in FLOWER_MODS else None


def is_flower_mod(obj: Any) -> bool:
    """True for a Flower privacy mod the audit can mirror (``LocalDpMod(...)``, ``fixedclipping_mod``,
    ``adaptiveclipping_mod``, from ``flwr.clientapp.mod`` or ``flwr.client.mod``)."""
    return _mod_name(obj) is not None and not isinstance(obj, type)


def flower_defense(mod: Any, msg: Any, lr: float) -> Tuple[str, Dict[str, Any]]:
    """The built-in defense name and settings that mirror ``mod`` on the train message ``msg``
    for a client whose local learning rate is ``lr``."""
    name = _mod_name(mod)
    if name is None or isinstance(mod, type):
        raise ConfigError(f"{mod!r} is not one of Flower's update defenses ({', '.join(FLOWER_MODS)}); pass the mod "
                          "object the ClientApp runs, e.g. LocalDpMod(...) or fixedclipping_mod")
    spec, args = FLOWER_MODS[name](mod, msg)
    return spec, {**args, "lr": float(lr)}


def clipping_failure(err: BaseException) -> Optional[str]:
    """The one-line reason, naming the fix, when ``err`` is Flower's clipping (``LocalDpMod``,
    ``fixedclipping_mod``, ``adaptiveclipping_mod``) failing on an integer array of the reply:
    it scales the update in place, which numpy refuses for an integer array of one dimension or
    more (a 0-d one, e.g. BatchNorm's ``num_batches_tracked``, is left unclipped instead); None
    for any other error."""
    frames = traceback.extract_tb(err.__traceback__)
    if not (isinstance(err, TypeError) and frames and "flwr" in frames[-1].filename
            and "differential_privacy" in frames[-1].filename and "cast" in str(err)):
        return None
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ("Flower's clipping cannot scale an integer array of the reply in place (" + first + "); leave the "
            "integer arrays out of the train message and the reply (ArrayRecord({k: v for k, v in "
            "model.state_dict().items() if v.is_floating_point()}), loaded with strict=False)")
