"""The papers' defenses audited at their own settings: does each headline claim survive an
adaptive attacker?

``python bench/bench_papers.py --docs papers`` runs every row of :data:`ROWS` (one headline
figure of CENSOR, SVDefense, the Bayes framework or Refiner) through the audit engine and
writes ``docs/papers.md``. Per row: the paper's setting (with its table or section), the
row's own, and one label, "at the paper's setting" (everything but the data set equal) or
"scaled: <what differs>"; then the paper's number, our run of the paper's own attack at the
paper's settings, the planner's attacks (``auto``, each at its own preset, in an audit of
its own) and the paper's named adaptive attack, each as mean PSNR / SSIM / LPIPS and
identification among K candidates with its exact 95% interval and the cell's chance; and a
conclusion by the rule of :mod:`bench.papers_verdict`.

Profiles (``--profile``): ``cpu`` (default) runs what a CPU reaches at the paper's setting
(ResNet-18 at width 8, ATS and Refiner on fewer images); ``gpu`` the rest at the papers'
settings, in slices that each fit one GPU call (below); ``quick`` (2 images, tiny budgets,
never writes docs) checks the plumbing.

Every finished cell is kept in ``bench/papers_results/<profile>-<data>/<row>.json`` with the
key of the audit call that made it: the page renders from these files, a rerun skips stored
keys, and a changed row setting reruns only that row's cells.
A cell runs in slices (:func:`cell_slices`) whose results stay in ``<row>.partial/`` until it
finishes, so it resumes from a fresh clone. ``--render`` writes the page from the stored cells.

A lent GPU call runs the gpu profile slice by slice: :data:`GPU_CALL` (also ``--help``).
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Set, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from audit.engine.utility import PROTOCOL  # noqa: E402
from bench.docs_table import ROOT, add_docs_option, command_line, without_options, write_table  # noqa: E402
from bench.papers_stale import (KEY_CHANGED, PlanCache, audit_of, cell_fingerprints, run_key,  # noqa: E402
                                 stale_attacks, stale_key, stale_plan)
from bench.papers_verdict import (INCONCLUSIVE, LEVEL, NOT_RUN, CellEvidence, Conclusion,  # noqa: E402
                                  cell_evidence, conclude_chain, conclude_leaks, conclude_order, conclude_protects,
                                  conclude_steps, conclude_utility, control_from_report, identification_text,
                                  interval_text)

PAPERS = ("CENSOR", "SVDefense", "Bayes framework", "Refiner")
PROFILES = ("cpu", "gpu", "quick")
RESULTS = ROOT / "bench" / "papers_results"
AT_PAPER = "at the paper's setting"
#: what a profile runs when it scales a row down; 'quick' shrinks every row to this
QUICK = {"images": 2, "budget": 4, "held_out": 2}
#: private images a cell by default (a paper with fewer evaluation images still gets these)
IMAGES = 16


# --------------------------------------------------------------------------- the rows
@dataclass(frozen=True)
class AttackRef:
    """One named attack of a row: registry name, its settings and how the page names it."""

    name: str
    args: Dict[str, Any] = field(default_factory=dict)
    label: str = ""


@dataclass(frozen=True)
class PaperSetting:
    """What the paper ran for the row's figure, as its text (or ``../shared/notes/``) gives it.
    ``None`` where the paper does not say; ``anchor``: verbatim text of the paper or notes
    holding the figure's numbers (a test finds it there)."""

    source: str
    model: str
    model_args: Dict[str, Any]
    data: str
    iterations: Optional[int]
    restarts: int = 1
    images: Optional[int] = None
    steps: Tuple[int, ...] = (0,)
    batch: int = 1
    train_batch: Optional[int] = None
    hparams: str = ""
    anchor: str = ""
    #: the mode the attacked client computes its gradient in ("eval": BatchNorm reads its
    #: running statistics, as code that calls ``model.eval()`` before the attack does)
    client_mode: str = "train"
    #: where the client mode comes from when the paper's text does not say it (the authors' code)
    mode_source: str = ""
    #: the optimiser that trains the model between the attacked steps (``audit.run``'s
    #: ``server_optimizer``: one client, FedSGD, so centralised training) and where it comes from
    train_optimizer: Optional[str] = None
    train_source: str = ""
    train_lr: float = 0.1

    def training_text(self, lr: float) -> Optional[str]:
        """How the model is trained between the attacked steps, where the paper's code says."""
        if self.train_optimizer is None:
            return None
        from audit.core.local_training import LocalOptimizer

        return (f"trained between steps with {LocalOptimizer.parse(self.train_optimizer).describe()} at lr {lr:g}"
                + (f" ({self.train_source})" if self.train_source else ""))

    @property
    def budget(self) -> Optional[int]:
        return None if self.iterations is None else self.iterations * self.restarts

    def mode_text(self) -> Optional[str]:
        """How the attacked client computes its gradient, where it is not the default train mode."""
        return None if self.client_mode == "train" else f"the gradient computed in {self.client_mode} mode"

    def text(self) -> str:
        its = ("iterations not stated" if self.iterations is None else f"{self.iterations:,} iterations"
               + (f" x {self.restarts} restarts" if self.restarts > 1 else ""))
        steps = ", ".join(map(str, self.steps))
        parts = [f"{self.source}: {self.model}", self.data, f"batch {self.batch}", its,
                 f"{self.images} images" if self.images else "images not stated",
                 f"step{'s' if len(self.steps) > 1 else ''} {steps}"]
        if self.train_batch:
            parts.append(f"training batch {self.train_batch}")
        if self.training_text(self.train_lr):
            parts.append(self.training_text(self.train_lr))
        if self.mode_text():
            parts.append(self.mode_text() + (f" ({self.mode_source})" if self.mode_source else ""))
        if self.hparams:
            parts.append(self.hparams)
        return "; ".join(parts)


@dataclass(frozen=True)
class Scale:
    """How one profile runs a row below the paper's setting (``None``: as the paper), and
    what its planner cell runs (``planner``: a subset of ``auto``, ``why`` says why)."""

    model_args: Optional[Dict[str, Any]] = None
    budget: Optional[int] = None
    steps: Optional[Tuple[int, ...]] = None
    images: Optional[int] = None
    planner: Optional[Tuple[str, ...]] = None
    planner_args: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    planner_budget: Optional[int] = None
    adaptive_budget: Optional[int] = None
    why: str = ""


@dataclass(frozen=True)
class Row:
    """A headline figure of a paper and the audit that checks it."""

    id: str
    paper: str
    figure: str
    paper_number: str
    claim: str  # protects | leaks | order | utility
    model: str
    defense: str
    defense_args: Dict[str, Any]
    attacks: Tuple[AttackRef, ...]  # the paper's own attack(s)
    setting: PaperSetting
    adaptive: Optional[AttackRef] = None  # the paper's named adaptive attack
    adaptive_steps: Optional[Tuple[int, ...]] = None  # steps of the adaptive cell (default: all)
    paper_steps: Optional[Tuple[int, ...]] = None  # steps of the paper's attack cells (default: all)
    scales: Dict[str, Scale] = field(default_factory=dict)  # profile -> how it is scaled
    profiles: Tuple[str, ...] = ("cpu", "quick")  # the profiles that run the row
    budget_if_unstated: int = 200  # the budget where the paper states no iteration count
    paper_psnr: Optional[float] = None  # the paper's number for its own attack, for the 3 dB check
    leak_cell: str = "paper"  # for claim "leaks": which cell must leak
    claim_steps: Optional[Tuple[int, ...]] = None  # the steps the claim is about (default: all run)
    order_psnr: Dict[str, float] = field(default_factory=dict)  # claim "order": paper dB per attack
    utility: Optional[Tuple[str, float]] = None  # (claim, ratio) for claim "utility"
    utility_steps: int = PROTOCOL.rounds  # rounds of the utility recipe (docs/evidence.md)
    differences: Tuple[str, ...] = ()  # what else differs from the paper (counted in the label)
    notes: Tuple[str, ...] = ()  # what the paper leaves open, and our code's known departures
    search: bool = False  # the paper's attacks' weights chosen by a grid search on held-out images
    lr: float = 0.1
    planner_budget: Optional[int] = None  # the planner cell's budget (default: the paper cell's)
    store: Optional[str] = None  # the engine store's folder (default ``<defense>-<model>``)
    #: judged at each step of ``claim_steps`` apart, a step whose model collapsed not judged
    per_step: bool = False
    #: the paper's own words for the claim judged, with where they stand
    quote: str = ""
    #: claim "order": the kind of each pairwise claim (:data:`bench.papers_verdict.PAIR_KINDS`)
    #: where the paper's text states it; else taken from the paper's gaps
    order_kinds: Tuple[Tuple[str, str], ...] = ()
    #: claim "chain": the rows (in order) whose paper cells the paper ranks by PSNR
    chain: Tuple[str, ...] = ()

    def scale(self, profile: str) -> Scale:
        """The profile's scaling (the quick check shrinks the cpu profile's row)."""
        return self.scales.get("cpu" if profile == "quick" else profile) or Scale()


# the paper's attacks, with their settings (../shared/notes)
#: Inverting Gradients as the papers run it: plain Adam with step decay, and none of ``ig``'s own
#: additions (the features read off the output layer): each paper attack built on ``ig`` starts here
PAPER_IG = {"objective": "cosine", "signed": False, "schedule": "step", "features": 0.0}
#: CENSOR's IG "uses Adam on signed gradients" (Sec. V, Attacks Configurations)
IG_CENSOR = {**PAPER_IG, "signed": True, "tv": 1e-4, "restarts": 4, "lr": 0.1}
CENSOR_IG = AttackRef("ig", IG_CENSOR, "IG (cosine, TV 1e-4, signed Adam 0.1, 4 restarts)")
#: SVDefense names IG (cosine, Adam) and gives neither TV weight, learning rate nor iterations:
#: Inverting Gradients' own settings (cosine, TV 1e-4, Adam 0.1, step decay) stand in for them
IG_SVD = {**PAPER_IG, "tv": 1e-4, "lr": 0.1}
SVD_IG = AttackRef("ig", IG_SVD, "IG (cosine, TV 1e-4, Adam 0.1)")
#: the Bayes rows' attacks start from Gaussian noise, N(0, 1) pixels, as the paper's code does
BAYES_START = {"init": "randn"}
BAYES_ATTACKS = (
    AttackRef("bayes-optimal", dict(BAYES_START), "Bayes (the defense's likelihood + TV)"),
    AttackRef("bayes-l2", dict(BAYES_START), "L2 + TV"),
    AttackRef("bayes-l1", dict(BAYES_START), "L1 + TV"),
    AttackRef("bayes-cos", dict(BAYES_START), "cosine + TV"),
)
REFINER_IG = AttackRef("ig", {**PAPER_IG, "tv": 1e-4, "lr": 0.01},
                       "IG (cosine, TV 1e-4, Adam 0.01)")
EOT = {"samples": 4}
#: the Bayes paper's networks as its JAX code initialises them (flax's defaults)
FLAX = {"init": "lecun"}

#: ResNet-18 on 2 CPU cores: width 8 (8-16-32-64 channels), 100 gradient evaluations per attack
#: where CENSOR or SVDefense runs inside the attacks, 2-4x that where the defense is cheap; the
#: learned inverter trains on 256 pairs
R18_CPU = {"width": 8}
R18_BUDGET = 100
INVERTER_CPU = {"learned-inverter": {"pairs": 256}}
R18_WHY = "ResNet-18 at width 64 and thousands of iterations is beyond 2 CPU cores; `--profile gpu` runs it"
#: what the gpu profile runs where SVDefense states no iteration count (its IG's is not given)
SVD_GPU_BUDGET = 4000
SOTERIA_REPLAY_LEFT_OUT = ("not through-defense: it runs Soteria's per-feature pullbacks on every dummy, and "
                           "mask-replay reads the mask it would replay from the observation")
SOTERIA_CONVBIG_PLANNER = ("ig", "portfolio", "mask-replay", "layer-drop")
SOTERIA_CONVBIG_WHY = ("not through-defense nor the learned inverter: they call Soteria itself, 5,184 feature "
                       "pullbacks on ConvBig each, once an image-iteration and for 1,024 training pairs")
CENSOR_NOTES = ("CENSOR here never shares the clean gradient; the authors' code falls back to it when no "
                "candidate lowers the loss",)
CENSOR_IG_NOTE = ("IG on signed gradients, as CENSOR's text says (\"uses Adam on signed gradients\", Sec. V)",)
SVD_NOTES = ("SVDefense's channel weight matrix is read as diag(sqrt(w)) and its threshold as E = 1 - exp(-eta H): "
             "the paper's equations are lost from its text",)
SVD_IG_NOTE = ("SVDefense gives IG's objective and optimiser (cosine, Adam) but no TV weight, learning rate or "
               "iteration count; Inverting Gradients' own (TV 1e-4, Adam 0.1, step decay) stand in",)
R18 = "CIFAR ResNet-18 (3x3 stem), width 64"
#: Refiner's Table 7 rows: alpha, the paper's PSNR, the claim and the paper's words for it
REFINER_ALPHAS = (
    (0.0, 21.24, "leaks", "\"when alpha is set to 0 (without noise-blended initialization), the PSNR surges, indicating "
                          "high semantic similarity between robust and clients' data\" (Sec. 6, Impact of alpha)"),
    (0.5, 13.20, "protects", "\"we employ noise-blended initialization, enabling a significant decrease in PSNR with a "
                             "moderate sacrifice in PMM\" (Sec. 6, Impact of alpha); alpha 0.5 is the paper's default"),
    (0.9, 10.52, "protects", "Table 7: the lowest PSNR of the three, 10.52 dB, at alpha 0.9"))
#: the Bayes paper's words on Table 2 (Sec. 6)
BAYES_GAUSS_QUOTE = ("\"Bayes optimal adversary generally performs best [...] in the case of Gaussian defense, l2 and "
                     "Bayes attacks are equivalent up to a constant factor [...] and it is expected that they achieve "
                     "a similar result\" (Sec. 6, Table 2): judged as Bayes ~ L2 (within 1 dB) and Bayes not behind L1 "
                     "or cosine by more than 1 dB")
BAYES_QUOTE = ("\"In all other cases, Bayes optimal adversary outperforms the other two attacks\" (Sec. 6, Table 2); "
               "the pairs the paper's table puts within 1 dB are judged as ties")


def r18_scales(cpu_budget: int, *, planner: Optional[Tuple[str, ...]] = None, why: str = "",
               gpu_budget: Optional[int] = None, cpu_steps=None, gpu_steps=None, images: Optional[int] = None,
               gpu_adaptive_budget: Optional[int] = None, cpu_adaptive_budget: Optional[int] = None
               ) -> Dict[str, Scale]:
    """The cpu profile's width-8 ResNet-18 and the gpu profile's width 64 at the paper's budget
    (or ``gpu_budget`` where the paper states none); ``images`` where the paper's count does
    not fit."""
    return {"cpu": Scale(model_args=R18_CPU, budget=cpu_budget, steps=cpu_steps, images=images, planner=planner,
                         planner_args=INVERTER_CPU, why=why or R18_WHY, adaptive_budget=cpu_adaptive_budget),
            "gpu": Scale(budget=gpu_budget, steps=gpu_steps, images=images, planner=planner, why=why,
                         adaptive_budget=gpu_adaptive_budget)}


def censor_setting(source: str, **kw) -> PaperSetting:
    """CENSOR's experiments as its code runs them: ``run_rec.py`` (KaiyuanZh/censor) calls
    ``model.eval()`` before it computes the attacked gradient."""
    base = dict(model=R18, model_args={}, data="CIFAR-10 32x32", iterations=15000, restarts=4, images=10,
                client_mode="eval", mode_source="the authors' run_rec.py calls model.eval() before the gradient",
                hparams="IG: cosine, TV 1e-4, Adam 0.1, lr x0.1 at 3/8, 5/8, 7/8, best of 4 restarts")
    return PaperSetting(source, **{**base, **kw})


