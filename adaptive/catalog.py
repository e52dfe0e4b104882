"""Importing this module registers the adaptive attacks of this package in
:data:`attacks.ATTACKS` (``attacks/__init__.py`` imports it)."""
from . import censor_invariants, masking, precode_latent, svd_subspace, through_defense  # noqa: F401

ADAPTIVE_ATTACKS = ("through-defense", "mask-replay", "layer-drop", "censor-invariants", "svd-subspace",
                    "precode-latent")
