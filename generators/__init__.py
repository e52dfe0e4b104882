"""Generative models used as image priors (GGL, GIAS, GIFD, the ``generator`` prior).

* :class:`ImageGenerator` -- the interface (latent [+ label] -> image in [0, 1], with
  intermediate features); :func:`as_generator` adapts any ``nn.Module`` with ``latent_dim``.
* ``dcgan`` (:data:`GENERATORS`) -- a small DCGAN trainable on a CPU in minutes.
* :func:`train_generator` -- train it on the *train* split of a data set (disjoint from the
  audited test images); :func:`default_generator` -- the same, cached under
  ``$GIA_AUDIT_CACHE``; :func:`save_generator` / :func:`load_generator` -- checkpoints
  (``module:attr`` factory for a user's generator);
* :func:`resolve_generator` / :func:`condition_labels` -- the attacker's frozen generator
  and the classes it is conditioned on.
"""
from audit.core.cache import cache_dir

from generators.auxiliary import GeneratorRecipe, default_generator, default_recipe, train_generator
from generators.base import ImageGenerator, ModuleGenerator, as_generator, check_compatible
from generators.checkpoint import load_generator, read_checkpoint, resolve_factory, save_generator
from generators.dcgan import GENERATORS, DCGANDiscriminator, DCGANGenerator, build_generator
from generators.resolve import CONDITIONS, condition_labels, generate, generator_info, resolve_generator
from generators.training import TrainHistory, TrainSettings, train_gan

__all__ = [
    "CONDITIONS", "GENERATORS", "DCGANDiscriminator", "DCGANGenerator", "GeneratorRecipe", "ImageGenerator",
    "ModuleGenerator", "TrainHistory", "TrainSettings", "as_generator", "build_generator", "cache_dir",
    "check_compatible", "condition_labels", "default_generator", "default_recipe", "generate",
    "generator_info", "load_generator", "read_checkpoint", "resolve_factory", "resolve_generator",
    "save_generator", "train_gan", "train_generator",
]