def svd_setting(source: str, **kw) -> PaperSetting:
    base = dict(model="ResNet-18", model_args={}, data="MNIST", iterations=None, images=128,
                hparams="IG (cosine, Adam); batch, local epochs and steps 1, first round")
    return PaperSetting(source, **{**base, **kw})


BOTH = ("cpu", "gpu", "quick")

ROWS: List[Row] = [
    # ---------------------------------------------------------------- CENSOR (paper 001)
    Row("censor-none", "CENSOR", "Table I, CIFAR-10, IG, no defense", "26.32 dB (SSIM 0.814, LPIPS 0.091)",
        "leaks", "resnet18", "none", {}, (CENSOR_IG,),
        censor_setting("Table I", anchor="CIFAR-10, IG: none .0023/.0905/26.324/.8139"),
        scales=r18_scales(4 * R18_BUDGET), profiles=BOTH, paper_psnr=26.32, notes=CENSOR_IG_NOTE),
    Row("censor-soteria", "CENSOR", "Table I, CIFAR-10, IG, Soteria (10% of fc-input features)",
        "12.54 dB (SSIM 0.122, LPIPS 0.585)", "protects", "resnet18", "soteria", {"ratio": 0.1, "layer": "last"},
        (AttackRef("mask-replay", IG_CENSOR, "IG with Soteria's mask on the dummy (the paper's code)"),),
        censor_setting("Table I", hparams="Soteria prunes 10% of fc-input features; IG as the authors' code runs "
                                          "it, with Soteria's mask on the dummy gradient",
                       anchor="Soteria .0558/.5846/12.537/.1222"),
        scales=r18_scales(R18_BUDGET, planner=("mask-replay", "ig", "portfolio", "layer-drop", "analytic",
                                               "learned-inverter"), why=SOTERIA_REPLAY_LEFT_OUT),
        profiles=BOTH, paper_psnr=12.54, notes=CENSOR_IG_NOTE),
    Row("censor-censor", "CENSOR", "Table I, CIFAR-10, IG, CENSOR (T=20)", "10.27 dB (SSIM 0.011, LPIPS 0.688)",
        "protects", "resnet18", "censor", {"trials": 20}, (CENSOR_IG,),
        censor_setting("Table I", hparams="CENSOR T=20; IG as above", anchor="CENSOR .0939/.6884/10.272/.0112"),
        adaptive=AttackRef("through-defense", {**IG_CENSOR, **EOT}, "EOT over CENSOR's draws (Table III, with GIFD: "
                                                                   "13.32 -> 13.39 dB on ImageNet)"),
        scales=r18_scales(R18_BUDGET, gpu_adaptive_budget=4000, cpu_adaptive_budget=4 * R18_BUDGET), profiles=BOTH,
        paper_psnr=10.27,
        notes=CENSOR_NOTES + CENSOR_IG_NOTE + ("the paper gives no budget for its EOT attack; it runs 4 draws per iteration, so the "
                              "gpu profile gives it 4,000 gradient evaluations and the cpu profile 4x the row's",)),
    Row("censor-rounds", "CENSOR", "Table V, CENSOR across rounds 0-9 (ImageNet, GIFD)",
        "13.32, 10.50, 9.94, 10.37, 9.07, 10.16, 10.28, 9.95, 10.69, 10.65 dB", "protects", "resnet18", "censor",
        {"trials": 20}, (CENSOR_IG,),
        censor_setting("Table V", data="ImageNet 64x64", iterations=None, restarts=1, steps=tuple(range(10)),
                       hparams="GIFD (1,000 steps per generator layer, lr 0.1, cosine + TV 1e-4)",
                       anchor="4 | 0.1717 | 0.7528 | 9.07 | 0.041"),
        scales=r18_scales(R18_BUDGET, cpu_steps=(0, 9), gpu_steps=(0, 9), gpu_budget=15000),
        profiles=BOTH, differences=("IG instead of GIFD (no pretrained generator here)",),
        notes=CENSOR_NOTES + CENSOR_IG_NOTE),
    Row("censor-later", "CENSOR", "rounds 5-9 with CENSOR off after round 4 (SVDefense's adaptive attack)",
        "16.41 dB (SVDefense Table I, MNIST)", "leaks", "resnet18", "censor", {"trials": 20, "active_rounds": 5},
        (CENSOR_IG,),
        censor_setting("SVDefense Table I (its number; the model and client are CENSOR's Table I setting here)",
                       model="SVDefense's ResNet-18 on MNIST (its Table I), not CENSOR's CIFAR ResNet-18",
                       data="MNIST", images=128, steps=(5, 6, 7, 8, 9), iterations=None, restarts=1,
                       hparams="CENSOR in the first 5 epochs; IG in the later, undefended ones; the row runs CENSOR's "
                               "CIFAR ResNet-18 and IG, whose Table I has no such experiment",
                       client_mode="train",
                       anchor="| CENSOR [21] | 8.1940 | 0.6958 | 16.4071 | 0.2881 |"),
        scales=r18_scales(4 * R18_BUDGET, cpu_steps=(5, 9), gpu_steps=(5, 9), images=IMAGES, gpu_budget=15000),
        profiles=BOTH,
        differences=("rounds of FedSGD instead of epochs",), store="censor-resnet18-later", notes=CENSOR_IG_NOTE),
    # ---------------------------------------------------------------- SVDefense (paper 002)
    Row("svd-prune", "SVDefense", "Table I, prune 90%: IG -> mask replay", "12.93 -> 36.13 dB", "leaks",
        "resnet18", "prune", {"ratio": 0.9}, (SVD_IG,),
        svd_setting("Table I", hparams="prune 90% by magnitude; IG (cosine, Adam), then mask replay",
                    anchor="| Prune [5] | 12.9257 | 0.4993 | 36.1273 | 0.0221 |"),
        adaptive=AttackRef("mask-replay", IG_SVD, "mask replay (IG)"), leak_cell="adaptive", paper_psnr=12.93,
        scales=r18_scales(2 * R18_BUDGET, gpu_budget=SVD_GPU_BUDGET, images=IMAGES), profiles=BOTH, notes=SVD_IG_NOTE),
    Row("svd-soteria", "SVDefense", "Table I, Soteria 80%: IG -> mask replay", "10.81 -> 38.74 dB", "leaks",
        "resnet18", "soteria", {"ratio": 0.8, "layer": "last"}, (SVD_IG,),
        svd_setting("Table I", hparams="Soteria prunes 80% of fc gradients; IG (cosine, Adam), then mask replay",
                    anchor="| Soteria [26] | 10.8145 | 0.6481 | 38.7447 | 0.0161 |"),
        adaptive=AttackRef("mask-replay", IG_SVD, "mask replay (IG)"), leak_cell="adaptive", paper_psnr=10.81,
        scales=r18_scales(2 * R18_BUDGET, gpu_budget=SVD_GPU_BUDGET, images=IMAGES,
                          planner=("ig", "portfolio", "mask-replay", "layer-drop", "learned-inverter"),
                          why=SOTERIA_REPLAY_LEFT_OUT), profiles=BOTH, notes=SVD_IG_NOTE),
    Row("svd-precode", "SVDefense", "Table I, PRECODE: IG -> latent recovery", "3.57 -> 57.42 dB", "leaks",
        "resnet18", "precode", {"latent": 256, "beta": 1e-3}, (SVD_IG,),
        svd_setting("Table I", hparams="PRECODE K=256, beta 1e-3; IG, then the dummy latent optimised too",
                    anchor="| PRECODE [23] | 3.5659 | 0.7668 | 57.4165 | 0.0001 |"),
        adaptive=AttackRef("precode-latent", {}, "dummy latent optimised with the input"), leak_cell="adaptive",
        paper_psnr=3.57, scales=r18_scales(2 * R18_BUDGET, gpu_budget=SVD_GPU_BUDGET, images=IMAGES), profiles=BOTH,
        notes=SVD_IG_NOTE),
    Row("svd-censor", "SVDefense", "Table I, CENSOR (first 5 rounds): IG at round 0 -> IG at rounds 5+",
        "8.19 -> 16.41 dB", "leaks", "resnet18", "censor", {"trials": 20, "active_rounds": 5}, (SVD_IG,),
        svd_setting("Table I", steps=(0, 5), hparams="CENSOR in the first 5 epochs; IG in round 0, then after",
                    anchor="| CENSOR [21] | 8.1940 | 0.6958 | 16.4071 | 0.2881 |"),
        adaptive=AttackRef("ig", IG_SVD, "IG at round 5, CENSOR off"), adaptive_steps=(5,), paper_steps=(0,),
        leak_cell="adaptive", paper_psnr=8.19, scales=r18_scales(2 * R18_BUDGET, gpu_budget=SVD_GPU_BUDGET, images=IMAGES),
        profiles=BOTH, differences=("rounds of FedSGD instead of epochs",), notes=CENSOR_NOTES + SVD_IG_NOTE,
        store="censor-resnet18-svdefense"),
    Row("svd-svdefense", "SVDefense", "Table III, CIFAR-10, IG vs SVDefense (eta 0.3); Table IV, LTI",
        "12.53 dB (LTI: 14.34 dB)", "protects", "resnet18", "svdefense", {"eta": 0.3}, (SVD_IG,),
        svd_setting("Table III / Table IV", data="CIFAR-10 32x32", hparams="SVDefense eta 0.3; IG (cosine, Adam); "
                    "LTI trained on a surrogate data set", anchor="| PSNR | 15.8955 | 15.5623 | 17.1465 | 17.6388 | "
                                                                   "14.3392 |"),
        adaptive=AttackRef("learned-inverter", {"pairs": 256}, "learning to invert (Table IV)"),
        paper_psnr=12.53, scales=r18_scales(R18_BUDGET, gpu_budget=SVD_GPU_BUDGET, images=IMAGES), profiles=BOTH,
        notes=SVD_NOTES + SVD_IG_NOTE),
    Row("svd-utility", "SVDefense", "Fig. 7, utility: SVDefense not below no defense (KWS 79.9% vs 78.0%)",
        "79.9% vs 78.0%", "utility", "resnet18", "svdefense", {"eta": 0.3}, (),
        svd_setting("Fig. 7", data="Google Speech Commands", images=None, hparams="FedAvg over class-imbalanced "
                    "clients", anchor="achieves a final accuracy of 78.0% and SVDefense achieves 79.9%"),
        utility=("not-worse", 1.0), scales={"cpu": Scale(model_args=R18_CPU, why=R18_WHY)}, budget_if_unstated=4,
        differences=("FedSGD on one client; the paper trains FedAvg over class-imbalanced clients",)),
    # ---------------------------------------------------------------- Bayes framework (paper 003)
    *[Row(f"bayes-{key}-{step}", "Bayes framework", f"Table 2, CIFAR-10, {label}, step {step}",
          " / ".join(f"{v:.2f}" for v in numbers) + " dB (Bayes / L2 / L1 / cos)", "order", "cnn", defense, args,
          BAYES_ATTACKS,
          PaperSetting("Table 2 (Sec. 4, App. A.3)", "the paper's small CNN (conv32-pool-conv64-pool-dense100), "
                       "flax initialisation", dict(FLAX), "CIFAR-10 32x32", 200, images=100, steps=(step,),
                       hparams=f"{label}; Adam with exponential decay, one restart, prior weight and learning rate "
                               "grid-searched per attack",
                       anchor=f"| CIFAR-10 | {table_label} | " + " | ".join(f"{v:.2f}" for v in table[0])),
          order_psnr=dict(zip(("bayes-optimal", "bayes-l2", "bayes-l1", "bayes-cos"), numbers)),
          order_kinds=(("bayes-l2", "tie"), ("bayes-l1", "not-worse"), ("bayes-cos", "not-worse"))
          if (key, step) == ("gauss", 0) else (),
          quote=BAYES_GAUSS_QUOTE if (key, step) == ("gauss", 0) else BAYES_QUOTE,
          paper_psnr=numbers[0], lr=0.01, search=True, planner_budget=200,
          notes=("training through the defense at lr 0.01 (the paper gives none; at 0.1 the noise makes the model "
                 "diverge before step 500)", "the attacks start from N(0, 1) pixels (the authors' code; the paper's text says \"randomly "
                 "initialized\")"))
      for key, label, table_label, defense, args, table in (
          ("gauss", "Gaussian 0.1", "Gaussian", "gaussian", {"sigma": 0.1},
           {0: (21.86, 21.81, 21.49, 21.53), 500: (17.94, 18.64, 18.00, 18.34)}),
          ("lap", "Laplacian 0.1", "Laplacian", "laplacian", {"sigma": 0.1},
           {0: (21.87, 21.02, 21.89, 20.87), 500: (18.41, 18.37, 19.11, 18.02)}),
          ("prune-gauss", "prune 50% + Gaussian 0.1", "Prune+Gauss", "soft-prune", {"prune_prob": 0.5, "sigma": 0.1},
           {0: (20.73, 16.60, 16.20, 18.73), 500: (18.67, 15.61, 15.27, 16.74)}),
          ("prune-lap", "prune 50% + Laplacian 0.1", "Prune+Lap", "soft-prune",
           {"prune_prob": 0.5, "sigma": 0.1, "noise": "laplacian"},
           {0: (20.54, 16.25, 16.13, 17.40), 500: (18.51, 15.32, 15.24, 15.51)}))
      for step, numbers in table.items()],
    Row("bayes-soteria", "Bayes framework", "Fig. 2b at epoch 0: Soteria 80% on ConvBig's largest layer, layer dropped",
        "broken (Fig. 2)", "leaks", "convbig", "soteria", {"ratio": 0.8, "layer": "largest"},
        (AttackRef("layer-drop", {**PAPER_IG, "tv": 4e-4, "lr": 0.1},
                   "IG without the defended layer (cosine, TV 4e-4, Adam 0.1)"),),
        PaperSetting("Sec. 6, App. A.1", "ConvBig (Table 3)", dict(FLAX), "CIFAR-10 32x32", 4000,
                     hparams="Soteria prunes 80% on the largest linear layer; cosine, Adam 0.1 with decay, TV 4e-4, "
                             "one random start",
                     anchor="a total variation regularization of 10-5 for ATS and 4 × 10-4 for Soteria"),
        scales={"cpu": Scale(planner=SOTERIA_CONVBIG_PLANNER, planner_budget=200, why=SOTERIA_CONVBIG_WHY)},
        notes=("the paper's figure plots Soteria over epochs 0-10; the row checks its first point",)),
    Row("bayes-precode", "Bayes framework", "Sec. 6, PRECODE on an MLP, analytic first-layer inversion",
        "> 150 dB", "leaks", "mlp", "precode", {"latent": 256, "beta": 1e-3},
        (AttackRef("analytic", {}, "analytic inversion of the first layer"),),
        PaperSetting("Sec. 5 and 6", "MLP, 5 layers of 500 and ReLU, the bottleneck before the last layer", {},
                     "CIFAR-10 32x32", 1, hparams="analytic: x = dl/dA0[i,:] / dl/db0[i]",
                     anchor="we obtain perfect reconstruction with PSNR values > 150"),
        paper_psnr=150.0, planner_budget=200),
    Row("bayes-ats", "Bayes framework", "Fig. 2a, ATS (policy 7-4-15) across training steps",
        "near-perfect at early steps, fails by step 50", "leaks", "convnet9", "ats", {"policy": "7-4-15"},
        (AttackRef("ig", {**PAPER_IG, "signed": True, "tv": 1e-5, "lr": 0.1},
                   "IG (cosine, TV 1e-5, signed Adam 0.1)"),),
        PaperSetting("Sec. 6, App. A.2 (Fig. 2a, Fig. 6)", "ConvNet of Table 4 with BatchNorm, width 64", {},
                     "CIFAR-10 32x32", 2000, images=100, steps=(1, 2, 5, 10, 20, 50), train_batch=32,
                     hparams="ATS policy 7-4-15; cosine, Adam 0.1 with decay on signed gradients, boxed, TV 1e-5, "
                             "one random start; the label given (the authors' comm.py, config 'inversed')",
                     anchor="The total variation regularization constant is 1 × 10-5", client_mode="eval",
                     train_optimizer="sgd:momentum=0.9,nesterov=1,weight_decay=5e-4",
                     train_source="the authors' cifar_train.py: inversefed's 'conservative' strategy"),
        scales={"cpu": Scale(images=8, steps=(1, 2, 5, 10),
                             why="a 2,000-iteration IG on the width-64 ConvNet costs about 0.2 s per image-iteration "
                                 "on 2 CPU cores, as much again for its control: 8 images at the claim's four steps "
                                 "(the paper's 100 at its six steps take days; the gpu profile runs them)")},
        profiles=BOTH,
        planner_budget=200, claim_steps=(1, 2, 5, 10), per_step=True,
        quote="\"we can recover high-quality inputs during the first 10 to 20 training steps\" (App. A.2)",
        notes=("the claim is judged at steps 1, 2, 5 and 10: \"we can recover high-quality inputs during the first "
               "10 to 20 training steps\" (App. A.2), \"the visual quality starts to decline after 10 steps\" (Fig. 6); "
               "the gpu profile shows steps 20 and 50 beside them",
               "the paper's count of images, its eval mode and its attack's signed, boxed Adam are those of the "
               "authors' code (defense_attacks/ats/benchmark/cifar_attack.py: model.eval(), 100 images; comm.py)",
               "the labels here are inferred from the gradient (iDLG), exact at batch 1")),
    # ---------------------------------------------------------------- Refiner (paper 004)
    *[Row(f"refiner-alpha-{alpha}", "Refiner", f"Table 7, LeNet, eps 0.1, alpha {alpha}",
          f"{psnr:.2f} dB" + (" (Table 15 adaptive: iDLG 10.67, IG 10.44)" if alpha == 0.5 else ""), claim,
          "lenet", "refiner", {"eps": 0.1, "alpha": alpha, "d_width": 128}, (REFINER_IG,),
          PaperSetting("Table 7 (Sec. 6)", "DLG's LeNet", {}, "CIFAR-10 32x32", 4000, images=1000,
                       hparams=f"Refiner eps 0.1, alpha {alpha}, beta 1, iota 10, tau 0.95, evaluation network "
                               "128/256/512 filters; IG: cosine + TV, Adam 0.01",
                       anchor="PSNR 21.24 16.52 14.99 13.20 12.53 10.52"),
          adaptive=AttackRef("through-defense", {"tv": 1e-4, **EOT}, "EOT through Refiner (ours)"),
          paper_psnr=psnr, planner_budget=200,
          scales={"cpu": Scale(images=IMAGES, adaptive_budget=200, why="16 images: 4,000 IG iterations on each of "
                               "1,000 images is days on 2 CPU cores (the gpu profile runs them)"),
                  "gpu": Scale(adaptive_budget=200, why="the paper's 1,000 images; our EOT attack at budget 200, "
                               "each of its evaluations runs Refiner's own optimisation")},
          profiles=BOTH,
          notes=("Refiner's TV weight is not given; IG's 1e-4 stands in",), quote=quote)
      for alpha, psnr, claim, quote in REFINER_ALPHAS],
    Row("refiner-order", "Refiner", "Table 7, LeNet, eps 0.1: PSNR falls as alpha rises (0, 0.5, 0.9)",
        "21.24 > 13.20 > 10.52 dB", "chain", "lenet", "refiner", {"eps": 0.1, "alpha": 0.5, "d_width": 128},
        (REFINER_IG,),
        PaperSetting("Table 7 (Sec. 6)", "DLG's LeNet", {}, "CIFAR-10 32x32", 4000, images=1000,
                     hparams="Refiner eps 0.1, alpha 0, 0.5 and 0.9; IG: cosine + TV, Adam 0.01",
                     anchor="PSNR 21.24 16.52 14.99 13.20 12.53 10.52"),
        paper_psnr=13.20, chain=tuple(f"refiner-alpha-{a}" for a, *_ in REFINER_ALPHAS),
        scales={"cpu": Scale(images=IMAGES, why="the alpha rows' 16 images, paired image by image"),
                "gpu": Scale(why="the alpha rows' 1,000 images")}, profiles=BOTH,
        quote=("\"The results in Table 7 align with this thought where a rise in alpha corresponds to lower PSNR "
               "and PMM values\" (Sec. 6, Impact of alpha); judged on the paper's IG cells of the three alpha rows, "
               "pair by pair on the same images (Wilcoxon on per-image PSNR)")),
    Row("refiner-utility", "Refiner", "Table 7, utility: PMM (defended / undefended accuracy), alpha 0.5",
        "PMM 90.69%", "utility", "lenet", "refiner", {"eps": 0.1, "alpha": 0.5}, (),
        PaperSetting("Table 7", "DLG's LeNet", {}, "CIFAR-10 32x32", None, images=None,
                     hparams="10 clients, batch 128, 8,000 rounds, server lr 0.01", anchor="PMM 98.52 95.45 92.61 90.69"),
        utility=("ratio", 0.9069), budget_if_unstated=4,
        differences=("FedSGD on one client; the paper trains a global model over 10 clients",)),
]
BY_ID = {r.id: r for r in ROWS}


