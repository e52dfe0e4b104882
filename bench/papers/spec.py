"""What a row of the papers bench is: a paper's headline figure (:class:`PaperSetting`), the
attacks that check it (:class:`AttackRef`) and how each profile scales it (:class:`Scale`).
The rows themselves are data, in :mod:`bench.papers.rows`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from audit.engine.utility import PROTOCOL

PAPERS = ("CENSOR", "SVDefense", "Bayes framework", "Refiner")
PROFILES = ("cpu", "gpu", "quick")
AT_PAPER = "at the paper's setting"
#: what a profile runs when it scales a row down; 'quick' shrinks every row to this
QUICK = {"images": 2, "budget": 4, "held_out": 2}
#: private images a cell by default (a paper with fewer evaluation images still gets these)
IMAGES = 16


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
    #: a paper attack's own budget (by name) where it differs from the row's: one that converges
    #: in fewer evaluations than the row's first attack needs; below the paper's budget, the row
    #: is judged as below it
    attack_budgets: Dict[str, int] = field(default_factory=dict)
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
    utility_seeds: int = 3  # training seeds per arm of a utility claim (the quick check runs 2)
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
    #: claim "order": the kind of each pairwise claim (:data:`bench.papers.verdict.PAIR_KINDS`)
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
