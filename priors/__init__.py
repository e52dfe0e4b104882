"""Image priors for optimisation attacks.

Each prior is ``prior(x, context) -> scalar`` for one restart (see :mod:`priors.base`);
build them by name from :data:`PRIORS` (``PRIORS.build("tv", kind="isotropic")``).
"""
from priors.base import PRIORS, Prior, PriorContext, requiring, weighted_total
from priors.batchnorm import BatchNormStatistics, UploadedBatchNormStatistics
from priors.features import LastLayerFeatures, classifier_head, per_image_features
from priors.group import GroupConsistency
from priors.pixel import ImageL2, PixelRange
from priors.smoothness import TotalVariation

__all__ = ["PRIORS", "Prior", "PriorContext", "requiring", "weighted_total", "TotalVariation", "ImageL2", "PixelRange",
           "BatchNormStatistics", "UploadedBatchNormStatistics", "GroupConsistency", "LastLayerFeatures",
           "classifier_head", "per_image_features"]