# --------------------------------------------------------------------------- a row's run
@dataclass
class Profile:
    """``tiny``: the profile's rows and models at the quick check's budgets, images and steps
    (the gpu profile's plumbing checked on a CPU); its cells never reach the page."""
    name: str
    images: Optional[int] = None  # overrides every row's image count (the quick check's 2)
    device: str = "cpu"
    tiny: bool = False

    @property
    def shrunk(self) -> bool:
        return self.name == "quick" or self.tiny


def run_setting(row: Row, profile: Profile) -> Dict[str, Any]:
    """What ``profile`` runs for ``row``: model arguments, budget (gradient evaluations per
    attack and image), steps, images, and the planner cell's attacks and budget."""
    s, paper = row.scale(profile.name), row.setting
    quick = profile.shrunk
    budget = QUICK["budget"] if quick else s.budget or paper.budget or row.budget_if_unstated
    steps = tuple(s.steps or paper.steps)
    images = profile.images or s.images or paper.images or IMAGES
    planner_budget = QUICK["budget"] if quick else s.planner_budget or row.planner_budget or min(budget, 1000)
    return {"model_args": dict(paper.model_args if s.model_args is None else s.model_args), "budget": budget,
            "steps": list(steps[:2] if quick else steps), "images": images,
            "planner": list(s.planner or ("auto",)), "planner_args": {k: dict(v) for k, v in s.planner_args.items()},
            "planner_budget": planner_budget,
            "adaptive_budget": QUICK["budget"] if quick else s.adaptive_budget or budget,
            "train_batch": paper.train_batch or 8}


def _args_text(args: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in args.items()) or "defaults"


