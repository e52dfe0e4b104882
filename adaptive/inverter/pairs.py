"""Training pairs of the learned inverter: (sketched defended gradient, auxiliary batch).

Every auxiliary batch goes through one client round exactly as the client ran it: the
observation's defense with a seeded generator, FedAvg unrolled, the client's BatchNorm
mode. Where the client runs one local step: for a pure gradient transform (a
:class:`~audit.core.types.Defense` that keeps the base ``__call__``: clean gradient, then
``transform``) the clean gradients of a whole chunk of batches come from one
``torch.func.vmap`` call and only the transform runs per batch; any other defense gets a
chunk of batches in one batched call (``Defense.many``, which a plain callable answers call
by call). Under FedAvg (or where vmap cannot handle the model) each batch runs the client
round itself.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch
from torch import Tensor
from tqdm.auto import tqdm

from attacks.simulator import ClientReplica, param_grads
from audit.core.errors import DefenseError, GiaError
from audit.core.reasons import Reason
from audit.client.observe import client_round
from audit.core.types import Defense, Observation, is_gradient_only
from audit.core.defense_call import call_defense_many, check_output

from adaptive.inverter.sketch import GradientSketch, flatten_gradients

CHUNK_FLOATS = 2 ** 25  # gradient entries held at once by the batched path (128 MiB in float32)
BAR = "learned-inverter: defended gradients"


def pair_indices(n: int, pairs: int, batch_size: int, generator: torch.Generator) -> Tensor:
    """``(pairs, batch_size)`` auxiliary indices: shuffled passes over the data, so every
    image is used before any repeats and no batch holds an image twice (``n >= batch_size``)."""
    need = pairs * batch_size
    passes = -(-need // n)
    order = torch.cat([torch.randperm(n, generator=generator) for _ in range(passes)])[:need]
    idx = order.view(pairs, batch_size)
    if batch_size > 1:  # a batch spanning two passes may repeat an image: redraw those rows
        for row in range(pairs):
            if idx[row].unique().numel() < batch_size:
                idx[row] = torch.randperm(n, generator=generator)[:batch_size]
    return idx


def is_gradient_transform(defense: Optional[Defense]) -> bool:
    """True for no defense or a defense that is "clean gradient, then ``transform``"."""
    return defense is None or is_gradient_only(defense)


def defended_features(observation: Observation, images: Tensor, labels: Tensor, index: Tensor,
                      sketch: GradientSketch, generator: torch.Generator, progress: bool = True,
                      info: Optional[Dict] = None) -> Tensor:
    """The sketched shared gradient of every auxiliary batch ``images[index[p]]``: ``(P, dim)``.

    ``info`` (a dict) receives how the pairs were made (``"pairs_path"``).
    """
    out = torch.empty(len(index), sketch.out_dim, device=observation.device)
    bar = tqdm(total=len(index), desc=BAR, disable=not progress, leave=False)
    try:
        done, how = 0, Reason("pairs-per-batch")
        one_step = observation.local_steps == 1 and observation.optimizer.plain
        if one_step and is_gradient_transform(observation.defense):
            done = _batched(observation, images, labels, index, sketch, generator, out, bar)
            how = Reason("pairs-vmap") if done else Reason("pairs-per-batch-unbatchable")
        elif one_step:
            done = _many(observation, images, labels, index, sketch, generator, out, bar)
            how = Reason("pairs-defense-many")
        _per_batch(observation, images, labels, index[done:], sketch, generator, out[done:], bar)
    finally:
        bar.close()
    if info is not None:
        info["pairs_path"] = how.to_dict()
    return out


def _per_batch(obs: Observation, images, labels, index, sketch, generator, out, bar) -> None:
    """One :func:`audit.client.observe` client round per batch on a private model copy, restored after each."""
    if len(index) == 0:
        return
    work = copy.deepcopy(obs.model)
    state = {k: v.clone() for k, v in work.state_dict().items()}
    for p in range(len(index)):
        rows = index[p].to(images.device)
        shared = client_round(work, images[rows], labels[rows], obs.defense, obs.training,
                              generator=generator, loss_fn=obs.loss_fn, round=obs.step).update
        out[p] = sketch(flatten_gradients(shared).detach().float())
        work.load_state_dict(state)
        bar.update(1)


def _many(obs: Observation, images, labels, index, sketch, generator, out, bar) -> int:
    """The defense on chunks of batches, one :func:`call_defense_many` each, on a private model
    copy in the client's mode (the call leaves its buffers as they are, as a restored client
    round does); returns the number of pairs done (all)."""
    work = copy.deepcopy(obs.model)
    work.train(obs.client_mode == "train")
    numel = sum(p.numel() for p in work.parameters() if p.requires_grad)
    chunk = max(1, min(256, CHUNK_FLOATS // max(numel, 1)))
    for start in range(0, len(index), chunk):
        rows = index[start:start + chunk].to(images.device)
        shared = call_defense_many(obs.defense, work, images[rows], labels[rows], draws=1, loss_fn=obs.loss_fn,
                                   generator=generator, round=obs.step)
        for p in range(rows.shape[0]):
            out[start + p] = sketch(flatten_gradients([g[p, 0] for g in shared]).detach().float())
            bar.update(1)
    return len(index)


def _batched(obs: Observation, images, labels, index, sketch, generator, out, bar) -> int:
    """Vmapped clean gradients per chunk, the defense's transform per batch; returns the
    number of pairs done (fewer than all when vmap fails on the first chunk)."""
    replica = ClientReplica(obs)
    defense = obs.defense
    numel = sum(p.numel() for p in replica.params.values())
    chunk = max(1, min(256, CHUNK_FLOATS // max(numel, 1)))

    def clean(x: Tensor, y: Tensor) -> List[Tensor]:
        grads, _ = param_grads(replica, replica.params, x, y, functional=True)
        return list(grads.values())

    done = 0
    for start in range(0, len(index), chunk):
        rows = index[start:start + chunk].to(images.device)
        try:
            stacked = torch.func.vmap(clean)(images[rows], labels[rows])
        except Exception:  # an op vmap cannot batch: the caller runs the client round per batch
            if start == 0:
                return 0
            raise
        for p in range(rows.shape[0]):
            grads = [g[p].detach() for g in stacked]
            if defense is not None:
                grads = check_output(defense, _transform(defense, grads, generator, replica.model), replica.model)
            out[start + p] = sketch(flatten_gradients(grads).float())
            bar.update(1)
        done = start + rows.shape[0]
    return done


def _transform(defense: Defense, grads: List[Tensor], generator, model) -> List[Tensor]:
    try:
        return defense.transform(grads, generator=generator, model=model)
    except GiaError:
        raise
    except Exception as err:
        raise DefenseError(f"defense {defense.name!r} raised {type(err).__name__}: {err}") from err
