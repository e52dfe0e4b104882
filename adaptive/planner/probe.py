"""Black-box probing of a defended-gradient function.

:func:`probe_defense` calls the defense on a tiny probe network and a random probe batch,
several times and with different generators, and compares what it returns with the clean
gradient layer by layer. It relies on nothing but the defended-gradient contract; declared
knowledge (``wrap_model``, ``transform_inputs``, ``log_prob``, ``stochastic``) is read
when present (Kerckhoffs) and reported as such.
"""
from __future__ import annotations

import contextlib
import copy
import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError, DefenseError
from audit.core.models import Normalize
from audit.core.reasons import Reason
from audit.core.types import Defense, FunctionDefense, clean_gradients, default_loss_fn, trainable_names
from audit.core.defense_call import accepts_round, call_defense, defense_name, invoke_defense, wrap_client_model

from adaptive.planner.traits import DefenseTraits, LayerProbe

# tolerances (relative); exact-arithmetic defenses sit many orders of magnitude below them
CHANGE_TOL = 1e-5
VARY_TOL = 1e-6  # two draws differ by more than float round-off (cuda's atomics reorder sums ~1e-7)
NORM_TOL = 1e-4
ORTHO_TOL = 1e-3
RANK_RTOL = 1e-4
#: the largest rank the probe tells apart exactly on a matrix whose sides both exceed it
RANK_SKETCH = 512
RANK1_TOL = 1e-3
MIN_ENTRIES_FOR_LEVELS = 16  # fewer non-zeros say nothing about quantisation
QUANT_DECISION_ENTRIES = 1024  # layers this large decide the 'quantized' trait
MAX_QUANT_LEVELS = 256
LOUD = 1e4  # loss scale of the loud probe
PROPORTIONAL_TOL = 1e-5  # relative residual of shared = c * clean (float32 rescaling sits ~1e-7)
PROBE_ROUNDS = (0, 1, 2, 5, 10, 50)  # FL rounds probed (plus the audited steps)
CHECKPOINTS = 3  # probe model states: untrained, then after TRAIN_STEPS more clean SGD steps each
TRAIN_STEPS, TRAIN_LR = 5, 0.5
DRAWS_WITHOUT_ROUND = 3  # generator draws per checkpoint for a defense that ignores the round


def probe_network(input_shape: Tuple[int, int, int] = (3, 8, 8), num_classes: int = 10,
                  seed: int = 0) -> nn.Sequential:
    """A tiny network with a linear first layer (analytic checks), a conv layer, a hidden
    linear layer and a head: every kind of layer a defense may treat differently."""
    c, h, w = input_shape
    side = 4
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(
            Normalize(None, None, c), nn.Flatten(),
            nn.Linear(c * h * w, 4 * side * side), nn.ReLU(),
            nn.Unflatten(1, (4, side, side)),
            nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
            nn.Linear(8 * side * side, 32), nn.ReLU(),
            nn.Linear(32, num_classes),
        )


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


