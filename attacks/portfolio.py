"""The portfolio attack: complementary strategies within one budget, and the candidate
whose gradient explains the observation best.

An audit is only as trustworthy as its strongest attack, and no single setting of the
field's attacks is strongest everywhere: exact L2 matching with L-BFGS recovers untrained
sigmoid / fully connected nets, a strong TV prior wins on small ConvNets, a weak one on
ResNet-18 (bench/results/strength/strength.md (How the defaults were chosen)). The portfolio runs the registered
:data:`STRATEGIES` that apply to the observation (existing presets; the smoothing ones take
their TV weight from the observation, :mod:`attacks.tv_rule`) on equal shares of a fraction
``explore`` of the budget, labels inferred once for all. It scores every candidate by the cosine distance
of its gradient to the observed one (never the ground truth) and visits them from the most
regularised to the least: a later one replaces the pick only if its loss is below ``ratio``
times the pick's. The chosen strategy spends the rest of the budget, from its candidate or as
a fresh run of its schedule (:data:`FRESH_FROM`), and its result replaces the candidate when
it matches at least as well.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from audit.core.errors import ConfigError, NotApplicable
from audit.core.registry import Registry
from audit.core.reasons import Reason
from audit.core.types import Observation, Reconstruction

from attacks.budget_rule import reveals_batch_statistics
from attacks.optimization import OptimizationAttack, not_grouped, ungroupable
from attacks.presets import ATTACKS, defaults_fingerprint
from attacks.tv_rule import RULE, batchnorm_layers

STRATEGIES = Registry("portfolio strategy")


@dataclass(frozen=True)
class Strategy:
    """A preset with settings, and when it applies (``applies(obs, knobs) -> Reason or None``)."""

    preset: str
    settings: Dict[str, Any]
    applies: Callable[[Observation, Dict[str, Any]], Optional[Reason]] = lambda obs, knobs: None  # why it does not


def _has_bn_stats(obs: Observation, knobs: Dict[str, Any]) -> Optional[Reason]:
    """The running-statistics prior applies to BatchNorm models, unless the upload reveals the
    batch's own statistics: every strategy then matches those (the bn-upload term), and the
    running statistics are only a population guess at them, so the strategy would repeat
    ``smooth`` (same candidates, measured) on a share of the budget."""
    if not any(m.running_mean is not None for m in batchnorm_layers(obs)):
        return Reason("no-running-statistics")
    if knobs.get("bn_upload", "auto") not in (0, 0.0):
        if reveals_batch_statistics(obs):
            return Reason("portfolio-bn-upload-instead")
    return None


# most regularised first: the selection order (see the module docstring)
STRATEGIES.add("smooth", Strategy("ig", {"tv": "auto"}),
               "cosine + TV (5e-2 at 32x32 batch 1, grown by attacks.tv_rule), signed Adam (Inverting Gradients): "
               "small ConvNets")
STRATEGIES.add("bn-prior", Strategy("ig", {"tv": "auto", "bn": 1e-2}, _has_bn_stats),
               "cosine + TV + BatchNorm-statistics prior (models with BatchNorm)")
STRATEGIES.add("sharp", Strategy("ig", {"tv": 1e-4}),
               "cosine + TV 1e-4: deep nets (ResNet-18), where the gradient pins the image down")
STRATEGIES.add("exact", Strategy("idlg", {"restarts": 2}),
               "L2 matching with L-BFGS, labels inferred: exact recovery on untrained / sigmoid / FC nets")

#: the selection order, most regularised first (a strategy registered later goes last)
ORDER = ("smooth", "bn-prior", "sharp", "exact")
DEFAULT_BUDGET = 2000  # gradient evaluations when reconstruct() gets none
#: resume="auto": a scheduled optimiser's continuation reruns its whole schedule only when it
#: gets at least this many gradient evaluations (shorter schedules do not converge from
#: scratch; bench/results/strength/strength.md (How the defaults were chosen))
FRESH_FROM = 250


class PortfolioAttack:
    """Run ``strategies`` (names in :data:`STRATEGIES`) on shares of the budget; keep the
    candidate with the lowest gradient-matching loss (``ratio`` rule, module docstring).
    ``knobs`` go to every strategy's preset (e.g. ``simulator=`` for adaptive attacks)."""

    name = "portfolio"

    def __init__(self, strategies: Optional[Sequence[str]] = None, ratio: float = 0.5, explore: float = 0.5,
                 resume: str = "auto", **knobs: Any):
        names = list(STRATEGIES.names()) if strategies is None else (
            [s for s in strategies.split(",") if s] if isinstance(strategies, str) else list(strategies))
        unknown = [n for n in names if n not in STRATEGIES.names()]
        if unknown or not names:
            raise ConfigError(f"portfolio strategies {unknown or names} unknown or empty; valid: "
                              f"{', '.join(STRATEGIES.names())}")
        if not 0 < ratio <= 1:
            raise ConfigError(f"portfolio ratio must be in (0, 1], got {ratio}")
        self.strategies = sorted(names, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER))
        self.ratio = float(ratio)
        if not 0 < explore < 1:
            raise ConfigError(f"portfolio explore must be in (0, 1) (the budget's share for exploring), got {explore}")
        if resume not in ("auto", "warm", "fresh"):
            raise ConfigError(f"portfolio resume must be 'auto', 'warm' or 'fresh', got {resume!r}")
        self.explore, self.resume = float(explore), resume
        self.knobs = knobs
        self.scorer = OptimizationAttack("cosine", simulator=knobs.get("simulator"), name="portfolio-score")

    def _attack(self, name: str, **extra: Any) -> OptimizationAttack:
        strategy = STRATEGIES.get(name)
        return ATTACKS.build(strategy.preset, **{**strategy.settings, **self.knobs, **extra})

    def _candidate(self, name: str, phase: str, rec: Reconstruction, match: float) -> Dict[str, Any]:
        return {"strategy": name, "phase": phase, "match": match,
                "gradient_evaluations": rec.trace.get("gradient_evaluations"),
                "failed_to_optimise": bool(rec.trace.get("failed_to_optimise")),
                "time_s": rec.trace.get("time_s")}

    def match(self, observation: Observation, rec: Reconstruction, seed: int) -> float:
        """The scale-free matching loss (cosine distance of gradients) of a candidate."""
        return self.matches([observation], [rec], [seed])[0]

    def matches(self, observations: Sequence[Observation], recs: Sequence[Reconstruction],
                seeds: Sequence[int]) -> List[float]:
        """:meth:`match` of one candidate per observation, as one batched evaluation."""
        loss = self.scorer.evaluate_many(observations, [r.inputs for r in recs], [r.labels for r in recs], seeds)
        return [v if v == v else float("inf") for v in loss.tolist()]

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Callable[[int, int, float], None]] = None) -> Reconstruction:
        """Explore the applicable strategies on equal shares of half of ``budget`` gradient
        evaluations, then continue the chosen one with the rest."""
        return self.reconstruct_many([observation], budget, [seed], progress)[0]

    def reconstruct_many(self, observations: Sequence[Observation], budget: Optional[int] = None,
                         seeds: Optional[Sequence[int]] = None,
                         progress: Optional[Callable[[int, int, float], None]] = None,
                         max_members: int = 64) -> List[Reconstruction]:
        """:meth:`reconstruct` for observations of one model as one group: every strategy
        explores all of them in one batched run, the candidates are scored in one batched
        evaluation, and each continuation runs once for the observations that chose it."""
        observations = list(observations)
        seeds = list(seeds) if seeds is not None else [0] * len(observations)
        if len(seeds) != len(observations):
            raise ConfigError(f"portfolio: {len(seeds)} seeds for {len(observations)} observations")
        why = ungroupable(observations) if len(observations) > 1 else None
        if why:
            out = [self.reconstruct_many([o], budget, [s], progress, max_members)[0]
                   for o, s in zip(observations, seeds)]
            for rec in out:
                rec.trace["grouped"] = not_grouped(why)
            return out
        budget = DEFAULT_BUDGET if budget is None else int(budget)
        if budget < 0:
            raise ConfigError(f"budget must be >= 0 gradient evaluations, got {budget}")
        first = observations[0]
        chosen = [(n, STRATEGIES.get(n).applies(first, self.knobs)) for n in self.strategies]
        skipped = {n: why for n, why in chosen if why}
        run = [n for n, why in chosen if not why]
        if not run:
            return [self._none_applies(skipped) for _ in observations]
        # successive halving: half the budget explores (equal shares), the chosen strategy
        # continues from its candidate with the other half (scoring costs one evaluation each)
        share = max(1, int(budget * self.explore) // len(run))
        members = range(len(observations))
        candidates: List[List[Dict[str, Any]]] = [[] for _ in members]
        results: List[Dict[str, Reconstruction]] = [{} for _ in members]

        def scaled(offset: int, span: int, total: int):
            def sub_progress(done, part, loss):
                if progress is not None:
                    progress(offset + done * span // max(part, 1), total, loss)
            return sub_progress

        for i, name in enumerate(run):
            try:
                recs = self._attack(name).reconstruct_many(
                    observations, share, seeds, progress=scaled(i * share, share, budget), max_members=max_members)
            except NotApplicable as err:
                skipped[name] = err.reason
                continue
            for k, (rec, value) in enumerate(zip(recs, self.matches(observations, recs, seeds))):
                results[k][name] = rec
                candidates[k].append(self._candidate(name, "explore", rec, value))
        if not candidates[0]:
            return [self._none_applies(skipped) for _ in observations]
        picks = [self._pick(c) for c in candidates]
        continuations: Dict[Tuple[str, int], List[int]] = {}
        for k in members:
            spent = sum(c["gradient_evaluations"] or 0 for c in candidates[k]) + len(candidates[k])
            rest = budget - spent - 2  # the continuation's closing evaluation and its score
            if rest >= share:  # continue the chosen strategy from its candidate
                continuations.setdefault((picks[k]["strategy"], rest), []).append(k)
        for (name, rest), ks in continuations.items():
            spent = budget - rest - 2
            attack = self._attack(name)
            warm = self.resume == "warm" or (self.resume == "auto" and (
                rest < FRESH_FROM or attack.optimizer.settings().get("schedule") == "constant"))
            group = [observations[k] for k in ks]
            if warm:
                attack = self._attack(name, init=_warm_start(
                    {id(observations[k]): results[k][name].inputs for k in ks}))
            recs = attack.reconstruct_many(group, rest, [seeds[k] for k in ks],
                                           progress=scaled(spent, rest, budget), max_members=max_members)
            for k, rec, value in zip(ks, recs, self.matches(group, recs, [seeds[k] for k in ks])):
                more = self._candidate(name, "continue", rec, value)
                more["resumed"] = ("warm: from its candidate (a schedule-free optimiser or a short rest)" if warm else
                                   "fresh: the whole schedule again on the rest (a scheduled step size restarts "
                                   "high)")
                candidates[k].append(more)
                if more["match"] <= picks[k]["match"]:
                    picks[k], results[k][name] = more, rec
        return [self._result(candidates[k], picks[k], results[k], skipped, share, len(observations))
                for k in members]

    def _pick(self, candidates: List[Dict[str, Any]]) -> Dict[str, Any]:
        """Most regularised first; a later candidate wins only below ``ratio`` x the pick's loss."""
        pick = candidates[0]
        for c in candidates[1:]:
            if c["match"] < self.ratio * pick["match"]:
                pick = c
        return pick

    def _none_applies(self, skipped: Dict[str, Reason]) -> Reconstruction:
        """Not applicable: why each strategy does not apply."""
        return Reconstruction.not_applicable(
            Reason("portfolio-none-applies", strategies={n: r.to_dict() for n, r in skipped.items()}),
            attack=self.name)

    def _result(self, candidates, pick, results, skipped, share: int, group: int) -> Reconstruction:
        best = results[pick["strategy"]]
        trace = dict(best.trace)
        trace.update({
            "attack": self.name, "chosen_strategy": pick["strategy"], "chosen_phase": pick["phase"],
            "candidates": candidates, "skipped_strategies": {n: r.to_dict() for n, r in skipped.items()}, "budget_share": share,
            "selection": Reason("portfolio-pick", ratio=self.ratio).to_dict(),
            "gradient_evaluations": sum(c["gradient_evaluations"] or 0 for c in candidates) + len(candidates),
        })
        trace.pop("grouped", None)
        if group > 1:
            trace["grouped"] = Reason("grouped-portfolio", members=group).to_dict()
        failed = all(c["failed_to_optimise"] for c in candidates)
        trace.pop("failed_to_optimise", None)
        trace.pop("failure", None)
        if failed:
            trace["failed_to_optimise"] = True
            trace["failure"] = Reason("portfolio-stalled").to_dict()
        return Reconstruction(best.inputs, best.labels, trace)


def _warm_start(images: Dict[int, torch.Tensor]) -> Callable:
    """An initialisation that starts every restart of an observation at its candidate
    (``images``, keyed by the observation's ``id``) to continue it."""
    def init(shape, generator, device, observation=None):
        return images[id(observation)].detach().to(device).unsqueeze(0).expand(tuple(shape)).clone()
    init.__name__ = "warm-start"
    return init


@ATTACKS.register("portfolio", "the strongest of dlg/ig-style strategies in one budget: exact L2 + L-BFGS, "
                  "cosine + strong / weak TV, BN prior; lowest gradient-matching loss kept")
def portfolio(strategies: Optional[Sequence[str]] = None, ratio: float = 0.5, explore: float = 0.5,
              resume: str = "auto", **knobs: Any) -> PortfolioAttack:
    return PortfolioAttack(strategies, ratio, explore, resume, **knobs)


def _composes() -> Dict[str, Any]:
    """What the portfolio runs (for :func:`attacks.presets.defaults_fingerprint`): each strategy's
    preset, settings and that preset's defaults fingerprint, and the rules' constants."""
    return {"strategies": {n: {"preset": s.preset, "settings": s.settings, "defaults": defaults_fingerprint(s.preset)}
                           for n, s in ((n, STRATEGIES.get(n)) for n in STRATEGIES.names())},
            "order": ORDER, "fresh_from": FRESH_FROM, "default_budget": DEFAULT_BUDGET, "tv_rule": RULE}


portfolio.composes = _composes