def differences(row: Row, run: Dict[str, Any]) -> List[str]:
    """How the run differs from the paper's setting, the data set aside (empty: at the paper's)."""
    paper, out = row.setting, []
    if run["model_args"] != paper.model_args:
        out.append(f"{row.model} with {_args_text(run['model_args'])} (the paper's: {_args_text(paper.model_args)})")
    if row.claim != "utility":
        if paper.budget is None:
            out.append(f"the paper states no iteration count; {run['budget']:,} gradient evaluations here")
        elif run["budget"] < paper.budget:
            its = max(1, run["budget"] // paper.restarts)
            out.append(f"{its:,} of {paper.iterations:,} iterations"
                       + (f" x {paper.restarts} restarts" if paper.restarts > 1 else ""))
        if list(run["steps"]) != list(paper.steps):
            out.append(f"steps {', '.join(map(str, run['steps']))} of {', '.join(map(str, paper.steps))}")
        if paper.images and run["images"] < paper.images:
            out.append(f"{run['images']} of {paper.images:,} images")
    if paper.train_optimizer and row.lr != paper.train_lr:
        out.append(f"training lr {row.lr:g} (the paper's: {paper.train_lr:g})")
    out.extend(row.differences)
    return out


def label(row: Row, run: Dict[str, Any]) -> str:
    diff = differences(row, run)
    return AT_PAPER if not diff else "scaled: " + "; ".join(diff)


def own_text(row: Row, run: Dict[str, Any], data: str) -> str:
    used = "CIFAR-10 32x32" if data == "cifar10" else "the embedded 32x32 photos"
    parts = [f"{row.model} ({_args_text(run['model_args'])})", used, "batch 1"]
    if row.claim != "utility":
        parts += [f"{run['budget']:,} gradient evaluations", f"{run['images']} images",
                  f"step{'s' if len(run['steps']) > 1 else ''} {', '.join(map(str, run['steps']))}"]
    if row.setting.train_batch:
        parts.append(f"training batch {run['train_batch']}")
    if row.setting.training_text(row.lr):
        parts.append(row.setting.training_text(row.lr).split(" (")[0])
    if row.setting.mode_text():
        parts.append(row.setting.mode_text())
    return "; ".join(parts)


def store_dir(row: Row, out: Path) -> Path:
    return out / (row.store or f"{row.defense}-{row.model}")


def base_call(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
              run: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword settings of ``audit.run`` shared by the row's paper cells."""
    utility = row.claim == "utility"
    return dict(defense=row.defense, defense_args=dict(row.defense_args), model=row.model,
                model_args=dict(run["model_args"]), data=data, data_args=data_args or None,
                steps=list(run["steps"]) if not utility else [0], images=run["images"] if not utility else 1,
                budget=run["budget"], batch_size=1, lr=row.lr, train_batch_size=run["train_batch"], utility=utility,
                utility_steps=4 if profile.shrunk else row.utility_steps,
                utility_seeds=2 if profile.shrunk else 3, device=profile.device,
                out=str(store_dir(row, out) / "paper"), progress=not profile.shrunk,
                # named only where they are not the default, so the other rows' cell keys stay as stored
                **({"client_mode": row.setting.client_mode} if row.setting.client_mode != "train" else {}),
                **({"server_optimizer": row.setting.train_optimizer} if row.setting.train_optimizer else {}))


@dataclass
class CellPlan:
    """One cell: its name (``paper:<attack>``, ``adaptive``, ``planner``, ``utility``), the
    ``audit.run`` call that makes it and the steps it is judged at; ``gpu``: it runs in slices
    sized for a GPU call (:func:`slice_evaluations`), not for a CPU sitting."""

    name: str
    call: Dict[str, Any]
    steps: List[int]
    gpu: bool = False

    @property
    def key(self) -> str:
        from audit.report.store import settings_key

        return cell_key(self.call)


def cell_key(call: Dict[str, Any]) -> str:
    """The key of an ``audit.run`` call: every setting that changes its numbers (not where it
    writes or whether it shows progress; the utility's recipe only when it measures utility)."""
    from audit.report.store import settings_key

    ignored = {"out", "progress"} | (set() if call.get("utility") else {"utility_steps", "utility_seeds"})
    return settings_key({k: v for k, v in call.items() if k not in ignored}, 16)


def plan_cells(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
               searched: Optional[Dict[str, Dict[str, Any]]] = None) -> List[CellPlan]:
    """The row's cells (:func:`_row_cells`), sliced for a GPU call on the gpu profile."""
    cells = _row_cells(row, profile, data, data_args, out, searched)
    for cell in cells:
        cell.gpu = profile.name == "gpu"
    return cells


def _row_cells(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
               searched: Optional[Dict[str, Dict[str, Any]]] = None) -> List[CellPlan]:
    """The row's cells: the paper's attacks one by one (with the weights ``searched`` on
    held-out images where the row searches them) and its adaptive attack, in one engine store;
    the planner's attacks at their presets in another (``auto``, never the paper's settings)."""
    run = run_setting(row, profile)
    base = base_call(row, profile, data, data_args, out, run)
    if row.claim == "utility":
        return [CellPlan("utility", {**base, "attacks": ["ig"], "budget": QUICK["budget"]}, [0])]
    if row.chain:  # judged on the cells of the rows it orders
        return []
    steps = list(run["steps"])
    cells = []
    for a in row.attacks:
        args = {**a.args, **((searched or {}).get(a.name) or {})}
        paper_steps = [s for s in (row.paper_steps or steps) if s in steps]
        cells.append(CellPlan(f"paper:{a.name}", {**base, "steps": paper_steps, "attacks": [a.name],
                                                  "attack_args": {a.name: args} if args else None}, paper_steps))
    if row.adaptive:
        adaptive_steps = [s for s in (row.adaptive_steps or steps) if s in steps]
        args = dict(row.adaptive.args)
        if profile.shrunk and row.adaptive.name == "learned-inverter":
            args.update(pairs=16, train_steps=5)
        cells.append(CellPlan("adaptive", {**base, "steps": adaptive_steps, "attacks": [row.adaptive.name],
                                           "attack_args": {row.adaptive.name: args} if args else None,
                                           "budget": run["adaptive_budget"]}, adaptive_steps))
    planner_args = dict(run["planner_args"])
    if profile.shrunk:
        planner_args["learned-inverter"] = {"pairs": 16, "train_steps": 5}
    cells.append(CellPlan("planner", {**base, "attacks": list(run["planner"]), "attack_args": planner_args or None,
                                      "budget": run["planner_budget"],
                                      "out": str(store_dir(row, out) / "planner")}, steps))
    return cells


# --------------------------------------------------------------------------- persisted results
def results_path(root: Path, profile: str, data: str, row: Row) -> Path:
    return root / f"{profile}-{data}" / f"{row.id}.json"


def load_results(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_results(path: Path, stored: Dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def stored_cells(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                 out: Path) -> Tuple[Dict[str, Any], Dict[str, Optional[CellEvidence]], List[CellPlan]]:
    """The row's stored results; per planned cell, its evidence when stored under the cell's
    current key (None: not run yet, or run with other settings); and the planned cells."""
    stored = load_results(results_path(root, profile.name, data, row))
    search = stored.get("search") or {}
    if row.search and search.get("key") != current_search_key(row, profile, data, data_args, out):
        search = {}  # searched with other settings: its choices, and the cells run with them, are stale
        stored = {**stored, "search": {}}
    plans = plan_cells(row, profile, data, data_args, out, search.get("chosen"))
    return stored, whole_cells(stored, plans), plans


def whole_cells(stored: Dict[str, Any], plans: Sequence[CellPlan]) -> Dict[str, Optional[CellEvidence]]:
    """Per planned cell, its evidence when stored whole under the cell's current key (None:
    not run yet, under way, or run with other settings)."""
    cells: Dict[str, Optional[CellEvidence]] = {}
    for plan in plans:
        cell = (stored.get("cells") or {}).get(plan.name)
        ok = cell is not None and cell.get("key") == plan.key
        cells[plan.name] = CellEvidence.from_dict(cell["evidence"]) if ok and cell.get("evidence") else None
    return cells


def judged_on(whole: Dict[str, Optional[CellEvidence]], claimed: Dict[str, CellEvidence],
              stepped: Dict[str, CellEvidence]) -> Dict[str, Optional[CellEvidence]]:
    """What each cell's claim is judged on: its ``whole`` evidence (:func:`whole_cells`), else
    its claim's steps (``claimed``, :func:`claim_cells`), else the claim steps complete so far
    (``stepped``, :func:`step_cells`)."""
    return {n: c if c is not None else claimed.get(n) or stepped.get(n) for n, c in whole.items()}


def claim_cells(stored: Dict[str, Any], plans: Sequence[CellPlan]) -> Dict[str, CellEvidence]:
    """Per cell under way whose claim's steps are complete (:func:`claim_record`, under the
    cell's current key), the evidence at those steps."""
    out = {}
    for plan in plans:
        cell = (stored.get("cells") or {}).get(plan.name) or {}
        if cell.get("key") == plan.key and cell.get("claim_evidence"):
            out[plan.name] = CellEvidence.from_dict(cell["claim_evidence"])
    return out


def planner_attacks(manifest: Dict[str, Any]) -> List[str]:
    """Every attack the planner's audit ran (its base attacks and the planner's picks)."""
    return [a["id"] for a in manifest.get("attacks") or []]


#: image-evaluations per slice of a cell: a cell runs one step and a few images at a time
#: (the engine's key leaves steps and the image count out, so each slice adds to the same
#: run), and each slice's results are copied into the repository as it finishes, so a cell
#: longer than a sitting accumulates; a slice is 15-30 minutes on one core for the slowest rows
SLICE_EVALUATIONS = 4000
#: attacks an ``auto`` call is sized as (the planner's base attacks and picks: six on ATS), for
#: slicing alone: slices never change a number
PLANNER_ATTACKS = 6


def image_evaluations(call: Dict[str, Any]) -> int:
    """What one image of the cell's audit call costs in gradient evaluations: every attack of the
    call its budget (``auto``: :data:`PLANNER_ATTACKS` of them), twice for a defended call, whose
    positive control runs the same attacks' base forms on the same images at the same budget."""
    named = call.get("attacks") or ()
    attacks = max(1, len([a for a in named if a != "auto"]) + PLANNER_ATTACKS * ("auto" in named))
    runs = 1 if call.get("defense") in (None, "none") else 2  # an undefended audit is its own control
    return runs * attacks * max(1, int(call["budget"] or 1))


def cell_slices(call: Dict[str, Any], claim: Sequence[int] = (),
                evaluations: Optional[float] = None) -> List[Tuple[List[int], int]]:
    """The (steps, images) of each slice of the cell's audit call, then the whole call: as many
    images a slice as ``evaluations`` (default :data:`SLICE_EVALUATIONS`) pays for at
    :func:`image_evaluations` each. With several steps each step runs all its images in slices,
    so the whole call only gathers them (no slice spans steps). The steps of a claim (``claim``:
    some of the call's steps) run first and are gathered on their own, so the claim is judged
    before the other steps finish."""
    images, steps = int(call["images"]), list(call["steps"])
    per = max(1, int((SLICE_EVALUATIONS if evaluations is None else evaluations) // image_evaluations(call)))
    if call.get("utility") or (per >= images and len(steps) == 1):
        return [(steps, images)]
    counts = list(range(per, images, per)) + ([images] if len(steps) > 1 else [])
    first = [s for s in steps if s in claim]
    if not first or len(first) == len(steps):
        return [([step], n) for step in steps for n in counts] + [(steps, images)]
    rest = [s for s in steps if s not in first]
    return ([([step], n) for step in first for n in counts] + [(first, images)]
            + [([step], n) for step in rest for n in counts] + [(steps, images)])


def claim_of(row: Row, plan: "CellPlan") -> List[int]:
    """The steps of the row's claim that the cell runs, where they are some of its steps (the
    cell's evidence there is judged as soon as it is complete); [] otherwise."""
    claim = [s for s in plan.call["steps"] if s in (row.claim_steps or ())]
    return claim if 0 < len(claim) < len(plan.call["steps"]) else []


def partial_dir(results: Path, cell: str) -> Path:
    """Where an unfinished cell's per-image results are kept in the repository."""
    return results.parent / f"{results.stem}.partial" / cell.replace(":", "-")


#: where a cell's positive control is kept under its partial folder (its store: ``out/control``)
CONTROL_PARTIAL = "control"


def restore_partial(partial: Path, out: Path) -> int:
    """Copy the repository's unfinished results into the engine's store (its run keys as
    stored; the engine reuses a result only if its settings and defaults still match), the
    positive control's into the control's store."""
    copied = 0
    found = [(src, out / "runs" / src.parent.name / "results" / src.name)
             for src in (sorted(partial.glob("*/*")) if partial.is_dir() else []) if src.is_file()]
    found += [(src, out / CONTROL_PARTIAL / "runs" / src.parent.name / "results" / src.name)
              for src in sorted((partial / CONTROL_PARTIAL).glob("*/*")) if src.is_file()]
    for src, dst in found:
        if not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            copied += 1
    return copied


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``b`` exists with ``a``'s bytes (sizes first: most differing results differ in size)."""
    return b.exists() and a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def keep_results(results: Path, kept: Path) -> None:
    """Copy a store's finished results (``results``) into the repository's ``kept`` folder: new
    ones, and those the run redid (a result run with other settings is kept under the same name
    until it is redone)."""
    for src in sorted(results.glob("*")):
        dst = kept / src.name
        if src.suffix in (".json", ".png") and not _same_file(src, dst):
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)


def kept_seconds(partial: Path) -> float:
    """The attack time of the results an unfinished run kept under ``partial`` (each image's
    ``time_s``, the control's included): counted into the cell's ``seconds`` when a later run
    finishes it, so a resumed cell records the time of all its runs, not the last one's."""
    total = 0.0
    for path in sorted(partial.rglob("*.json")) if partial.is_dir() else []:
        try:
            total += float(json.loads(path.read_text()).get("time_s") or 0.0)
        except (ValueError, OSError, AttributeError):
            continue  # an unreadable kept result is redone by the engine; its time is not known
    return total


def keep_partial(out: Path, key: str, partial: Path, control: Optional[Dict[str, Any]] = None) -> None:
    """Keep the engine run's finished results in the repository (:func:`keep_results`);
    ``control`` (the report's ``control`` entry): its own store's results too."""
    keep_results(out / "runs" / key / "results", partial / key)
    if control and control.get("run_key") and control.get("dir") == CONTROL_PARTIAL:
        keep_results(out / CONTROL_PARTIAL / "runs" / control["run_key"] / "results",
                     partial / CONTROL_PARTIAL / control["run_key"])


def with_control(evidence: CellEvidence, report: Dict[str, Any]) -> CellEvidence:
    """``evidence`` with the positive control the report stored at its steps."""
    evidence.control, evidence.control_missing = control_from_report(report.get("steps") or [], evidence.steps)
    return evidence


def _stored_evidence(plan: CellPlan, run_key: str, steps: Sequence[int]) -> Tuple[Dict[str, Any], List[str], CellEvidence]:
    """The engine store's manifest of the cell's run, its attacks, and their evidence at ``steps``."""
    from audit.report.store import ResultStore

    store = ResultStore(plan.call["out"], run_key)
    manifest = store.load_manifest()
    attacks = planner_attacks(manifest) if plan.name == "planner" else list(plan.call["attacks"])
    return manifest, attacks, cell_evidence(manifest, [r.to_dict() for r in store.records()], attacks, steps)


@dataclass(frozen=True)
class CellCall:
    """One audit call of a cell (:func:`cell_slices`): its steps and image count; ``work``: the
    slice of images it attacks that no kept result covers (None: it attacks nothing new);
    ``claim``: it completes the steps of the row's claim; ``whole``: the cell's last call;
    ``step``: of a row judged step by step, the claim's step whose images it completes and whose
    evidence is not stored yet (its report is read and kept, :func:`step_record`)."""

    steps: List[int]
    images: int
    work: Optional["GpuSlice"]
    claim: bool
    whole: bool
    step: Optional[int] = None

    @property
    def needed(self) -> bool:
        """Whether the call must run: it attacks something, or its report is read."""
        return self.work is not None or self.claim or self.whole or self.step is not None


def cell_calls(row: Row, plan: CellPlan, kept: Set[Tuple[int, int]] = frozenset(),
               claim_only: bool = False, stepped: Collection[int] = (),
               until_step: Optional[int] = None) -> List[CellCall]:
    """The cell's audit calls in order, each with the slice of new work it does given the
    image-steps ``kept`` (each call of one step attacks the images after its step's previous
    call, up to its count); ``claim_only``: up to the call that completes the claim's steps;
    ``until_step``: that step's calls alone (the others' images wait for their own step's
    pass or the cell's whole pass). A row judged step by step reads each claim step's
    evidence as its images complete, where it is not stored already (``stepped``)."""
    claim, total = claim_of(row, plan), int(plan.call["images"])
    slices = cell_slices(plan.call, claim, slice_evaluations(plan))
    per_image, covered, calls = image_minutes(plan.call), {}, []
    for i, (steps, images) in enumerate(slices):
        work = None
        if len(steps) == 1:
            first = covered.get(steps[0], 0)
            new = sum((steps[0], image) not in kept for image in range(first, images))
            if new:
                work = GpuSlice(row.id, plan.name, steps[0], first, images - first, new * per_image)
            covered[steps[0]] = max(first, images)
        completes = bool(claim) and steps == claim and images == total
        step = steps[0] if (row.per_step and len(steps) == 1 and images == total and steps[0] in row.claim_steps
                            and steps[0] not in stepped) else None
        calls.append(CellCall(steps, images, work, completes, i == len(slices) - 1, step))
        if completes and claim_only:
            break
    return calls if until_step is None else [c for c in calls if c.steps == [until_step]]


class CallOver(Exception):
    """A slice's planned minutes do not fit what is left of the invocation's deadline."""

    def __init__(self, work: "GpuSlice", left: float):
        super().__init__(f"{work.text()}: {max(0.0, left):.1f} minutes left")
        self.work, self.left = work, left


@dataclass
class Deadline:
    """The minutes one invocation may run slices for (``--call-minutes``), by the wall clock
    from when it is set: a slice starts only while its planned minutes fit what is left, so a
    call never loses a slice it started; ``ran``: the slices finished, in order."""

    minutes: float
    clock: Callable[[], float] = time.monotonic
    ran: List["GpuSlice"] = field(default_factory=list)
    started: float = field(init=False)
    began: float = field(init=False)  # when the slice under way started

    def __post_init__(self) -> None:
        self.started = self.began = self.clock()

    def used(self) -> float:
        """Minutes since the deadline was set."""
        return (self.clock() - self.started) / 60

    def admit(self, work: Optional["GpuSlice"]) -> None:
        """Start ``work`` (None: a call that attacks nothing new), or raise :class:`CallOver`."""
        left = self.minutes - self.used()
        if work is not None and work.minutes > left:
            raise CallOver(work, left)
        self.began = self.clock()

    def finished(self, work: Optional["GpuSlice"]) -> None:
        """Count ``work`` as run, and say how long it took beside its plan (:data:`GPU_MS`)."""
        if work is not None:
            self.ran.append(work)
            print(f"    slice {work.text()}; took {(self.clock() - self.began) / 60:.1f} min", flush=True)


def run_slice(call: Dict[str, Any], steps: Sequence[int], images: int) -> Any:
    """One audit call of a cell: its settings at these steps and this many images (the engine
    adds them to the cell's run, reusing every result it already has)."""
    import audit

    return audit.run(**{**call, "steps": list(steps), "images": images})


def run_cell(row: Row, plan: CellPlan, partial: Optional[Path] = None,
             on_claim: Optional[Callable[[Dict[str, Any]], None]] = None,
             claim_only: bool = False, deadline: Optional[Deadline] = None,
             cache: Optional[PlanCache] = None, on_step: Optional[Callable[[Dict[str, Any]], None]] = None,
             stepped: Collection[int] = (), until_step: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Run (or resume) the cell's audit, call by call (:func:`cell_calls`), keeping each call's
    results under ``partial`` before the next starts and skipping the slices whose results it
    kept; its evidence from the engine's store. Where the row's claim is about some of the
    cell's steps, ``on_claim`` receives the record of the claim's evidence (:func:`claim_record`)
    as soon as those steps are complete; ``claim_only`` stops there (returns None). A row judged
    step by step gives ``on_step`` the record of each claim step's evidence as the step's images
    complete (:func:`step_record`; ``stepped``: the steps already stored); ``until_step`` runs
    that step's calls alone (returns None). Under a ``deadline`` a slice that does not fit
    raises :class:`CallOver` before it starts. A planner cell's attacks planned now (kept in
    ``cache``) run on every kept image-step lacking them. The stored ``seconds`` count the
    earlier runs' kept results too (:func:`kept_seconds`)."""
    started = time.perf_counter()
    earlier = kept_seconds(partial) if partial is not None else 0.0  # the runs before this one
    out_dir = Path(plan.call["out"])
    if partial is not None and restore_partial(partial, out_dir):
        print(f"    resumed from {partial}", flush=True)
    kept = kept_for(partial, plan, cache) if partial is not None else set()
    calls = cell_calls(row, plan, kept, claim_only, stepped, until_step)
    for call in calls:
        if not call.needed:
            continue
        if deadline is not None:
            deadline.admit(call.work)
        report = run_slice(plan.call, call.steps, call.images)
        if partial is not None:
            keep_partial(out_dir, report.data["run_key"], partial, report.data.get("control"))
        if deadline is not None:
            deadline.finished(call.work)
        if call.step is not None and on_step is not None:
            _, attacks, evidence = _stored_evidence(plan, report.data["run_key"], [call.step])
            on_step(step_record(plan, attacks, call.step, with_control(evidence, report.data), report.data["run_key"]))
        if call.claim:
            if on_claim is not None:
                _, attacks, evidence = _stored_evidence(plan, report.data["run_key"], call.steps)
                on_claim(claim_record(plan, attacks, with_control(evidence, report.data), report.data["run_key"]))
            if claim_only:
                return None
    if until_step is not None and not (calls and calls[-1].whole):
        return None
    manifest, attacks, evidence = _stored_evidence(plan, report.data["run_key"], plan.steps)
    out = {"key": plan.key, "call": _jsonable(plan.call), "seconds": round(earlier + time.perf_counter() - started, 1),
           "status": report.data["status"], "attacks": attacks, "run_key": report.data["run_key"]}
    if plan.name == "utility":
        out["utility"] = manifest.get("utility")
    else:
        out["evidence"] = with_control(evidence, report.data).to_dict()
        out["fingerprints"] = cell_fingerprints(plan.call, attacks)
    return out


def needs_control_only(cell: Dict[str, Any], plan: CellPlan, cache: Optional[PlanCache] = None) -> bool:
    """Whether a stored cell lacks only its positive control: stored whole under its current key,
    running what the tool runs, its evidence complete, no control beside it (a cell stored
    before the bench ran one). :func:`run_control` adds it without redoing the defended run."""
    evidence = cell.get("evidence") or {}
    return (cell.get("key") == plan.key and "claim_evidence" not in cell and bool(evidence.get("steps"))
            and not evidence.get("missing") and not evidence.get("control") and not stale_cell(cell, cache))


def run_control(row: Row, plan: CellPlan, cell: Dict[str, Any], partial: Optional[Path] = None) -> Dict[str, Any]:
    """The stored ``cell`` with its positive control beside its evidence: the engine's control
    (:class:`audit.engine.control.PositiveControl`: the base forms of the attacks the cell ran,
    same budget, images and seeds, defense ``none``) run alone in the cell's slices, each slice's
    results kept under ``partial`` as it finishes; the defended results are not redone."""
    from audit.engine.control import PositiveControl
    from audit.report.control import control_summary

    started = time.perf_counter()
    out_dir = Path(plan.call["out"])
    if partial is not None and restore_partial(partial, out_dir):
        print(f"    resumed from {partial}", flush=True)
    for steps, images in cell_slices(plan.call, claim_of(row, plan), slice_evaluations(plan)):
        audit = audit_of(plan.call, steps=list(steps), images=images)
        specs = [s for s in audit.planned()[0] if s.id in cell["attacks"]]
        control, budget = PositiveControl(audit), audit.attack_settings.budget
        store = control.run(specs, budget, list(steps))
        if partial is not None:
            keep_results(store.dir / "results", partial / CONTROL_PARTIAL / store.key)
    info = control.describe(store, specs, budget, None)  # the last slice is the whole call
    judged = control.judge(store, control.specs(specs), list(steps))
    reports = [{"step": s, "control": control_summary(judged[s].judged, info, audit.output_settings.thresholds)}
               for s in steps]
    evidence = CellEvidence.from_dict(cell["evidence"])
    evidence.control, evidence.control_missing = control_from_report(reports, evidence.steps)
    return {**cell, "evidence": evidence.to_dict(), "control_seconds": round(time.perf_counter() - started, 1)}


def claim_record(plan: CellPlan, attacks: Sequence[str], evidence: CellEvidence,
                 run_key: Optional[str] = None) -> Dict[str, Any]:
    """What a cell under way stores once the steps of the row's claim are complete: the claim's
    evidence (judged from it; the cell's other steps are still running), keyed as the cell is,
    with the engine's ``run_key`` it ran under."""
    return {"key": plan.key, "call": _jsonable(plan.call), "attacks": list(attacks),
            "claim_evidence": evidence.to_dict(), "fingerprints": cell_fingerprints(plan.call, attacks),
            **({"run_key": run_key} if run_key else {})}


def step_record(plan: CellPlan, attacks: Sequence[str], step: int, evidence: CellEvidence,
                run_key: Optional[str] = None) -> Dict[str, Any]:
    """What a cell under way of a row judged step by step stores as one claim step's images
    complete: that step's evidence (``step_evidence``, joined with the steps stored before it
    under the same keys by :func:`add_step`), keyed as the cell is."""
    return {"key": plan.key, "call": _jsonable(plan.call), "attacks": list(attacks),
            "step_evidence": {str(step): evidence.to_dict()}, "fingerprints": cell_fingerprints(plan.call, attacks),
            **({"run_key": run_key} if run_key else {})}


def add_step(old: Dict[str, Any], record: Dict[str, Any]) -> Dict[str, Any]:
    """The cell's stored record once :func:`step_record`'s ``record`` is added: joined with the
    steps ``old`` stores under the same cell key, engine run key and attacks; a record of the
    claim's steps or the whole cell is kept as it is."""
    if (old.get("key"), old.get("run_key")) == (record["key"], record.get("run_key")) and (
            "evidence" in old or "claim_evidence" in old):
        return old
    same = all(old.get(k) == record.get(k) for k in ("key", "run_key", "attacks"))
    if same and old.get("step_evidence"):
        return {**record, "step_evidence": {**old["step_evidence"], **record["step_evidence"]}}
    return record


def stored_steps(cell: Dict[str, Any], plan: CellPlan) -> List[int]:
    """The claim steps whose evidence the cell's record stores under the cell's current key."""
    if cell.get("key") != plan.key:
        return []
    if cell.get("claim_evidence"):
        return list(cell["claim_evidence"]["steps"])
    return sorted(int(s) for s in cell.get("step_evidence") or {})


def step_cells(stored: Dict[str, Any], plans: Sequence[CellPlan]) -> Dict[str, CellEvidence]:
    """Per cell under way of a row judged step by step, the evidence of the claim steps whose
    images are complete (:func:`step_record`, under the cell's current key), joined."""
    out = {}
    for plan in plans:
        cell = (stored.get("cells") or {}).get(plan.name) or {}
        if cell.get("key") == plan.key and cell.get("step_evidence"):
            out[plan.name] = CellEvidence.joined([CellEvidence.from_dict(e) for _, e in sorted(
                cell["step_evidence"].items(), key=lambda item: int(item[0]))])
    return out


#: the held-out grid search of the Bayes rows' attacks (the paper's App. A.3 searches the prior
#: weight on a log scale, then learning rate and decay around the best): per attack its prior
#: weight's name and values, crossed with :data:`SEARCH_LR`; the best mean PSNR on held-out images wins
SEARCH = {"bayes-optimal": ("prior_weight", (0.1, 1.0, 10.0)), "bayes-l2": ("tv", (1e-3, 1e-2, 1e-1)),
          "bayes-l1": ("tv", (1e-3, 1e-2, 1e-1)), "bayes-cos": ("tv", (1e-3, 1e-2, 1e-1))}
SEARCH_LR = (0.1, 0.5)
#: a best value at the grid's edge extends the grid a decade further that way, up to this many
#: times, so the chosen value is bracketed by worse ones wherever the extensions allow (on
#: held-out images the L2 attack at TV weight w and the Bayes attack under Gaussian noise at
#: prior weight w score alike, and their first grids are two decades apart)
SEARCH_EXTEND = 4
HELD_OUT = 8


def current_search_key(row: Row, profile: "Profile", data: str, data_args: Dict[str, Any], out: Path) -> str:
    """The key the row's held-out search has under the current settings and code."""
    probe = plan_cells(row, profile, data, data_args, out)[0]
    return search_key(row, probe, held_out_images(profile))


def held_out_images(profile: "Profile") -> int:
    """Held-out images of a row's search under ``profile`` (fewer on a shrunk profile)."""
    return QUICK["held_out"] if profile.shrunk else HELD_OUT


def search_key(row: Row, plan: CellPlan, held_out: int) -> str:
    from audit.report.store import settings_key

    base = {k: v for k, v in plan.call.items() if k not in ("out", "progress", "attacks", "attack_args")}
    fixed = {a.name: a.args for a in row.attacks if a.args}  # e.g. the attacks' start
    return settings_key({"call": base, "grid": SEARCH, "lr": SEARCH_LR, "held_out": held_out,
                         "extend": SEARCH_EXTEND, **({"attacks": fixed} if fixed else {})}, 16)


def search_weights(row: Row, plan: CellPlan, held_out: int) -> Dict[str, Any]:
    """The grid search on ``held_out`` test images that the row's evaluation images do not
    include (the private draw's next ones), at the row's step and budget: per attack, mean PSNR
    of every grid point and the chosen one."""
    import torch

    import adaptive  # noqa: F401  (registers the adaptive attacks)
    from attacks import ATTACKS
    from audit.core.metrics import psnr
    from audit.engine.audit import Audit, _private_batches, audit_settings
    from audit.engine.compose import reconstruct
    from audit.report.store import ResultStore

    call = dict(plan.call)
    flat = {k: v for k, v in call.items() if k not in ("defense", "defense_args")}
    auditor = Audit(call["defense"], defense_args=call["defense_args"], **audit_settings(**flat))
    store = ResultStore.create(call["out"], auditor.key_settings())
    step = plan.steps[0]
    states, failure = auditor.checkpoints(store, [step])
    if step not in states:
        raise RuntimeError(f"no model at step {step}: {failure}")
    model = copy.deepcopy(auditor.model)
    model.load_state_dict(states[step])
    held = _private_batches(auditor.dataset, call["images"] + held_out, 1, auditor.seed)[call["images"]:]
    observations = [auditor.observe(model, x, y, step, 100_000 + i) for i, (x, y) in enumerate(held)]
    table: Dict[str, List[List[float]]] = {}
    chosen: Dict[str, Dict[str, Any]] = {}
    fixed = {a.name: dict(a.args) for a in row.attacks}  # the row's own settings of each attack
    for name, (knob, values) in SEARCH.items():
        rows: List[List[float]] = []

        def measure(value: float) -> None:
            for lr in SEARCH_LR:
                attack = ATTACKS.build(name, **{**fixed.get(name, {}), knob: value, "lr": lr})
                scores = []
                for i, (obs, (x, _)) in enumerate(zip(observations, held)):
                    rec = reconstruct(attack, obs, call["budget"], 1000 + i, None)
                    scores.append(float(psnr(rec.inputs.clamp(0, 1), x).mean()) if rec.inputs is not None else 0.0)
                rows.append([value, lr, sum(scores) / len(scores)])

        searched_grid(values, measure, rows)
        best = max(rows, key=lambda r: r[2])
        table[name] = rows
        chosen[name] = {knob: best[0], "lr": best[1]}
    del torch
    return {"chosen": chosen, "table": table, "held_out": held_out}


def searched_grid(values: Sequence[float], measure: Callable[[float], None], rows: List[List[float]],
                  extend: int = SEARCH_EXTEND) -> None:
    """Measure every value (``measure`` appends ``[value, lr, score]`` rows), then, while the
    best lies at the edge of what was tried, a decade further that way, at most ``extend`` times."""
    for value in values:
        measure(value)
    for _ in range(extend):
        best = max(rows, key=lambda r: r[2])[0]
        tried = sorted({r[0] for r in rows})
        if best not in (tried[0], tried[-1]):
            return
        measure(best * 10 if best == tried[-1] else best / 10)


def search_edge(search: Dict[str, Any], name: str) -> str:
    """`` (at the searched grid's edge)`` when the chosen value of ``name``'s prior weight is the
    largest or smallest tried (the extensions ran out), else empty."""
    knob = SEARCH.get(name, (None,))[0]
    tried = sorted({row[0] for row in (search.get("table") or {}).get(name) or []})
    value = (search.get("chosen") or {}).get(name, {}).get(knob)
    return " (at the searched grid's edge)" if tried and value in (tried[0], tried[-1]) else ""


def refiner_projection(row: Row, profile: Profile, run: Dict[str, Any], images: int = 8) -> Dict[str, Any]:
    """How far Refiner's robust gradient lies from the clean one on the row's model, against
    the projection radius: per alpha, the mean ``||g* - g||`` and ``||g||``, how many uploads
    the eps-ball projection cut back, and the upload's cosine to the clean gradient."""
    import torch

    from audit.core.data import load_dataset
    from audit.core.models import build_model
    from audit.core.types import clean_gradients, default_loss_fn
    from defenses import build_defense

    data = load_dataset("embedded")
    model = build_model(row.model, data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                        **run["model_args"])
    out: Dict[str, Any] = {"images": images, "eps": row.defense_args["eps"], "alphas": {}}
    for alpha in (0.0, 0.5, 0.9):
        defense = build_defense(row.defense, **{**row.defense_args, "alpha": alpha})
        dist, norms, cut, cos = [], [], 0, []
        for i in range(images):
            x, y = data.test_images[i:i + 1], data.test_labels[i:i + 1]
            g = clean_gradients(model, x, y, default_loss_fn)
            robust_x = defense.robust_data(model, x, y, generator=torch.Generator().manual_seed(i), grads=g)
            robust = clean_gradients(model, robust_x, y, default_loss_fn)
            d = float(torch.sqrt(sum(((r - c) ** 2).sum() for r, c in zip(robust, g))))
            up = defense(model, x, y, generator=torch.Generator().manual_seed(i))
            n = float(torch.sqrt(sum((c * c).sum() for c in g)))
            dot = float(sum((u * c).sum() for u, c in zip(up, g)))
            cos.append(dot / (float(torch.sqrt(sum((u * u).sum() for u in up))) * n))
            dist.append(d)
            norms.append(n)
            cut += d > out["eps"]
        out["alphas"][str(alpha)] = {"robust_distance": sum(dist) / images, "clean_norm": sum(norms) / images,
                                     "projected": cut, "upload_cosine_min": min(cos)}
    return out


def projection_text(m: Dict[str, Any]) -> str:
    parts = [f"alpha {a}: ||g* - g|| {v['robust_distance']:.1f}, cut back {v['projected']} of {m['images']}, "
             f"cosine to the clean gradient >= {v['upload_cosine_min']:.5f}" for a, v in m["alphas"].items()]
    norm = next(iter(m["alphas"].values()))["clean_norm"]
    return (f"measured on {m['images']} images of the row's model: ||g|| {norm:.1f} against eps {m['eps']:g}; "
            + "; ".join(parts) + ". The projection returns g + eps (g* - g) / ||g* - g|| whenever ||g* - g|| > "
            "eps (the paper's App. J), so every alpha uploads the clean gradient moved by eps: alpha cannot change "
            "what leaks here")


#: a model whose logits spread this much (standard deviation over the private images' logits) has
#: diverged: its softmax saturates, so its gradient no longer carries the image
DIVERGED_LOGIT_STD = 1e3


def model_health(call: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per step of an ``audit.run`` call, the model the audit trains there (the engine's own
    training, same seed) on the call's private images in the client's mode: its logits' spread,
    and how many images' clean gradients are non-finite or exactly zero."""
    import torch

    from audit.core.types import clean_gradients, default_loss_fn
    from audit.engine.audit import Audit, _train, audit_settings

    flat = {k: v for k, v in call.items() if k not in ("defense", "defense_args", "out", "progress")}
    audit = Audit(call["defense"], defense_args=call.get("defense_args"), **audit_settings(**flat))
    steps = sorted(int(s) for s in call["steps"])
    states, _ = _train(audit, max(steps), set(steps))
    out = {}
    for step in steps:
        if step not in states:
            out[str(step)] = {"trained": False}
            continue
        model = copy.deepcopy(audit.model)
        model.load_state_dict(states[step])
        model.train(audit.fl_settings.client_mode == "train")
        logits, finite, zero = [], 0, 0
        for x, y in audit.private:
            with torch.no_grad():
                logits.append(model(x))
            grads = clean_gradients(model, x, y, default_loss_fn)
            finite += all(bool(torch.isfinite(g).all()) for g in grads)
            zero += all(not bool(g.any()) for g in grads)
        spread = torch.cat(logits).double()
        out[str(step)] = {"trained": True, "images": len(audit.private), "logit_std": float(spread.std()),
                          "finite": finite, "zero": zero}
    return out


def collapsed(health: Dict[str, Any]) -> str:
    """Why a step's model cannot be judged ('' where it can): not trained to, a non-finite or
    exactly zero upload, or diverged logits (:data:`DIVERGED_LOGIT_STD`)."""
    if not health.get("trained"):
        return "the model was not trained to this step"
    if health["finite"] < health["images"]:
        return f"non-finite gradients on {health['images'] - health['finite']} of {health['images']} images"
    if health["zero"]:
        return f"exactly zero gradients on {health['zero']} of {health['images']} images"
    if not math.isfinite(health["logit_std"]) or health["logit_std"] > DIVERGED_LOGIT_STD:
        return f"the model diverged (logit std {health['logit_std']:.2g})"
    return ""


def store_health(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path,
                 stored: Dict[str, Any]) -> None:
    """Measure, where not stored under the paper cell's key, the model at each step of a row
    judged step by step (:func:`model_health`), into ``stored["health"]``."""
    plan = plan_cells(row, profile, data, data_args, out, (stored.get("search") or {}).get("chosen"))[0]
    if (stored.get("health") or {}).get("key") != plan.key:
        stored["health"] = {"key": plan.key, "steps": model_health(plan.call)}


def run_row(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], out: Path, root: Path,
            retry: bool = False, deadline: Optional[Deadline] = None) -> Dict[str, Any]:
    """Run the row's cells not stored under their current key (:func:`cells_to_run`, in the
    order of :func:`row_passes`), writing each to the row's results file as it finishes;
    returns the stored results. Under a ``deadline`` a slice that does not fit stops the row
    (:class:`CallOver`), every finished slice kept."""
    path = results_path(root, profile.name, data, row)
    stored = load_results(path)
    stored.update(row=row.id, profile=profile.name, data=data)
    run = run_setting(row, profile)
    stored["setting"] = {"run": run, "label": label(row, run)}
    if row.search:
        probe = plan_cells(row, profile, data, data_args, out)[0]
        held = held_out_images(profile)
        key = search_key(row, probe, held)  # current_search_key, from the probe planned here
        if (stored.get("search") or {}).get("key") != key:
            started = time.perf_counter()
            stored["search"] = {"key": key, **search_weights(row, probe, held),
                                "seconds": round(time.perf_counter() - started, 1)}
            save_results(path, stored)
            print(f"  search: {stored['search']['chosen']} ({stored['search']['seconds']:.0f} s)", flush=True)
    if row.defense == "refiner" and row.claim == "protects":
        key = json.dumps([row.defense_args, run["model_args"]], sort_keys=True)
        if (stored.get("projection") or {}).get("key") != key:
            stored["projection"] = {"key": key, **refiner_projection(row, profile, run,
                                                                    2 if profile.shrunk else 8)}
            save_results(path, stored)
    if row.per_step:
        store_health(row, profile, data, data_args, out, stored)
        save_results(path, stored)
    stored.setdefault("cells", {})
    plans = plan_cells(row, profile, data, data_args, out, (stored.get("search") or {}).get("chosen"))

    def keep(plan: CellPlan) -> Callable[[Dict[str, Any]], None]:
        def keep_claim(record: Dict[str, Any]) -> None:
            stored["cells"][plan.name] = record
            save_results(path, stored)
        return keep_claim

    def keep_step(plan: CellPlan) -> Callable[[Dict[str, Any]], None]:
        def kept(record: Dict[str, Any]) -> None:
            stored["cells"][plan.name] = add_step(stored["cells"].get(plan.name) or {}, record)
            save_results(path, stored)
        return kept

    cache = PlanCache(path.parent)
    for plan, claim_only, until_step in open_passes(row, stored, plans, run, retry, cache):
        old = stored["cells"].get(plan.name) or {}
        # a lent call plans its slices as whole cells: there the cell reruns whole
        part = claim_only or until_step is not None
        control_only = deadline is None and not part and needs_control_only(old, plan, cache)
        what = (", the claim's steps" if claim_only else f", up to step {until_step}" if until_step is not None
                else ", its positive control" if control_only else "")
        print(f"  [{time.strftime('%H:%M:%S')}] {row.id} {plan.name}{what} (budget {plan.call['budget']})", flush=True)
        partial = partial_dir(path, plan.name)
        if control_only:
            stored["cells"][plan.name] = run_control(row, plan, old, partial)
            save_results(path, stored)
            shutil.rmtree(partial, ignore_errors=True)
            continue
        stepped = [] if stale_cell(old, cache) else stored_steps(old, plan)
        cell = run_cell(row, plan, partial, keep(plan), claim_only=claim_only, deadline=deadline, cache=cache,
                        on_step=keep_step(plan), stepped=stepped, until_step=until_step)
        if cell is not None:
            stored["cells"][plan.name] = cell
            save_results(path, stored)
            shutil.rmtree(partial, ignore_errors=True)
    return stored


def cells_to_run(stored: Dict[str, Any], plans: Sequence[CellPlan], retry: bool = False,
                 cache: Optional[PlanCache] = None) -> List[CellPlan]:
    """The planned cells not stored whole under their current key (stored with only their
    claim's steps, or some steps of a row judged step by step), with an attack default since
    changed, with a planner's plan since changed (where ``cache`` is given), or (``retry``) with
    missing evidence or no positive control beside their attacks' evidence."""
    todo = []
    for plan in plans:
        old = (stored.get("cells") or {}).get(plan.name) or {}
        evidence = old.get("evidence") or {}
        redo = retry and (evidence.get("missing") or (evidence.get("steps") and not evidence.get("control")))
        whole = ("evidence" in old or "utility" in old) and "claim_evidence" not in old
        if old.get("key") == plan.key and whole and not redo and not stale_cell(old, cache):
            continue
        todo.append(plan)
    return todo


def stale_cell(cell: Dict[str, Any], cache: Optional[PlanCache]) -> List[str]:
    """Why a stored cell no longer runs what the tool runs ([] where it does): each attack
    whose defaults changed, a changed engine run key (:func:`stale_key`) and (``cache`` given)
    each change of the planner's plan."""
    return stale_attacks(cell) + stale_key(cell) + (stale_plan(cell, cache) if cache is not None else [])


def stale_text(changes: Sequence[str]) -> str:
    """:func:`stale_cell`'s changes in words."""
    moved = [c for c in changes if c[:1] in "+-"]
    defaults = [c for c in changes if c not in moved and c != KEY_CHANGED]
    parts = ([f"the defaults of {', '.join(defaults)} changed"] if defaults else []) + (
        [f"the planner's plan changed ({', '.join(moved)})"] if moved else []) + (
        ["the engine's inputs changed (a defense's or model's code, a setting)"] if KEY_CHANGED in changes else [])
    return " and ".join(parts) + " since these cells ran"


def row_passes(row: Row, todo: Sequence[CellPlan], stored: Dict[str, Any],
               cache: Optional[PlanCache] = None) -> List[Tuple[CellPlan, bool, Optional[int]]]:
    """The order a row runs its cells in, as (cell, claim only, up to step): the claim's steps
    of every cell whose claim is not stored yet, or stored stale (:func:`stale_cell`), first
    (they decide the row), then each cell whole. A row judged step by step runs its cells
    step by step, each claim step in every cell before the next step, so each step is judged
    as soon as the cells' work for it is done."""
    cells = stored.get("cells") or {}

    def claim_stored(plan: CellPlan) -> bool:
        old = cells.get(plan.name) or {}
        return old.get("key") == plan.key and "claim_evidence" in old and not stale_cell(old, cache)

    stepwise = [(p, False, s) for s in (row.claim_steps if row.per_step else ()) for p in todo
                if s in p.call["steps"] and not p.call.get("utility")]
    return ([(p, True, None) for p in todo if claim_of(row, p) and not claim_stored(p)] + stepwise
            + [(p, False, None) for p in todo])


def open_passes(row: Row, stored: Dict[str, Any], plans: Sequence[CellPlan], run: Dict[str, Any],
                retry: bool = False, cache: Optional[PlanCache] = None) -> Iterator[Tuple[CellPlan, bool, Optional[int]]]:
    """The row's passes (:func:`row_passes`) over its cells still to run, each step pass left
    out where its step is settled when the pass comes (:func:`settled_steps`, read from
    ``stored`` as the run fills it in): the cell's work there runs in its whole pass."""
    for plan, claim_only, until_step in row_passes(row, cells_to_run(stored, plans, retry, cache), stored, cache):
        if until_step is None or until_step not in settled_steps(row, stored, plans, run, cache):
            yield plan, claim_only, until_step


# --------------------------------------------------------------------------- judging a row
def at_paper_budget(row: Row, run: Dict[str, Any]) -> bool:
    """The paper's attacks ran at the paper's budget on the paper's model."""
    budget = row.setting.budget
    return budget is not None and run["budget"] >= budget and run["model_args"] == row.setting.model_args


def budget_note(row: Row, run: Dict[str, Any]) -> str:
    """Why the row's attacks are not at the paper's setting, in words (where they are not)."""
    if row.setting.budget is None:
        return f"the paper states no iteration count ({run['budget']:,} gradient evaluations here)"
    if run["model_args"] != row.setting.model_args:
        return f"a smaller model than the paper's ({_args_text(run['model_args'])})"
    return f"the attacks ran below the paper's budget ({run['budget']:,} of {row.setting.budget:,})"


@dataclass
class Judging:
    """What a row is judged on: its cells (at the claim's steps), its run setting, its stored
    results (utility, the model's health per step) and the cells of the rows it orders."""

    cells: Dict[str, Optional[CellEvidence]]
    run: Dict[str, Any]
    stored: Dict[str, Any] = field(default_factory=dict)
    chain: List[Tuple[str, Optional[CellEvidence]]] = field(default_factory=list)


def _conclude_utility(row: Row, j: Judging) -> Conclusion:
    claim, ratio = row.utility or ("not-worse", 1.0)
    utility = ((j.stored.get("cells") or {}).get("utility") or {}).get("utility")
    return conclude_utility(utility, claim, ratio) if utility else Conclusion(NOT_RUN)


def _conclude_protects(row: Row, j: Judging) -> Conclusion:
    return conclude_protects(list(j.cells.values()), at_paper_budget(row, j.run), budget_note(row, j.run))


def _conclude_leaks(row: Row, j: Judging) -> Conclusion:
    key = "adaptive" if row.leak_cell == "adaptive" else f"paper:{row.attacks[0].name}"
    others = [(name, j.cells.get(k)) for name, k in (("the planner's", "planner"),
                                                      ("the paper's adaptive attack", "adaptive")) if k != key]
    return conclude_leaks(j.cells.get(key), at_paper_budget(row, j.run), others, budget_note(row, j.run))


def _conclude_order(row: Row, j: Judging) -> Conclusion:
    first = j.cells.get("paper:bayes-optimal")
    others = {n: j.cells.get(f"paper:{n}") for n in ("bayes-l2", "bayes-l1", "bayes-cos")}
    gaps = {n: row.order_psnr["bayes-optimal"] - row.order_psnr[n] for n in others}
    return conclude_order(first, others, gaps, below_budget=not at_paper_budget(row, j.run),
                          kinds=dict(row.order_kinds) or None)


def _conclude_chain(row: Row, j: Judging) -> Conclusion:
    return conclude_chain(j.chain, [BY_ID[r].paper_psnr for r in row.chain])


#: how each kind of claim is concluded from its evidence
CONCLUDERS: Dict[str, Callable[[Row, Judging], Conclusion]] = {
    "utility": _conclude_utility, "protects": _conclude_protects, "leaks": _conclude_leaks,
    "order": _conclude_order, "chain": _conclude_chain}


def conclude(row: Row, cells: Dict[str, Optional[CellEvidence]], run: Dict[str, Any],
             utility: Optional[Dict[str, Any]] = None, stored: Optional[Dict[str, Any]] = None,
             chain: Sequence[Tuple[str, Optional[CellEvidence]]] = ()) -> Conclusion:
    """The row's conclusion from its cells (see :mod:`bench.papers_verdict`); a row judged step
    by step (``per_step``) leaves out the steps whose model collapsed (:func:`collapsed`)."""
    stored = dict(stored or {})
    if utility is not None:
        stored["cells"] = {**(stored.get("cells") or {}), "utility": {"utility": utility}}
    judging = Judging(cells, run, stored, list(chain))
    if row.claim not in ("utility", "chain") and not any(c is not None for c in cells.values()):
        return Conclusion(NOT_RUN)
    if not row.claim_steps:
        return CONCLUDERS[row.claim](row, judging)
    if not row.per_step:
        judging.cells = {n: c.at_steps(row.claim_steps) if c is not None else None for n, c in cells.items()}
        return CONCLUDERS[row.claim](row, judging)
    return conclude_steps(*step_states(row, judging))


def step_states(row: Row, judging: Judging) -> Tuple[Dict[int, Conclusion], Dict[int, str], Dict[int, str]]:
    """Of a row judged step by step, its claim steps as (judged: their conclusion, not judged:
    why, pending: what is missing) from ``judging``'s cells; a step whose model collapsed
    (:func:`collapsed`) is not judged, one a cell still to come can change is pending."""
    cells = judging.cells
    health = (judging.stored.get("health") or {}).get("steps") or {}
    judged, skipped, pending = {}, {}, {}
    for step in row.claim_steps:
        why = collapsed(health[str(step)]) if str(step) in health else "the model's health is not measured: rerun the row"
        at_step = {n: c.at_steps([step]) if c is not None and step in c.steps else None for n, c in cells.items()}
        if why:
            skipped[step] = why
            continue
        if not any(c is not None for c in at_step.values()):
            pending[step] = "no cell has run this step yet"
            continue
        judging.cells = at_step
        found = CONCLUDERS[row.claim](row, judging)
        missing = [n for n, c in at_step.items() if c is None]
        if found.outcome == NOT_RUN or (missing and not found.decided):  # a cell still to come can change it
            pending[step] = f"{' and '.join(missing)} still to run" + (f"; so far {found.text()}"
                                                                      if found.outcome != NOT_RUN else "")
            continue
        judged[step] = found
    return judged, skipped, pending


def settled_steps(row: Row, stored: Dict[str, Any], plans: Sequence[CellPlan], run: Dict[str, Any],
                  cache: Optional[PlanCache] = None) -> Set[int]:
    """The claim steps of a row judged step by step that no further cell can change, from the
    stored cells that run what the tool runs: judged (a leak one cell shows decides its step at
    once) or not judged (the model measured collapsed); a step pass of :func:`run_row` skips
    them."""
    every = judged_on(whole_cells(stored, plans), claim_cells(stored, plans), step_cells(stored, plans))
    current = {n: None if stale_cell((stored.get("cells") or {}).get(n) or {}, cache) else c
               for n, c in every.items() if n != "utility"}
    judged, skipped, _ = step_states(row, Judging(current, run, stored, []))
    measured = (stored.get("health") or {}).get("steps") or {}  # unmeasured is not collapsed
    return set(judged) | {step for step in skipped if str(step) in measured}


def likely_cause(row: Row, run: Dict[str, Any], data: str, ours: Optional[float]) -> str:
    """Where our figure for the paper's own attack differs from the paper's by more than 3 dB:
    the differences that apply to this row (the label's, the data set, the code's)."""
    if ours is None or row.paper_psnr is None or abs(ours - row.paper_psnr) <= 3.0:
        return ""
    causes = differences(row, run)
    if data != "cifar10" or "CIFAR-10" not in row.setting.data:
        causes.append(f"data ({data} here, {row.setting.data} in the paper)")
    causes.extend(f"code: {n}" for n in row.notes)
    return f"{ours - row.paper_psnr:+.1f} dB from the paper; likely: " + "; ".join(causes or ["unexplained"])


# --------------------------------------------------------------------------- the page
def _f(v: Optional[float], digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return "inf" if v >= 199.9 else f"{v:.{digits}f}"


def cell_text(c: Optional[CellEvidence], head: str = "", progress: str = "") -> str:
    head = f"{head}: " if head else ""
    if c is None or (c.images == 0 and c.missing):
        return f"{head}{progress or 'not yet run'}"
    text = f"{head}{_f(c.psnr)} dB / {_f(c.ssim, 3)} / {_f(c.lpips, 3)}; {identification_text(c)}; {c.recovered} recovered"
    if len(c.per_step_psnr) > 1:
        text += "; per step " + ", ".join(f"{s}: {_f(v, 1)}" for s, v in sorted(c.per_step_psnr.items()))
        found = {s: [v for k, v in c.per_image_identified.items() if k[0] == s] for s in sorted(c.per_step_psnr)}
        text += " dB; identified per step " + ", ".join(f"{s}: {sum(v)}/{len(v)}" for s, v in found.items())
    if c.missing:
        text += f"; missing: {'; '.join(c.missing[:2])}"
    return text + (f"; {progress}" if progress else "")


def planner_head(row: Row, run: Dict[str, Any], c: Optional[CellEvidence], profile: str) -> str:
    names = "auto" if run["planner"] == ["auto"] else ", ".join(run["planner"])
    head = f"{names} at budget {run['planner_budget']:,}"
    if run["planner"] != ["auto"]:
        head += f" ({row.scale(profile).why})"
    if run["planner_args"]:
        head += f"; {json.dumps(run['planner_args'])}"
    return head + (f"; strongest {c.strongest}" if c is not None and c.strongest else "")


def adaptive_head(row: Row, run: Dict[str, Any]) -> str:
    """The adaptive attack's label, with its budget where it is not the row's."""
    own = run["adaptive_budget"]
    return row.adaptive.label + (f" at budget {own:,}" if own != run["budget"] else "")


def kept_image_steps(kept: Path, plan: CellPlan, planned: Sequence[str] = (),
                     key: Optional[str] = None) -> Set[Tuple[int, int]]:
    """The (step, image) pairs of the cell that an unfinished run kept in ``kept`` (its partial
    folder) with every attack's result the cell's call reuses, as the engine decides by the
    store's own result names: run with the cell's settings of its attack and the attack's
    current defaults, and not an error (retried); from the kept run with the most, or from the
    run ``key`` alone where given (the engine's key for the call today, :func:`run_key`). A planner
    cell's attacks are those the kept run has results of and those it plans now (``planned``,
    :func:`planned_attacks`): an attack the planner added is still to run on every image."""
    import adaptive  # noqa: F401  (registers the adaptive attacks in ATTACKS)
    from attacks import ATTACKS
    from attacks.presets import defaults_fingerprint
    from audit.report.store import RETRIED, result_id

    steps, images = [int(t) for t in plan.call["steps"]], int(plan.call["images"])
    named = [a for a in plan.call["attacks"] if a != "auto"]
    wanted = plan.call.get("attack_args") or {}
    fingerprint = functools.lru_cache(maxsize=None)(defaults_fingerprint)

    def attacks(run: Path) -> List[str]:  # the planner's picks: what the kept run has results of, and plans now
        ran = {f.stem.split("__")[1] for f in run.glob("s*__*__i*.json")}
        return named or (sorted(ran | set(planned)) if ran else [])

    def reused(path: Path, attack: str) -> bool:  # a result run with other settings is redone, not kept progress
        if not path.is_file():
            return False
        record = json.loads(path.read_text())
        return (record.get("status") not in RETRIED and attack in ATTACKS
                and record.get("defaults") == fingerprint(attack)
                and (attack not in wanted or record.get("settings") == _jsonable(wanted[attack])))

    def done(run: Path) -> Set[Tuple[int, int]]:
        ran = attacks(run)
        return {(s, i) for s in steps for i in range(images)
                if ran and all(reused(run / f"{result_id(s, a, i)}.json", a) for a in ran)}

    runs = [r for r in sorted(kept.glob("*")) if r.is_dir() and r.name != CONTROL_PARTIAL and key in (None, r.name)]
    return max((done(r) for r in runs), key=len, default=set())


def planned_attacks(plan: CellPlan, cache: Optional[PlanCache]) -> List[str]:
    """The attacks a planner cell's call plans now (kept in ``cache``); [] for a cell that names
    its attacks, or without a cache."""
    return cache.plan(plan.call) if cache is not None and "auto" in plan.call["attacks"] else []


def kept_for(partial: Path, plan: CellPlan, cache: Optional[PlanCache]) -> Set[Tuple[int, int]]:
    """:func:`kept_image_steps` under the engine's run key of today, with a planner cell's plan of
    now: both worked out only where a run is kept."""
    if not any(partial.glob("*/*.json")):
        return set()
    return kept_image_steps(partial, plan, planned_attacks(plan, cache), run_key(plan.call))


def kept_progress(results: Path, plan: CellPlan, claim_judged: bool = False, per_step: bool = False,
                  complete: Sequence[int] = ()) -> str:
    """For a cell not yet stored: how many of its image-steps an unfinished run has kept in the
    repository (:func:`kept_image_steps`; '' where none). Nothing is judged from them until the
    steps of the row's claim complete (:func:`claim_record`; ``claim_judged``: they are, so the
    text says so), or of a row judged step by step (``per_step``), each claim step's images
    (``complete``: the steps whose evidence is stored, :func:`step_record`, which the figures are of)."""
    kept = partial_dir(results, plan.name)
    best = len(kept_for(kept, plan, None))
    if not best:
        return ""
    kept_text = (f"{best} of {len(plan.call['steps']) * int(plan.call['images'])} image-steps kept in "
                 f"{kept.relative_to(ROOT) if kept.is_relative_to(ROOT) else kept}")
    if claim_judged:
        return f"the claim's steps complete, the others under way: {kept_text}"
    when = "each claim step judged once all its images are kept" if per_step else "judged when the claim's steps complete"
    if complete:
        when = f"the figures are of {_steps_text(complete)} alone, complete so far; {when}"
    return f"under way: {kept_text} ({when})"


def _steps_text(steps: Sequence[int]) -> str:
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(map(str, steps))


@dataclass
class RowView:
    """A row on the page: its line of the verdict table and its paragraphs below it."""

    row: Row
    conclusion: Conclusion
    label: str
    ours: str
    power: str
    verdict: str
    details: List[Tuple[str, str]]  # (what, text) paragraphs

    def line(self) -> str:
        label = "at the paper's setting" if self.label == AT_PAPER else "scaled"
        cells = [f"[{self.row.id}]({DETAILS_LINK}#{self.row.id})", self.row.paper, CLAIM_WORDS[self.row.claim], label,
                 self.row.paper_number, self.ours, self.power, f"**{_short(self.verdict, 110)}**"]
        return "| " + " | ".join(_short(c.replace("|", "/"), MAX_CELL) for c in cells) + " |"

    def section(self) -> str:
        head = f'<a id="{self.row.id}"></a>\n#### {self.row.id}: {self.row.figure}'
        paragraphs = [textwrap.fill(f"**{what}.** {text}", 100, break_long_words=False, break_on_hyphens=False)
                      for what, text in self.details if text]
        return "\n\n".join([head, *paragraphs])


#: a verdict table cell's longest text
MAX_CELL = 300
#: where each row's details live (the page holds the verdict table), from the page
DETAILS_PAGE = "bench/results/papers.md"
DETAILS_LINK = "../" + DETAILS_PAGE
#: the claim of each kind, in a few words
CLAIM_WORDS = {"protects": "the defense protects", "leaks": "the attack recovers images",
               "order": "the attacks' order", "utility": "accuracy kept", "chain": "PSNR falls as alpha rises"}


def health_text(stored: Dict[str, Any]) -> str:
    """The stored model health per step (:func:`model_health`), in words ('' where none)."""
    steps = (stored.get("health") or {}).get("steps") or {}
    return "; ".join(f"step {s}: " + (collapsed(h) or f"logit std {h['logit_std']:.2g}, {h['finite']} of {h['images']} "
                                      "gradients finite, none zero") for s, h in sorted(steps.items(), key=lambda i: int(i[0])))


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3].rsplit(" ", 1)[0] + " ..."


def _power(cells: Dict[str, Optional[CellEvidence]]) -> str:
    """The positive control's recovery of each cell, named (``ig 3/8; planner 5/8``): 'none stored'
    for a cell judged without one; '-' where the row has no attack cell (an accuracy claim)."""
    found = [f"{name.split(':', 1)[-1]} {c.power_text(short=True)}" for name, c in cells.items() if c is not None]
    return "; ".join(found) if found else "-"


def _ours(c: Optional[CellEvidence]) -> str:
    if c is None:
        return "-"
    return f"{_f(c.psnr)} dB; {c.identified} of {c.images} identified"


def decides(row: Row, cell: str) -> bool:
    """Whether the row's verdict is decided on ``cell``: an order claim compares the paper's
    attacks alone (the planner's cell is shown beside it); every other claim uses each cell."""
    return row.claim != "order" or cell.startswith("paper:")


def row_lines(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
              out: Path) -> RowView:
    stored, cells, plans = stored_cells(row, profile, data, data_args, root, out)
    claimed = claim_cells(stored, plans)
    stepped = step_cells(stored, plans)
    cache = PlanCache(results_path(root, profile.name, data, row).parent)
    run = run_setting(row, profile)
    utility = ((stored.get("cells") or {}).get("utility") or {}).get("utility")
    judged = judged_on(cells, claimed, stepped)
    chain = [(r, stored_cells(BY_ID[r], profile, data, data_args, root, out)[1].get(f"paper:{row.attacks[0].name}"))
             for r in row.chain]
    conclusion = conclude(row, judged, run, utility, stored, chain)
    setting = f"{own_text(row, run, data)}. Label: {label(row, run)}"
    base = [("The paper's claim", row.quote), ("The paper", row.setting.text()), ("Ours", setting),
            ("Open or different", "; ".join(row.notes))]
    if row.claim in ("utility", "chain"):
        chained = [c for _, c in chain]
        ours = "-" if row.claim == "utility" else "; ".join(f"{_f(c.psnr)}" if c else "-" for c in chained) + " dB"
        power = "none: an accuracy claim, no attack" if row.claim == "utility" else _power(
            {r.replace(row.id.rsplit("-", 1)[0] + "-", ""): c for r, c in chain})
        return RowView(row, conclusion, label(row, run), ours, power, conclusion.text(),
                       base + [("Verdict", f"**{conclusion.text()}**")])
    results = results_path(root, profile.name, data, row)
    changed = {n: stale_cell((stored.get("cells") or {}).get(n) or {}, cache) for n in cells}
    fresh = {n for n in claimed if not changed[n]}  # a stale claim's rerun is under way, not complete
    progress = {p.name: kept_progress(results, p, p.name in fresh, row.per_step,
                                      stepped[p.name].steps if p.name in stepped else ()) for p in plans
                if cells.get(p.name) is None}
    # a cell under way shows its claim's evidence (``judged``) beside its progress
    paper_cell = "<br>".join(cell_text(judged.get(f"paper:{a.name}"), a.label, progress.get(f"paper:{a.name}", ""))
                             for a in row.attacks)
    search = stored.get("search") or {}
    if row.search and search.get("chosen"):
        paper_cell += "<br>weights chosen on " + f"{search['held_out']} held-out images: " + "; ".join(
            f"{n} {_args_text(v)}{search_edge(search, n)}" for n, v in search["chosen"].items())
    planner = judged.get("planner")
    planner_cell = cell_text(planner, planner_head(row, run, planner, profile.name), progress.get("planner", ""))
    adaptive_cell = (cell_text(judged.get("adaptive"), adaptive_head(row, run), progress.get("adaptive", ""))
                     if row.adaptive else "-")
    first = judged.get(f"paper:{row.attacks[0].name}")
    cause = likely_cause(row, run, data, first.psnr if first else None)
    verdict = conclusion.text() + (f"; {cause}" if cause else "")
    if row.claim_steps and conclusion.outcome != NOT_RUN:
        verdict = f"judged at steps {', '.join(map(str, row.claim_steps))}: {verdict}"
    if stored.get("projection"):
        verdict += "; alpha: " + projection_text(stored["projection"])
    stale = sorted({a for n, why in changed.items() if decides(row, n) for a in why})
    aside = {n: f" Stale: {stale_text(why)}; running the row again redoes it." for n, why in changed.items()
             if why and not decides(row, n)}  # shown beside the verdict, which it does not decide
    planner_cell += aside.get("planner", "")
    adaptive_cell += aside.get("adaptive", "")
    pending = [n for n, c in cells.items() if c is None]
    claims_complete = all(claimed.get(n) is not None for n in pending)  # every pending cell has its claim's steps
    if stale:
        verdict = f"{STALE} ({stale_text(stale)}; running the row again redoes them): {verdict}"
        conclusion = Conclusion(STALE)  # counted apart: its attacks are no longer what the tool runs
    elif pending and (conclusion.decided or claims_complete):
        # every pending cell has its claim's steps complete, or a leak shown decides the claim
        # whatever they add: the verdict counts, the rest of the steps are shown as they finish
        if claims_complete:
            verdict += f" (decided at the claim's steps; the other steps of {' and '.join(pending)} under way)"
        else:
            states = [f"{n} under way" if progress.get(n) or n in stepped else f"{n} not yet run" for n in pending]
            verdict += f" (decided; {', '.join(states)})"
    elif pending and (any(c is not None for c in judged.values()) or any(progress.values())):
        states = [f"{n} under way" if progress.get(n) or n in stepped else f"{n} not yet run" for n in pending]
        verdict = f"{UNFINISHED} ({', '.join(states)})" + (f": {verdict}" if conclusion.outcome != NOT_RUN else "")
        conclusion = Conclusion(UNFINISHED)  # the summary counts it as unfinished, whatever its cells say so far
    details = base + [("The paper's attack", paper_cell.replace("<br>", "; ")),
                      ("The planner's attacks at their presets", planner_cell),
                      ("The paper's adaptive attack", "" if adaptive_cell == "-" else adaptive_cell),
                      ("The model at each step, as the audit trains it", health_text(stored)),
                      ("Verdict", f"**{verdict}**")]
    ours = _ours(first)
    if first is not None and first is stepped.get(f"paper:{row.attacks[0].name}"):
        ours += f" ({_steps_text(first.steps)} so far)"  # a cell under way: the steps complete
    return RowView(row, conclusion, label(row, run), ours, _power(judged), verdict, details)


#: a row with some of its cells stored: its verdict so far is shown, never counted as one
UNFINISHED = "unfinished"
#: a row whose stored cells ran attacks whose defaults have changed since: shown, counted apart
STALE = "stale"


HEADER = ("| row | paper | claim | label | paper's number | ours: the paper's attack | power: recovered without the defense | verdict |\n"
          "|---|---|---|---|---|---|---|---|")


def counts(rows: Sequence[Row], profile: Profile) -> Tuple[int, int]:
    """Rows at the paper's setting and scaled rows under ``profile``."""
    at = sum(label(r, run_setting(r, profile)) == AT_PAPER for r in rows)
    return at, len(rows) - at


def render(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
           out: Path) -> str:
    """The verdict table, then each row's details."""
    return "\n\n".join(render_parts(rows, profile, data, data_args, root, out))


def render_parts(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                 out: Path) -> Tuple[str, str]:
    """The page's summary and verdict table, and the rows' details (:data:`DETAILS_PAGE`)."""
    at, scaled = counts(rows, profile)
    outcomes: Dict[str, int] = {}
    views = [row_lines(row, profile, data, data_args, root, out) for row in rows]
    for view in views:
        outcomes[view.conclusion.outcome] = outcomes.get(view.conclusion.outcome, 0) + 1
    summary = (f"{len(rows)} rows: **{at} at the paper's setting, {scaled} scaled** (profile `{profile.name}`); "
               + ", ".join(f"{n} {_tally(o, n)}" for o, n in sorted(outcomes.items())))
    summary += "\n\n" + calibration_note(rows, profile, data, data_args, root, out)
    table = "\n".join([HEADER, *(v.line() for v in views)])
    parts = []
    for paper in PAPERS:
        chosen = [v for v in views if v.row.paper == paper]
        if chosen:
            parts.append("\n\n".join([f"### {paper}", *(v.section() for v in chosen)]))
    link = f"Each row's details, its cells and its verdict in full: [{DETAILS_PAGE}]({DETAILS_LINK})."
    return ("\n\n".join([summary, table, link]),
            "\n\n".join([textwrap.fill(CHANCE_NOTE, 100),
                          textwrap.fill(grid_note(rows, profile, data, data_args, root, out), 100), *parts]))


def calibration_note(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                     out: Path) -> str:
    """The two numbers every verdict leans on, pooled over the stored cells: the leak rule's
    false-positive rate on the cells' own null items, and what the positive control recovers."""
    from audit.core.evidence import clopper_pearson

    fp = items = with_fp = controlled = recovered = judged = cells = 0
    for row in rows:
        for cell in stored_cells(row, profile, data, data_args, root, out)[1].values():
            if cell is None:
                continue
            cells += 1
            if cell.false_positives:
                fp, items, with_fp = fp + cell.false_positives[0], items + cell.false_positives[1], with_fp + 1
            effect = cell.control_effect()
            if effect is not None:
                controlled, recovered, judged = controlled + 1, recovered + effect.control_recovered, judged + effect.images
    lo, hi = clopper_pearson(fp, items, LEVEL) if items else (0.0, 1.0)
    rule = (f"the leak rule calls {fp} of {items} null items recovered (95% CI {interval_text(lo, hi)}; each "
            f"unrelated image or data-only guess judged as if it were the reconstruction, leave-one-out), over the "
            f"{with_fp} of {cells} stored cells that keep it" if items else
            f"the leak rule's false-positive rate is kept by none of the {cells} stored cells yet (they ran before "
            "it was stored; docs/evidence.md measures it on the embedded data: 0 of 1,040)")
    control = (f"the positive control recovers {recovered} of {judged} images without the defense, over the "
               f"{controlled} cells that store one" if controlled else "no cell stores a positive control yet")
    return f"**Calibration.** {rule}; {control}."


def grid_note(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
              out: Path) -> str:
    """How many of the searched rows' chosen prior weights sit at the edge of their grid."""
    chosen = edges = 0
    for row in rows:
        search = (stored_cells(row, profile, data, data_args, root, out)[0].get("search") or {}) if row.search else {}
        for name in search.get("chosen") or {}:
            chosen += 1
            edges += bool(search_edge(search, name))
    return (f"**The searched weights.** {edges} of the {chosen} prior weights chosen on held-out images sit at the "
            "edge of their searched grid (each edge was extended a decade up to four times, then the search "
            "stopped): those are not bracketed by worse values, and the row says so beside the weight. The "
            "learning rate is chosen from 0.1 and 0.5 alone, so it is always at an edge.")


#: why each cell's chance is a bound, said once above the rows' details
CHANCE_NOTE = ("**Chance, per cell.** A cell's chance is the probability that the best of its m null guesses "
               "(m: its attacks times the references each is judged against) identifies the image: a "
               "hypergeometric draw of m of the null items ranked for that image. It is a bound, not a "
               "measurement: the same attacks were not run on null uploads (that would double every cell's cost), "
               "and a draw of m independent null items errs high when the attacks' outputs are alike, so a cell "
               "needs more identified images to read above chance. Each cell below names it.")


def _tally(outcome: str, count: int) -> str:
    """How many rows have ``outcome``, in words: "1 holds", "2 hold", "2 do not hold"."""
    plural = {"holds": "hold", "does not hold": "do not hold"}
    return plural.get(outcome, outcome) if count != 1 else outcome


def timing(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path, out: Path) -> str:
    seconds, done, total, stale, keyed = 0.0, 0, 0, 0, 0
    for row in rows:
        stored, cells, _ = stored_cells(row, profile, data, data_args, root, out)
        total += len(cells)
        for name, c in cells.items():
            if c is not None or (row.claim == "utility" and (stored.get("cells") or {}).get(name)):
                done += 1
                cell = (stored.get("cells") or {}).get(name) or {}
                seconds += float(cell.get("seconds") or 0.0)
                stale += bool(stale_cell(cell, PlanCache(results_path(root, profile.name, data, row).parent)))
                keyed += bool(cell.get("run_key"))
        seconds += float((stored.get("search") or {}).get("seconds") or 0.0)
    return (f"{done} of {total} cells stored" + (f" ({stale} stale)" if stale else "")
            + f", {keyed} of them checked against the engine's run key today (the others record none), "
              f"{seconds / 60:.1f} min of runs in all")


#: ms per image per gradient evaluation of IG on an H100 (``docs/gpu-turn.md``: the audit's grouped
#: iteration captured in a CUDA graph, 8 images, measured beside its floor): the gpu profile's
#: planning figure, not a measurement of these rows (a run of many images or iterations compiles
#: its program and is faster: 0.84 ms at 32 images on ResNet-18)
#: (``convnet9``: the ResNet-18 figure x 3.45, its forward FLOPs over a width-64 ResNet-18's at
#: 32x32; ``lenet``: the ``cnn`` figure, a model of a tenth of its FLOPs whose iteration is
#: bound by kernel launches, which the captured graph removes)
GPU_MS = {"resnet18": 2.75, "cnn": 0.158, "convnet9": 2.75 * 3.45, "lenet": 0.158}
#: the minutes of one lent GPU call: its command's wall-clock limit
GPU_CALL_MINUTES = 9.0
#: the planned minutes of one GPU slice at most: a call less a minute for seeding ``$OUT`` and
#: copying it back (the one-call command's ``--call-minutes 8``) and a minute for the process's
#: start (imports, LPIPS weights, restoring the kept results, a row's model health), so that every
#: call starts at least one slice and finishes it
GPU_SLICE_MINUTES = 7.0


def gpu_ms(model: str) -> float:
    """:data:`GPU_MS` of ``model`` (an unlisted model is planned as ResNet-18)."""
    return GPU_MS.get(model, GPU_MS["resnet18"])


def image_minutes(call: Dict[str, Any]) -> float:
    """Planned GPU minutes of one image of the cell's audit call (:func:`image_evaluations` at
    :data:`GPU_MS`; the defense's own cost inside adaptive attacks and the planner's probe are
    not counted: unmeasured)."""
    return image_evaluations(call) * gpu_ms(call["model"]) / 60000


def slice_evaluations(plan: CellPlan) -> float:
    """The gradient evaluations one slice of the cell pays for (:func:`cell_slices`): on the gpu
    profile, :data:`GPU_SLICE_MINUTES` at :data:`GPU_MS`; else :data:`SLICE_EVALUATIONS`."""
    return GPU_SLICE_MINUTES * 60000 / gpu_ms(plan.call["model"]) if plan.gpu else SLICE_EVALUATIONS


@dataclass(frozen=True)
class GpuSlice:
    """One slice of a cell: a step and a range of its images, with its planned GPU minutes (of
    the images no kept result covers)."""

    row: str
    cell: str
    step: int
    first: int
    images: int
    minutes: float

    def text(self) -> str:
        fits = "" if self.minutes <= GPU_SLICE_MINUTES else \
            f" (over a call's {GPU_SLICE_MINUTES:g} planned minutes: one image-step; no call starts it)"
        return (f"{self.row} {self.cell} step {self.step} images {self.first}-{self.first + self.images - 1}: "
                f"{self.minutes:.1f} min{fits}")


def gpu_slices(row: Row, profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
               out: Path, retry: bool = False) -> List[GpuSlice]:
    """The slices the row has left, in the order :func:`run_row` runs them: the slices of its
    cells' calls (:func:`cell_calls`, sliced as ``profile`` slices them) that attack something no
    kept result covers, each once."""
    stored, _, plans = stored_cells(row, profile, data, data_args, root, out)
    path = results_path(root, profile.name, data, row)
    found: List[GpuSlice] = []
    cache = PlanCache(path.parent)
    for plan, claim_only, until_step in open_passes(row, stored, plans, run_setting(row, profile), retry, cache):
        kept = kept_for(partial_dir(path, plan.name), plan, cache)
        found += [c.work for c in cell_calls(row, plan, kept, claim_only, until_step=until_step)
                  if c.work and c.work not in found]
    return found


def slices_left(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], root: Path,
                out: Path, retry: bool = False) -> List[GpuSlice]:
    """Every row's slices left (:func:`gpu_slices`), row by row."""
    return [s for row in rows for s in gpu_slices(row, profile, data, data_args, root, out, retry)]


def calls_needed(slices: Sequence[GpuSlice], minutes: float = GPU_SLICE_MINUTES) -> int:
    """How many calls run ``slices`` in order when each starts slices while their planned
    minutes fit its ``minutes`` (one slice at least)."""
    calls, left = 0, 0.0
    for s in slices:
        if not calls or s.minutes > left:
            calls, left = calls + 1, minutes
        left -= s.minutes
    return calls


def left_text(slices: Sequence[GpuSlice]) -> str:
    """The slices left in words: how many, their planned minutes and the calls they need."""
    return (f"{len(slices)} left, ~{sum(s.minutes for s in slices):.0f} planned minutes in "
            f"{calls_needed(slices)} {GPU_CALL_MINUTES:g}-minute calls")


def gpu_plan(slices: Sequence[GpuSlice]) -> str:
    """The GPU slices left, row by row, with their planned minutes, the total and the calls."""
    return "\n".join([s.text() for s in slices] + [
        f"slices: {left_text(slices)} (each call runs {GPU_SLICE_MINUTES:g} planned minutes of slices; "
        f"unmeasured: the plan counts {GPU_MS['resnet18']} ms per image-iteration on ResNet-18)"])


def call_summary(deadline: Deadline, over: Optional[CallOver], left: Sequence[GpuSlice]) -> str:
    """What one invocation under a deadline ran, why it stopped, and what is left."""
    stop = f"; stopped before {over}" if over else ""
    return (f"{len(deadline.ran)} slices run in {deadline.used():.1f} of {deadline.minutes:g} minutes{stop}; "
            f"{left_text(left)}")


# --------------------------------------------------------------------------- main
def selected(rows: Optional[Sequence[str]], papers: Optional[Sequence[str]], profile: str) -> List[Row]:
    return [r for r in ROWS if profile in r.profiles and (not rows or r.id in rows)
            and (not papers or r.paper in papers)]


def run_rows(rows: Sequence[Row], profile: Profile, data: str, data_args: Dict[str, Any], out: Path, root: Path,
             retry: bool = False, deadline: Optional[Deadline] = None,
             after_row: Callable[[], None] = lambda: None) -> Optional[CallOver]:
    """Run the rows in turn (:func:`run_row`), ``after_row`` after each that finishes; a failing
    row is reported and the others still run. Under a ``deadline`` the first slice that does not
    fit stops them all: returns why (None: every row ran)."""
    for i, row in enumerate(rows, 1):
        print(f"[{time.strftime('%H:%M:%S')}] row {i}/{len(rows)} {row.id} ({profile.name})", flush=True)
        try:
            run_row(row, profile, data, data_args, out, root, retry=retry, deadline=deadline)
        except CallOver as over:
            return over
        except Exception as err:  # a failing row is reported; the others still run
            print(f"  row {row.id} failed: {type(err).__name__}: {err}", flush=True)
            continue
        after_row()
    return None


def page_command(argv: Optional[Sequence[str]]) -> List[str]:
    """The arguments of the command that writes the whole page: the given ones without
    ``--render``, the row filters and the per-invocation limits."""
    return without_options(argv, valued=("--rows", "--paper", "--call-minutes"), flags=("--render", "--retry"))


def require_lpips() -> None:
    """The committed cells rank each image's candidates by LPIPS: without its weights the engine
    keys its runs by another similarity and every kept slice would run again, so stop first."""
    from audit.core.metrics import MetricUnavailable, lpips_model

    try:
        lpips_model("cpu")
    except MetricUnavailable as err:
        raise SystemExit(f"the committed cells identify images by LPIPS, unavailable here ({err}): run `make weights` "
                         "(or `gia-audit weights lpips`) first, else every kept slice runs again under another "
                         "similarity")


#: how a lent GPU call runs the gpu profile, with its command (``--help`` prints it)
GPU_CALL = """\
A lent GPU call (at most 9 minutes; only what it writes under ``$OUT`` comes back) runs the gpu
profile's slices (:func:`gpu_slices`: a step and as many images as fit
:data:`GPU_SLICE_MINUTES` at :data:`GPU_MS`) in order, starting each only while its planned
minutes fit what is left of ``--call-minutes``; each finished slice's results are in
``--results`` before the next starts, and a kept slice is never run again. ``--plan`` lists
the slices left, their minutes and the calls they need. Seed ``$OUT`` with the committed
results and run (the machine needs the LPIPS weights, ``make weights``)::

    mkdir -p $OUT/papers-gpu && cp -r bench/papers_results/gpu-embedded $OUT/papers-gpu/ 2>/dev/null; python bench/bench_papers.py --profile gpu --call-minutes 8 --results $OUT/papers-gpu

then replace the committed folder by what came back (``R``: where ``$OUT``'s files landed)
and commit it::

    rm -rf bench/papers_results/gpu-embedded && cp -r R/papers-gpu/gpu-embedded bench/papers_results/
    git add bench/papers_results/gpu-embedded && git commit -m "papers bench: gpu slices"

``python bench/bench_papers.py --profile gpu --render --docs papers-gpu`` then writes the page.
"""


def gpu_call_help() -> str:
    """:data:`GPU_CALL`, for ``--help``."""
    return GPU_CALL.strip()


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=gpu_call_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="cpu")
    parser.add_argument("--images", type=int, default=None, help="private images per cell (default: the row's)")
    parser.add_argument("--rows", action="append", choices=list(BY_ID), help="run only these rows")
    parser.add_argument("--paper", action="append", choices=list(PAPERS), help="run only this paper's rows")
    parser.add_argument("--data-path", default=None, help="a local CIFAR-10 (python pickle format)")
    parser.add_argument("--device", default=None, help="default: cuda for the gpu profile, else cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--call-minutes", type=float, default=GPU_CALL_MINUTES,
                        help="gpu profile: start a slice only while its planned minutes fit what is left of these "
                             f"(default {GPU_CALL_MINUTES:g}: one lent call; 8 in the one-call command below)")
    parser.add_argument("--out", default=str(ROOT / "bench-out" / "papers"), help="the engine's result stores")
    parser.add_argument("--results", default=None, help=f"the persisted cells (default {RESULTS})")
    parser.add_argument("--retry", action="store_true",
                        help="rerun stored cells with missing evidence or no positive control")
    parser.add_argument("--tiny", action="store_true", help="with --profile gpu: its rows and width-64 models at the "
                        "quick check's budgets (2 images, 4 evaluations), results under --out, never the page")
    parser.add_argument("--render", action="store_true", help="write the page from stored results; run nothing")
    parser.add_argument("--plan", action="store_true", help="print the slices left, their planned GPU minutes and "
                        "the calls they need")
    add_docs_option(parser, "docs/papers.md")
    args = parser.parse_args(argv)
    deadline = Deadline(args.call_minutes) if args.profile == "gpu" else None

    import torch

    torch.set_num_threads(args.threads)
    name = args.profile
    device = args.device or ("cuda" if name == "gpu" and not args.tiny else "cpu")
    if args.tiny and name != "gpu":
        raise SystemExit("--tiny checks the gpu profile on a CPU: use it with --profile gpu (the cpu profile's "
                         "own check is --profile quick)")
    profile = Profile(name, args.images or (QUICK["images"] if name == "quick" or args.tiny else None), device,
                      tiny=args.tiny)
    data, data_args = ("cifar10", {"path": args.data_path}) if args.data_path else ("embedded", {})
    out = Path(args.out)
    root = Path(args.results) if args.results else (out / "results" if profile.shrunk else RESULTS)
    rows = selected(args.rows, args.paper, name)
    page_rows = selected(None, None, name)  # the page shows every row of the profile
    if args.plan:
        print(gpu_plan(slices_left(rows, profile, data, data_args, root, out, args.retry)))
        return

    def publish() -> None:
        if args.docs and not profile.shrunk:
            table, details = render_parts(page_rows, profile, data, data_args, root, out)
            threads = "" if args.render else f"{args.threads} thread(s), "  # a render runs nothing
            setting = (f"torch {torch.__version__}, {threads}{device}; "
                       f"{timing(page_rows, profile, data, data_args, root, out)}")
            command = command_line("bench_papers.py", page_command(argv))
            write_table(args.docs_page, args.docs, command, table, setting)
            write_table(DETAILS_PAGE, args.docs, command, details, setting)

    if not args.render and not profile.shrunk:
        require_lpips()
    over = None if args.render else run_rows(rows, profile, data, data_args, out, root, args.retry, deadline, publish)
    print(render(rows, profile, data, data_args, root, out))
    publish()
    print(f"results: {root}")
    if deadline is not None and not args.render:
        print(call_summary(deadline, over, slices_left(rows, profile, data, data_args, root, out, args.retry)))


if __name__ == "__main__":
    main()