def random_batch(batch_size: int, input_shape: Sequence[int], num_classes: int, seed: int,
                 device, dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
    """A seeded probe batch: images uniform in [0, 1), labels uniform over the classes; drawn
    on the CPU, so the batch is the same on every device."""
    gen = _generator(seed, torch.device("cpu"))
    x = torch.rand(batch_size, *input_shape, generator=gen)
    y = torch.randint(0, num_classes, (batch_size,), generator=gen)
    return x.to(device=device, dtype=dtype or x.dtype), y.to(device)


@contextlib.contextmanager
def exact_math() -> Iterator[None]:
    """No TF32 in convolutions and matrix products (cuda's default for convolutions) and
    deterministic cuDNN kernels, so the probe's comparisons read the same traits on every device."""
    flags = torch.backends.cudnn
    saved = flags.allow_tf32, torch.backends.cuda.matmul.allow_tf32, flags.deterministic, flags.benchmark
    flags.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    flags.deterministic, flags.benchmark = True, False  # the same defense output twice
    try:
        yield
    finally:
        flags.allow_tf32, torch.backends.cuda.matmul.allow_tf32, flags.deterministic, flags.benchmark = saved


def _matrix_rank(t: Tensor) -> Optional[int]:
    """Numerical rank of ``t`` as an (out, rest) matrix. Where both sides exceed
    :data:`RANK_SKETCH`, the rank of a Gaussian sketch of the longer side: the same rank up to
    ``RANK_SKETCH + 1`` (with probability one), which a larger one reads as (a large model's
    fully connected layers: an exact SVD of them took minutes each on one core)."""
    if t.dim() < 2:
        return None
    m = t.detach().reshape(t.shape[0], -1).double()
    if not torch.any(m != 0):
        return 0
    if min(m.shape) > RANK_SKETCH:
        if m.shape[0] < m.shape[1]:
            m = m.T
        sketch = torch.randn(RANK_SKETCH + 1, m.shape[0], dtype=m.dtype, device=m.device,
                             generator=torch.Generator(m.device).manual_seed(0))
        m = sketch @ m
    return int(torch.linalg.matrix_rank(m, rtol=RANK_RTOL))


def _magnitude_levels(t: Tensor) -> Optional[int]:
    nz = t.detach().abs()[t != 0]
    if nz.numel() < MIN_ENTRIES_FOR_LEVELS:
        return None
    return int(torch.unique(nz).numel())


def _layer_probe(name: str, d: Tensor, c: Tensor, d_other: Tensor) -> LayerProbe:
    d, c, d_other = d.detach().double(), c.detach().double(), d_other.detach().double()
    cn, dn = c.norm().item(), d.norm().item()
    tiny = 1e-30
    rel = (d - c).norm().item() / max(cn, tiny)
    varies = _rel(d, d_other) > VARY_TOL
    noise = ((d - d_other).std().item() / math.sqrt(2.0)) if varies and d.numel() > 1 else None
    return LayerProbe(
        name=name, shape=tuple(d.shape),
        changed=rel > CHANGE_TOL or (cn == 0 and dn > 0),
        rel_diff=rel,
        cosine=(d * c).sum().item() / max(dn * cn, tiny),
        norm_ratio=dn / max(cn, tiny),
        zero_frac_clean=(c == 0).double().mean().item(),
        zero_frac_defended=(d == 0).double().mean().item(),
        rank_clean=_matrix_rank(c), rank_defended=_matrix_rank(d),
        magnitude_levels=_magnitude_levels(d),
        noise_std=noise, varies=varies,
    )


def _differentiability(defense, model, inputs, labels, generator, loss_fn) -> Tuple[bool, Optional[Reason]]:
    """Does the defended gradient carry a finite, non-zero gradient back to the inputs?
    Returns ``(answer, why not)`` (None where it does)."""
    x = inputs.detach().clone().requires_grad_(True)
    try:
        out = invoke_defense(defense, model, x, labels, loss_fn=loss_fn, generator=generator)
        s = sum((g.double() ** 2).sum() for g in out if g.requires_grad)
        if not isinstance(s, Tensor) or not s.requires_grad:
            return False, Reason("defense-detached")
        (gx,) = torch.autograd.grad(s, x, allow_unused=True)
    except RuntimeError as err:  # the defense detaches or uses non-differentiable ops
        return False, Reason("defense-differentiation-failed", error=str(err).split(". ")[0])
    if gx is None or gx.abs().sum().item() == 0:
        return False, Reason("defense-piecewise-constant")
    if not torch.isfinite(gx).all():
        return False, Reason("defense-gradient-not-finite")
    return True, None


def linear_modules(model: nn.Module) -> List[Tuple[str, nn.Linear]]:
    """``(weight parameter name, module)`` of every linear layer with a trainable bias."""
    out = []
    for mname, m in model.named_modules():
        if isinstance(m, nn.Linear) and m.bias is not None and m.weight.requires_grad and m.bias.requires_grad:
            out.append((f"{mname}.weight" if mname else "weight", m))
    return out


def rank1_features(dw: Tensor, db: Tensor) -> Tuple[Optional[Tensor], float]:
    """Recover a linear layer's batch-1 input from ``dW = db x^T`` (the row of the largest
    ``|db|``) and the relative residual of that rank-1 fit (0 for an exact gradient)."""
    i = int(db.detach().abs().argmax())
    if db[i] == 0:
        return None, float("inf")
    feats = dw[i] / db[i]
    resid = (dw - torch.outer(db, feats)).norm() / dw.norm().clamp_min(1e-30)
    return feats, float(resid)


def _analytic_layers(names: Sequence[str], grads: Sequence[Tensor], model: nn.Module) -> List[str]:
    index = {n: i for i, n in enumerate(names)}
    found = []
    for wname, _ in linear_modules(model):
        bname = wname[: -len("weight")] + "bias"
        if wname in index and bname in index:
            _, resid = rank1_features(grads[index[wname]].detach().double(), grads[index[bname]].detach().double())
            if resid < RANK1_TOL:
                found.append(wname)
    return found


def _input_from_first_linear(model: nn.Module, names, grads, input_shape) -> Tuple[Optional[Tensor], Optional[Reason]]:
    """Invert ``Normalize -> Flatten -> Linear`` analytically: ``(input, None)``, or
    ``(None, why not)``."""
    stem = Reason("transform-no-linear-stem")
    if not isinstance(model, nn.Sequential):
        return None, stem
    norm = None
    for i, m in enumerate(model):
        if isinstance(m, Normalize):
            norm = m
        elif isinstance(m, nn.Flatten):
            continue
        elif isinstance(m, nn.Linear) and m.bias is not None:
            w, b = f"{i}.weight", f"{i}.bias"
            if w not in names or b not in names:
                return None, stem
            feats, resid = rank1_features(grads[names.index(w)].detach(), grads[names.index(b)].detach())
            if feats is None or resid > RANK1_TOL:
                return None, Reason("transform-first-layer-perturbed")
            x = feats.reshape(1, *input_shape)
            return (x * norm.std + norm.mean if norm is not None else x), None
        else:
            return None, stem
    return None, stem


def _declared_input_transform(defense, inputs: Tensor, seed: int) -> bool:
    own = getattr(type(defense), "transform_inputs", None)
    if not isinstance(defense, Defense) or own is Defense.transform_inputs or own is None:
        return False
    moved = defense.transform_inputs(inputs, _generator(seed, inputs.device))
    return moved.shape != inputs.shape or not torch.allclose(moved, inputs)


def _noise_family(diff: Tensor) -> Optional[str]:
    """Gaussian vs Laplace from the kurtosis of the difference of two draws (3 vs 4.5)."""
    diff = diff.double()
    if diff.numel() < 1000:
        return None
    z = diff - diff.mean()
    var = (z ** 2).mean()
    if var == 0:
        return None
    kurt = float((z ** 4).mean() / var ** 2)
    if abs(kurt - 3.0) < 0.5:
        return "gaussian"
    if abs(kurt - 4.5) < 0.75:
        return "laplace"
    return None


def _declared_stochastic(defense) -> Optional[bool]:
    if isinstance(defense, FunctionDefense):  # its default is a guess, not a declaration
        declared = getattr(defense.fn, "stochastic", None)
        return None if declared is None else bool(declared)
    declared = getattr(defense, "stochastic", None)
    return None if declared is None else bool(declared)


def _architecture(defense, model: nn.Module, wrapped: nn.Module) -> Tuple[nn.Module, bool]:
    """The model to probe and whether ``wrap_model`` changed the architecture (``wrapped``: the
    client's model, ``model`` as built)."""
    if wrapped is model:
        return model, False
    before = [tuple(p.shape) for p in model.parameters()]
    after = [tuple(p.shape) for p in wrapped.parameters()]
    changed = before != after or type(wrapped) is not type(model) or len(list(wrapped.modules())) != len(list(model.modules()))
    declared = getattr(defense, "latent_bottlenecks", None)  # already wrapped: the bottlenecks say so
    changed = changed or bool(callable(declared) and declared(wrapped))
    return (wrapped if changed else model), changed


def proportional_to(shared: Sequence[Tensor], clean: Sequence[Tensor]) -> Optional[float]:
    """The factor ``c != 0`` with ``shared == c * clean`` (every tensor, one ``c``), or None."""
    d = torch.cat([g.detach().flatten().double() for g in shared])
    c = torch.cat([g.detach().flatten().double() for g in clean])
    cc = float(c @ c)
    if cc == 0 or not bool(torch.isfinite(d).all()):
        return None
    factor = float(d @ c) / cc
    if factor == 0:
        return None
    resid = float((d - factor * c).norm()) / max(float(d.norm()), 1e-30)
    return factor if resid < PROPORTIONAL_TOL else None


def trained_checkpoints(model: nn.Module, x: Tensor, y: Tensor, loss_fn, count: int = CHECKPOINTS,
                        steps: int = TRAIN_STEPS, lr: float = TRAIN_LR) -> List[nn.Module]:
    """``count`` copies of ``model``: as given, then after ``steps`` more clean SGD steps on the
    probe batch each (a defense may behave differently once the loss has dropped)."""
    current, out = copy.deepcopy(model), []
    for k in range(count):
        if k:
            for _ in range(steps):
                grads = clean_gradients(current, x, y, loss_fn)
                with torch.no_grad():
                    for p, g in zip([p for p in current.parameters() if p.requires_grad], grads):
                        p.sub_(lr * g)
        out.append(copy.deepcopy(current))
    return out


def probe_rounds(defense: Callable, model: nn.Module, x: Tensor, y: Tensor, *, rounds: Sequence[int] = (),
                 seed: int = 0, loss_fn=default_loss_fn) -> Dict[str, Any]:
    """Call the defense at several FL rounds (:data:`PROBE_ROUNDS` plus ``rounds``) on several
    trained checkpoints, and count the calls that shared the clean gradient or an exact
    multiple of it. A defense that ignores the round is drawn :data:`DRAWS_WITHOUT_ROUND`
    times per checkpoint instead. A call that fails is counted, not raised."""
    takes = accepts_round(defense)
    probed = sorted({int(r) for r in (*PROBE_ROUNDS, *rounds)}) if takes else [None] * DRAWS_WITHOUT_ROUND
    calls, clean_rounds, errors = [], set(), []
    for k, state in enumerate(trained_checkpoints(model, x, y, loss_fn)):
        clean = [g.detach() for g in clean_gradients(state, x, y, loss_fn)]
        for i, r in enumerate(probed):
            gen = _generator(seed + 1000 + 97 * k + i, x.device)
            try:
                shared = call_defense(defense, state, x, y, generator=gen, loss_fn=loss_fn, round=r)
            except DefenseError as err:
                errors.append(f"round {r}, checkpoint {k}: {err}")
                continue
            factor = proportional_to(shared, clean)
            calls.append({"round": r, "checkpoint": k, "clean": factor is not None, "factor": factor})
            if factor is not None and r is not None:
                clean_rounds.add(r)
    hits = sum(c["clean"] for c in calls)
    return {"accepts_round": takes, "rounds": [r for r in probed if r is not None], "checkpoints": CHECKPOINTS,
            "calls": len(calls), "clean_calls": hits, "clean_rounds": sorted(clean_rounds),
            "defended_rounds": sorted({c["round"] for c in calls if not c["clean"] and c["round"] is not None}),
            "errors": errors, "per_call": calls}


def probe_defense(
    defense: Callable,
    model: Optional[nn.Module] = None,
    input_shape: Tuple[int, int, int] = (3, 8, 8),
    num_classes: int = 10,
    *,
    seed: int = 0,
    batch_size: int = 8,
    loss_fn=default_loss_fn,
    device=None,
    rounds: Sequence[int] = (),
    dtype: Optional[torch.dtype] = None,
    client_model: Optional[nn.Module] = None,
) -> DefenseTraits:
    """Probe ``defense`` as a black box and return its :class:`DefenseTraits`.

    ``model`` defaults to :func:`probe_network`; ``batch_size`` > 1 makes clean linear-layer
    gradients rank ``batch_size`` so truncation is visible (a batch-1 probe runs too, for
    the analytic and input-transform checks). ``rounds``: FL rounds to probe besides
    :data:`PROBE_ROUNDS` for a defense that sometimes shares the clean gradient (:func:`probe_rounds`).
    ``dtype`` (e.g. ``torch.float64``) runs the probe network and batch in that precision; the
    probe batch is drawn on the CPU and TF32 is off, so the traits do not depend on the device.
    ``client_model``: ``model`` as the defense's ``wrap_model`` returned it (the audit's client
    model, wrapped once); None wraps ``model`` here, seeded.
    """
    with exact_math():
        return _probe(defense, model, input_shape, num_classes, seed=seed, batch_size=batch_size,
                      loss_fn=loss_fn, device=device, rounds=rounds, dtype=dtype, client_model=client_model)


def _probe(defense, model, input_shape, num_classes, *, seed, batch_size, loss_fn, device, rounds,
           dtype, client_model) -> DefenseTraits:
    if not callable(defense):
        raise ConfigError(f"plan() needs a defended-gradient callable, got {type(defense).__name__}")
    if batch_size < 2:
        raise ConfigError(f"probe batch_size must be >= 2 to see rank truncation, got {batch_size}")
    if model is None:
        model = probe_network(tuple(input_shape), num_classes, seed=seed)
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    model = model.to(device) if dtype is None else copy.deepcopy(model).to(device=device, dtype=dtype)
    if client_model is None:
        client_model = wrap_client_model(defense, copy.deepcopy(model), seed)
    elif dtype is not None:
        client_model = copy.deepcopy(client_model).to(device=device, dtype=dtype)
    else:
        client_model = client_model.to(device)
    model, architectural = _architecture(defense, model, client_model)
    names = trainable_names(model)
    if not names:
        raise ConfigError("the probe model has no trainable parameter; give a model with parameters")

    x, y = random_batch(batch_size, input_shape, num_classes, seed, device, dtype)

    def shared(inputs, labels, s):
        return [g.detach() for g in call_defense(defense, model, inputs, labels,
                                                  generator=_generator(s, device), loss_fn=loss_fn)]

    clean = [g.detach() for g in clean_gradients(model, x, y, loss_fn)]
    # a loud probe (loss x LOUD, so gradients x LOUD) reveals norm-dependent behaviour (clipping)
    loud = [g.detach() for g in call_defense(defense, model, x, y, generator=_generator(seed + 1, device),
                                              loss_fn=lambda out, lab: LOUD * loss_fn(out, lab))]
    loud_layers = [_layer_probe(n, a, LOUD * c, a) for n, a, c in zip(names, loud, clean)]
    d1, d2, d1_again = shared(x, y, seed + 1), shared(x, y, seed + 2), shared(x, y, seed + 1)
    layers = [_layer_probe(n, a, c, b) for n, a, c, b in zip(names, d1, clean, d2)]
    stochastic = any(p.varies for p in layers)
    reproducible = all(_rel(a, b) <= VARY_TOL for a, b in zip(d1, d1_again))
    changed = [p for p in layers if p.changed]

    sparse_extra = max(0.0, _weighted_mean([p.extra_zeros for p in changed], [_numel(p) for p in changed]))
    big = [p for p in changed if p.magnitude_levels is not None and _numel(p) >= QUANT_DECISION_ENTRIES]
    quantized = bool(big) and all(_coarse(p) for p in big)
    sign_only = bool(big) and all(p.magnitude_levels == 1 for p in big)

    noise_std = noise_rel = family = None
    if stochastic:
        moving = [i for i, p in enumerate(layers) if p.varies]
        diff = torch.cat([(d1[i] - d2[i]).flatten().double() for i in moving])
        ref = torch.cat([clean[i].flatten().double() for i in moving])
        noise_std = float(diff.std() / math.sqrt(2.0))
        noise_rel = noise_std / max(float(ref.pow(2).mean().sqrt()), 1e-30)
        family = _noise_family(diff)

    # batch-1 probe: analytic (rank-1) structure and input-transform consistency
    x1, y1 = x[:1], y[:1]
    b1 = shared(x1, y1, seed + 1)
    coarse = {p.name for p in layers if _coarse(p)}
    analytic = [n for n in _analytic_layers(names, b1, model) if n not in coarse]
    declared_transform = _declared_input_transform(defense, x, seed + 3)
    if declared_transform:
        input_transform, source = True, Reason("transform-declared")
    else:
        x_rec, why_not = _input_from_first_linear(model, names, b1, tuple(input_shape))
        if x_rec is None:
            input_transform, source = None, why_not
        else:
            regrad = clean_gradients(model, x_rec, y1, loss_fn)
            consistent = all(_rel(a, b) < 1e-3 for a, b in zip(regrad, b1))
            moved = (x_rec - x1).norm().item() > 1e-3 * x1.norm().item()
            input_transform = consistent and moved
            source = Reason("transform-probed-other-input" if input_transform else "transform-probed")

    differentiable, why_not = _differentiability(defense, model, x, y, _generator(seed + 1, device), loss_fn)
    notes = [Reason("defense-not-differentiable", why=why_not.to_dict())] if why_not else []
    if stochastic and not reproducible:
        notes.append(Reason("defense-global-randomness"))
    by_round = probe_rounds(defense, model, x1, y1, rounds=rounds, seed=seed, loss_fn=loss_fn)
    if by_round["errors"]:
        notes.append(Reason("defense-round-probe-failed", calls=len(by_round["errors"]), example=by_round["errors"][0]))
    declared = _declared_stochastic(defense)
    if declared is False and stochastic:
        notes.append(Reason("defense-declared-deterministic-varies"))

    return DefenseTraits(
        name=defense_name(defense),
        stochastic=stochastic,
        reproducible=reproducible,
        differentiable=differentiable,
        changed_layers=[p.name for p in changed],
        unchanged_layers=[p.name for p in layers if not p.changed],
        sparse=sparse_extra > 0.05,
        sparsity=sparse_extra,
        norm_preserving=_mostly(changed, lambda p: abs(p.norm_ratio - 1.0) < NORM_TOL),
        orthogonal=_mostly(changed, lambda p: abs(p.cosine) < ORTHO_TOL),
        rescaled=_rescaled(changed) or (not stochastic and _rescaled([p for p in loud_layers if p.changed])),
        low_rank=any(_truncated(p) for p in changed),
        rank_reduced_layers=[p.name for p in changed if _truncated(p)],
        quantized=quantized,
        sign_only=sign_only,
        noise_std=noise_std,
        noise_relative=noise_rel,
        noise_family=family,
        architectural=architectural,
        input_transform=input_transform,
        input_transform_source=source,
        analytic_layers=analytic,
        has_log_prob=callable(getattr(defense, "log_prob", None)),
        declared_stochastic=declared,
        layers=layers,
        notes=notes,
        rounds_probe=by_round,
        relu_linear_input=_relu_linear_input(model),
        conv_span_layers=_conv_span_layers(model, tuple(input_shape)),
    )


def _relu_linear_input(model: nn.Module) -> str:
    """What enters the model's first biased Linear followed by ReLU (``DefenseTraits.relu_linear_input``)."""
    from attacks.spear import relu_linear_layers

    found, _ = relu_linear_layers(model)
    return "" if not found else "image" if found[0].is_image else "features"


def _conv_span_layers(model: nn.Module, input_shape: Tuple[int, int, int]) -> List[str]:
    """The convolutions whose gradient spans their input's patches at batch 1 (``DefenseTraits.conv_span_layers``)."""
    from attacks.conv_span_algebra import span_layers

    return [layer.name for layer in span_layers(model, input_shape, 1)[0]]


def _mostly(changed: Sequence[LayerProbe], test: Callable[[LayerProbe], bool], share: float = 0.99) -> bool:
    """``test`` holds for the layers holding at least ``share`` of the changed entries (tiny
    tensors, e.g. a bias with fewer entries than the probe batch, may not allow it)."""
    total = sum(_numel(p) for p in changed)
    return total > 0 and sum(_numel(p) for p in changed if test(p)) >= share * total


def _rescaled(changed: Sequence[LayerProbe]) -> bool:
    """Every changed layer keeps its direction but not its norm (clipping)."""
    return bool(changed) and all(p.cosine > 1 - 1e-6 and abs(p.norm_ratio - 1) > NORM_TOL for p in changed)


def _coarse(p: LayerProbe) -> bool:
    """Few distinct magnitudes (sign / quantisation): structure says little about values."""
    return p.magnitude_levels is not None and p.magnitude_levels <= min(MAX_QUANT_LEVELS, _numel(p) // 4)


def _truncated(p: LayerProbe) -> bool:
    """Rank reduced by something other than zeroing entries or coarse quantisation."""
    return p.rank_reduced and p.extra_zeros < 0.01 and not _coarse(p)


def _numel(p: LayerProbe) -> int:
    return int(math.prod(p.shape)) if p.shape else 1


def _weighted_mean(values: Sequence[float], weights: Sequence[int]) -> float:
    total = sum(weights)
    return sum(v * w for v, w in zip(values, weights)) / total if total else 0.0


def _rel(a: Tensor, b: Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.norm() > 0 else float(a.norm())


def changed_parameters(defense: Callable, model: nn.Module, input_shape: Tuple[int, int, int],
                       num_classes: int, *, batch_size: int = 1, seed: int = 0,
                       loss_fn=default_loss_fn) -> List[int]:
    """Indices of the trainable parameters whose gradient ``defense`` changes, measured on a
    copy of ``model`` with a random batch (white-box: the mechanism is known, not the data)."""
    model = copy.deepcopy(model)
    device = next(model.parameters()).device
    x, y = random_batch(batch_size, input_shape, num_classes, seed, device)
    clean = [g.detach() for g in clean_gradients(copy.deepcopy(model), x, y, loss_fn)]
    shared = call_defense(defense, model, x, y, generator=_generator(seed + 1, device), loss_fn=loss_fn)
    return [i for i, (d, c) in enumerate(zip(shared, clean)) if _rel(d.detach(), c) > CHANGE_TOL]
