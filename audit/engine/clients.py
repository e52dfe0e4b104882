"""Where an audit's observations come from: :class:`SimulatedClient`, the audited client's
upload simulated on a private batch (:func:`audit.client.observe.observe`) with the defense's
generator seeded per (step, image). An audit that observes something else (a federation's
real reply) supplies its own client with the same ``observe``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Protocol

from audit.client.observe import observe
from audit.core.client_training import ClientTraining
from audit.core.types import Observation
from audit.engine.identity import derive_seed
from audit.engine.settings import Sections


class Client(Protocol):
    """What an audit observes: the upload of ``images, labels`` from ``model`` at (step, image)."""

    def observe(self, model, images, labels, step: int, image: int) -> Observation: ...


def defense_seed(seed: int, step: int, image: int) -> int:
    """The seed of the defense's generator in (step, image)'s observation of an audit seeded ``seed``."""
    return derive_seed(seed, "defense", step, image)


def auxiliary_data(dataset: Any) -> Dict[str, Any]:
    """The extras every observation declares: the data set's train split (images and labels)."""
    return {"aux_images": dataset.train_images, "aux_labels": dataset.train_labels}


@dataclass(frozen=True)
class SimulatedClient:
    """The simulated client: its ``defense``, whether it shares its labels, its local
    ``training``, the audit's ``seed`` and the ``extra`` data every observation declares."""

    defense: Any
    share_labels: bool
    training: ClientTraining
    seed: int
    extra: Mapping[str, Any]

    @classmethod
    def of(cls, sections: Sections, defense: Any, dataset: Any) -> "SimulatedClient":
        """The client of an audit of ``sections`` with ``defense`` on ``dataset``."""
        return cls(defense, sections.data_settings.share_labels, sections.fl_settings.client, sections.seed,
                   auxiliary_data(dataset))

    def observe(self, model, images, labels, step: int, image: int) -> Observation:
        return observe(model, images, labels, self.defense, share_labels=self.share_labels, training=self.training,
                       step=step, seed=defense_seed(self.seed, step, image), extra=dict(self.extra))
