"""The null of an audit: what an attacker gets *without* the shared update, scored with the
same metrics on the audited data, and the identification candidates.

Built once per audit from the data set's train split (disjoint from the private test
images, so adding private images never changes it):

* ``pool``: unrelated images of the same data set, a seeded draw;
* ``guesses``: data-only guesses -- the mean train image, a flat image of the mean colour,
  and the total-variation prior alone (smooth noise descended on TV only: what the image
  prior of the optimisation attacks produces without a gradient);
* ``candidates``: the first ``K - 1`` pool images; a reconstruction *identifies* its private
  image when the private image is its nearest among itself and these (chance ``1 / K``).

Per private image, :meth:`Null.evidence` scores every null item as if it were the
reconstruction (aligned PSNR, and its rank with itself left out of the candidates, so the
leak rule's false-positive rate is measured leave-one-out); :meth:`Null.score` scores a
matched reconstruction. The rule itself is in :mod:`audit.report.rule`.
"""
from __future__ import annotations

from functools import cached_property
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from audit.core.errors import ConfigError
from audit.core.evidence import Similarity, aligned_psnr, rank_among, similarity
from audit.core.records import ImageEvidence, NullEvidence

POOL = 127  # unrelated images: K - 1 = 63 candidates and a chance level over 127 + 3 guesses
CANDIDATES = 64  # K: the private image and K - 1 unrelated ones
MIN_CANDIDATES = 50
TV_STEPS = 200


def tv_prior_guess(shape: Sequence[int], seed: int, steps: int = TV_STEPS) -> Tensor:
    """Uniform noise descended on anisotropic total variation alone (Adam, seeded)."""
    gen = torch.Generator().manual_seed(int(seed))
    x = torch.rand(1, *shape, generator=gen).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss = (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()
        loss.backward()
        opt.step()
        with torch.no_grad():
            x.clamp_(0, 1)
    return x.detach()


class Null:
    """The null items and the candidates of one audit (see the module docstring). What a run key
    reads (the pool's size, K, the similarity's name) is known at once; the items, among them the
    descended total-variation guess, and their distances are computed on first use."""

    def __init__(self, names: List[str], pool: Tensor, train_mean: Tensor, seed: int, candidates: int,
                 similarity: Similarity, similarity_note: Optional[str], device: torch.device | str):
        self.names, self.pool_size, self.candidates = names, len(pool), candidates  # K
        self.similarity, self.similarity_note, self.device = similarity, similarity_note, device
        self._pool, self._train_mean, self._seed = pool, train_mean, int(seed)

    @classmethod
    def build(cls, dataset, seed: int, device: torch.device | str = "cpu", pool: int = POOL,
              candidates: int = CANDIDATES) -> "Null":
        train = dataset.train_images
        size = min(pool, len(train))
        k = min(candidates, size)  # K - 1 candidates must leave one out for a pool item
        if k < MIN_CANDIDATES:
            raise ConfigError(f"the {dataset.name} train split has {len(train)} images; the leak rule needs at least "
                              f"{MIN_CANDIDATES} unrelated images for its candidates and null; use a larger data set")
        gen = torch.Generator().manual_seed(int(seed))
        index = torch.randperm(len(train), generator=gen)[:size]
        names = [f"unrelated train image {int(i)}" for i in index]
        names += ["mean train image", "mean colour", "total-variation prior alone"]
        sim, note = similarity(tuple(train.shape[1:]), device=device)
        return cls(names, train[index].float(), train.float().mean(0, keepdim=True), seed, k, sim, note, device)

    @cached_property
    def items(self) -> Tensor:
        """(N, C, H, W): the pool, then the data-only guesses."""
        mean_image = self._train_mean
        mean_colour = mean_image.mean((-2, -1), keepdim=True).expand_as(mean_image).contiguous()
        prior = tv_prior_guess(mean_image.shape[1:], self._seed)
        return torch.cat([self._pool, mean_image, mean_colour, prior]).to(self.device)

    @cached_property
    def _prepared(self) -> Tensor:  # every item in the similarity's representation
        return self.similarity.prepare(self.items)

    @cached_property
    def item_distances(self) -> Tensor:
        """(N, pool_size): every item against every pool image."""
        return self.similarity.between(self._prepared, self._prepared[:self.pool_size]).cpu()

    @property
    def prepared_candidates(self) -> Tensor:
        """The K - 1 candidates in the similarity's representation."""
        return self._prepared[: self.candidates - 1]

    def _candidate_columns(self, item: int) -> Tensor:
        """The pool columns serving as the ``K - 1`` candidates of null item ``item`` (never itself)."""
        cols = [c for c in range(self.pool_size) if c != item][: self.candidates - 1]
        return torch.as_tensor(cols)

    def evidence(self, private: Tensor) -> NullEvidence:
        """Every null item scored against one private image ``(C, H, W)``, leave-one-out."""
        p = private.unsqueeze(0).to(self.items.device)
        scores = aligned_psnr(self.items, p).cpu()
        to_truth = self.similarity.distances(self.items, p).cpu()[:, 0]
        ranks = []
        for item in range(len(self.items)):
            cols = self._candidate_columns(item)
            ranks.append(int(rank_among(self.item_distances[item, cols], to_truth[item])))
        return NullEvidence(names=list(self.names), scores=[float(s) for s in scores], ranks=ranks,
                            candidates=self.candidates, pool=self.pool_size, similarity=self.similarity.name)

    def score(self, matched: Tensor, private: Tensor) -> List[ImageEvidence]:
        """A reconstruction matched to its private batch ``(B, C, H, W)``: per image, its
        aligned PSNR and the private image's rank among the K candidates."""
        matched, private = matched.to(self.items.device), private.to(self.items.device)
        scores = aligned_psnr(matched, private).cpu()
        queries = self.similarity.prepare(matched)
        to_cands = self.similarity.between(queries, self.prepared_candidates).cpu()
        truths = self.similarity.prepare(private)
        to_truth = torch.stack([self.similarity.between(queries[j:j + 1], truths[j:j + 1])[0, 0]
                                for j in range(len(private))]).cpu()
        ranks = rank_among(to_cands, to_truth)
        return [ImageEvidence(aligned_psnr=float(s), rank=int(r), candidates=self.candidates)
                for s, r in zip(scores, ranks)]

    def describe(self) -> Dict[str, object]:
        return {"pool": self.pool_size, "candidates": self.candidates, "guesses": self.names[self.pool_size:],
                "similarity": self.similarity.name, "lpips_unavailable": self.similarity_note,
                "source": "a seeded draw of unrelated images from the train split (never the private test images)"}


def null_evidence(null: Null, private: Sequence[Tuple[Tensor, Tensor]]) -> List[List[NullEvidence]]:
    """Per private batch, per image in it: its null evidence."""
    return [[null.evidence(x[j]) for j in range(len(x))] for x, _ in private]
