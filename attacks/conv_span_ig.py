"""``conv-span-ig``: the optimisation attack ``ig`` started from the conv-span attack's batch.

:class:`~attacks.conv_span.ConvSpan` runs on a share of the budget. A certified batch is final.
Otherwise ``ig`` runs the rest from the recovered images (every restart starts there) with the
labels conv-span gave them, and the attack returns whichever of the two batches reproduces the
upload better: the attacker's own measure (:func:`~attacks.conv_span.upload_error`), never the
private images. Where conv-span does not apply, the run is plain ``ig`` on the whole budget
and its trace says why. The planner does not plan it: on ResNet-18 conv-span alone is exact where
the span holds, and a few ig steps from a stalled batch move its upload error little (the test
ResNet at 5 steps: 0.147 from the conv-span start, 0.189 from a random one).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from audit.core.errors import ConfigError
from audit.core.types import Observation, Reconstruction

from attacks.conv_span import ConvSpan, upload_error
from attacks.presets import ATTACKS

#: the share of the budget conv-span runs on before ``ig`` takes the rest
SPAN_SHARE = 0.5
#: the recovered images are kept this far inside the pixels' range, so a box's inverse stays finite
INSIDE = 1e-3


class ConvSpanIg:
    """``ig`` warm-started from conv-span (module docstring); ``share``: conv-span's part of the
    budget; ``ig``: the optimisation attack's settings."""

    name = "conv-span-ig"
    uses_budget = True

    def __init__(self, share: float = SPAN_SHARE, conv_span: Optional[ConvSpan] = None, **ig: Any):
        if not 0 < share < 1:
            raise ConfigError(f"conv-span-ig: share must be in (0, 1), got {share}")
        self.share, self.conv_span, self.ig = float(share), conv_span or ConvSpan(), ig

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Callable] = None) -> Reconstruction:
        first = None if budget is None else max(1, int(round(self.share * budget)))
        rest = None if budget is None else max(1, budget - first)
        found = self.conv_span.reconstruct(observation, first, seed)
        if not found.applicable:
            rec = ATTACKS.build("ig", **self.ig).reconstruct(observation, budget, seed, progress=progress)
            rec.trace["conv_span"] = found.reason.to_dict()  # a code: the report words it
            return rec
        if found.trace.get("certified"):
            found.trace["ig"] = "skipped-certified"
            return found
        start = found.inputs.detach().clamp(INSIDE, 1 - INSIDE)

        def from_conv_span(shape, _generator, device):
            return start.to(device).unsqueeze(0).expand(shape).clone()
        attack = ATTACKS.build("ig", **{**self.ig, "init": from_conv_span})
        paired = dataclasses.replace(observation, labels=found.labels.to(observation.device))
        refined = attack.reconstruct(paired, rest, seed, progress=progress)
        errors = {"conv-span": found.trace["certificate_error"],
                  "ig": upload_error(observation, refined.inputs, found.labels)}
        kept = min(errors, key=errors.get)
        rec = found if kept == "conv-span" else refined
        rec.trace.update(conv_span={k: found.trace.get(k) for k in ("layers", "residual", "certificate_error",
                                                                      "certified", "seconds")},
                         upload_errors=errors, kept=kept, labels_from="conv-span")  # each image's own
        return rec


@ATTACKS.register("conv-span-ig", "ig started from the conv-span attack's batch (with its labels) where conv-span "
                  "applies and does not certify it; the batch that reproduces the upload better is kept")
def conv_span_ig(share: float = SPAN_SHARE, **ig: Any) -> ConvSpanIg:
    return ConvSpanIg(share, **ig)
