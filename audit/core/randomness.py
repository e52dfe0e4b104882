"""Randomness that a batched (``torch.func.vmap``) attack can draw inside its program.

A defense draws its randomness from a ``torch.Generator`` it is handed. A generator cannot be
used under ``vmap``, so an attack that runs the defense's randomness inside one batched
program over many members (EOT draws of every image x restart of a group) hands the defense
:data:`VMAP_DRAWS` instead: the defense's sampling helpers (``defenses.common.randn`` /
``rand``) then draw from torch's global generator, which ``vmap(randomness="different")``
splits into independent draws per member, and which the attack seeds for the whole run, so
the same seed gives the same numbers. A defense declares that its randomness goes through
those helpers with ``Defense.vmap_draws = True``.
"""
from __future__ import annotations


class VmapDraws:
    """The marker passed as ``generator``: draw from the global generator (see module doc)."""

    device = None

    def __repr__(self) -> str:
        return "VMAP_DRAWS"


VMAP_DRAWS = VmapDraws()


def is_vmap_draws(generator) -> bool:
    return isinstance(generator, VmapDraws)
