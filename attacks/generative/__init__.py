"""Generative-prior attacks: GGL (nevergrad latent search), GIAS (latent then generator
parameters) and GIFD (intermediate features, l1-ball projection); and the ``generator``
search space for the optimisation attack (``ATTACKS.build("ig", box="generator")``).

The attacker's generator defaults to a DCGAN trained on the embedded data's *train* split
(disjoint from the audited test images), cached under ``$GIA_AUDIT_CACHE``; pass
``generator=PATH`` (a ``gia-audit train-generator`` checkpoint) or
``generator_factory=package.module:attr`` (+ ``generator=`` weights) for another one.
"""
from priors.generator import BoundGeneratorBox, GeneratorBox

from attacks.presets import ATTACKS
from attacks.search_space import BOXES
from attacks.generative.common import GenerativeAttack, GenerativeSetup, Scorer, adam_search, latent_kl, search_latents
from attacks.generative.ggl import GGL, nevergrad_optimizer
from attacks.generative.gias import GIAS
from attacks.generative.gifd import GIFD, project_l1_ball

ATTACKS.add("ggl", GGL, "GGL: nevergrad (CMA-ES) latent search of a generator, L2 matching + KL latent prior")
ATTACKS.add("gias", GIAS, "GIAS: latent search, then per-image generator-parameter search")
ATTACKS.add("gifd", GIFD, "GIFD: latent then intermediate-feature search with l1-ball projection, best layer")
BOXES.add("generator", GeneratorBox, "latent space of a generator: image = G(z, inferred labels)")

__all__ = ["GGL", "GIAS", "GIFD", "GenerativeAttack", "GenerativeSetup", "Scorer", "GeneratorBox",
           "BoundGeneratorBox", "adam_search", "latent_kl", "nevergrad_optimizer", "project_l1_ball",
           "search_latents"]
