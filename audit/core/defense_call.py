"""Calling a defense: run it, check what it returned, name it in errors.

The client simulation goes through :func:`call_defense` (checked output); attacks that
replay the defense on dummy data use :func:`invoke_defense` (round passed, unchecked), and
:func:`invoke_defense_many` / :func:`call_defense_many` for many batches and draws in one
batched call (``Defense.many``). All obey :func:`defense_timeout`, the audit's per-call limit
(times the number of calls a batched one stands for). :func:`as_defense` turns a plain
defended-gradient callable into a :class:`~audit.core.types.Defense` (a *name* is resolved by
:func:`defenses.resolve_defense`).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, List, Optional

import torch
from torch import Tensor, nn

from audit.core.errors import ConfigError, DefenseError, GiaError, NonFiniteUpdate
from audit.core.types import Defense, FunctionDefense, default_loss_fn, takes_round, trainable_parameters


def as_defense(defense: Any) -> Any:
    """``None``, a :class:`Defense`, or a plain callable (wrapped in :class:`FunctionDefense`)."""
    if defense is None or isinstance(defense, Defense):
        return defense
    if isinstance(defense, str):
        raise ConfigError(f"defense {defense!r} is a name; resolve it first (defenses.resolve_defense "
                          "or defenses.build_defense)")
    if not callable(defense):
        raise ConfigError(f"defense is a {type(defense).__name__}, not a callable "
                          "defense(model, inputs, labels, *, loss_fn, generator)")
    return FunctionDefense(defense)


def defense_name(defense: Any) -> str:
    return getattr(defense, "name", None) or getattr(defense, "__name__", type(defense).__name__)


def check_output(defense: Any, grads: Any, model: nn.Module) -> List[Tensor]:
    """Validate a defense's output against the model's trainable parameters; raise
    DefenseError naming the defense and the problem. Returns the gradients as a list."""
    name = defense_name(defense)
    params = trainable_parameters(model)
    if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
        raise DefenseError(f"defense {name!r} returned a {type(grads).__name__}; it must return a list "
                           f"with one tensor per trainable parameter ({len(params)})")
    grads = list(grads)
    if len(grads) != len(params):
        raise DefenseError(f"defense {name!r} returned {len(grads)} tensors for {len(params)} trainable "
                           "parameters; return one gradient per parameter, in model.parameters() order")
    for i, (g, p) in enumerate(zip(grads, params)):
        if not isinstance(g, Tensor):
            raise DefenseError(f"defense {name!r}: entry {i} is a {type(g).__name__}, not a tensor")
        if g.shape != p.shape:
            raise DefenseError(f"defense {name!r}: gradient {i} has shape {tuple(g.shape)}, the parameter "
                               f"has {tuple(p.shape)}")
        if g.dtype != p.dtype:
            raise DefenseError(f"defense {name!r}: gradient {i} is {g.dtype}, the parameter is {p.dtype}; "
                               "return gradients in the parameters' dtype")
        if g.device != p.device:
            raise DefenseError(f"defense {name!r}: gradient {i} is on {g.device}, the parameter on {p.device}; "
                               "return gradients on the model's device")
        if not bool(torch.isfinite(g).all()):
            bad = int((~torch.isfinite(g)).sum())
            raise NonFiniteUpdate(f"defense {name!r}: gradient {i} (shape {tuple(g.shape)}) has {bad} NaN/inf "
                               "entries")
    return grads


def wrap_client_model(defense: Any, model: nn.Module, seed: int) -> nn.Module:
    """``defense.wrap_model(model)`` under ``seed``: the client's model (an architectural
    defense such as PRECODE changes it once, before training; a defense without
    ``wrap_model`` leaves it as is). Its failures are :class:`DefenseError` naming the defense."""
    wrap = getattr(defense, "wrap_model", None)
    if not callable(wrap):
        return model
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            wrapped = wrap(model)
        except GiaError:
            raise
        except Exception as err:
            raise DefenseError(f"defense {defense_name(defense)!r}: wrap_model raised {type(err).__name__}: "
                               f"{err}") from err
    if not isinstance(wrapped, nn.Module):
        raise DefenseError(f"defense {defense_name(defense)!r}: wrap_model returned {type(wrapped).__name__}, "
                           "not an nn.Module; it must return the (wrapped) model")
    return wrapped


def accepts_round(defense: Any) -> bool:
    """Whether ``defense`` takes the FL round index: its declared ``accepts_round``, else a
    ``round`` keyword in its signature."""
    declared = getattr(defense, "accepts_round", None)
    return declared if isinstance(declared, bool) else takes_round(defense)


# --------------------------------------------------------------------------- per-call timeout
_TIMEOUT: ContextVar[Optional[float]] = ContextVar("defense_timeout", default=None)


@contextmanager
def defense_timeout(seconds: Optional[float]) -> Iterator[None]:
    """Within the block, every defense call (client, probe, replays) is abandoned after
    ``seconds`` with a DefenseError naming the defense (None: no limit)."""
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not seconds > 0):
        raise ConfigError(f"defense timeout must be a positive number of seconds or None, got {seconds!r}")
    token = _TIMEOUT.set(None if seconds is None else float(seconds))
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def in_functorch_transform() -> bool:
    """Whether a torch.func transform (vmap, grad) is active here: work inside one must stay
    on this thread (the transforms are thread-local)."""
    level = getattr(torch._C._functorch, "maybe_current_level", None)
    return level is not None and level() is not None


_ABANDONED: List[threading.Thread] = []


def abandoned_calls() -> List[str]:
    """The defense calls abandoned after their timeout that still run (their threads' names):
    their device work could interfere with a CUDA graph being captured."""
    _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
    return [t.name for t in _ABANDONED]


def _with_timeout(fn: Callable[[], Any], name: str, seconds: Optional[float]) -> Any:
    """``fn()``, abandoned after ``seconds`` with a DefenseError naming the defense.

    The call runs on a daemon worker thread (with this thread's grad mode) that the caller
    stops waiting for; Python cannot kill a thread, so a timed-out call is *abandoned*: it
    keeps running in the background until it returns, its result is dropped, and
    :func:`abandoned_calls` names it meanwhile.
    """
    if seconds is None or in_functorch_transform():
        return fn()
    box: dict = {}
    grad_enabled = torch.is_grad_enabled()

    def work() -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                box["value"] = fn()
        except BaseException as err:  # handed back to the caller's thread
            box["error"] = err

    worker = threading.Thread(target=work, name=f"defense-{name}", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        _ABANDONED.append(worker)
        raise DefenseError(f"defense {name!r} did not return within {seconds:g} s (the per-call timeout, "
                           "--defense-timeout); the call was abandoned")
    if "error" in box:
        raise box["error"]
    return box["value"]


def invoke_defense(defense: Any, model: nn.Module, inputs: Tensor, labels: Tensor, *,
                   loss_fn=default_loss_fn, generator=None, round=None) -> Any:
    """Run a defense as the client would, unchecked: ``round`` goes to a defense that accepts
    it, and the call obeys the current :func:`defense_timeout`. Replays inside attacks use
    this (their dummy data may legitimately give NaN); the client goes through :func:`call_defense`."""
    kwargs = {"loss_fn": loss_fn, "generator": generator}
    if round is not None and accepts_round(defense):
        kwargs["round"] = int(round)
    return _with_timeout(lambda: defense(model, inputs, labels, **kwargs), defense_name(defense), _TIMEOUT.get())


def call_defense(defense: Any, model: nn.Module, inputs: Tensor, labels: Tensor, *,
                 loss_fn=default_loss_fn, generator=None, round=None) -> List[Tensor]:
    """Run a defense and check its output; any failure becomes a DefenseError with its name.

    ``round`` (the FL round index) is passed only to a defense that accepts it."""
    try:
        grads = invoke_defense(defense, model, inputs, labels, loss_fn=loss_fn, generator=generator, round=round)
    except GiaError:
        raise
    except Exception as err:
        raise DefenseError(f"defense {defense_name(defense)!r} raised {type(err).__name__}: {err}") from err
    return check_output(defense, grads, model)


def invoke_defense_many(defense: Any, model: nn.Module, inputs: Tensor, labels: Tensor, *, draws: int = 1,
                        loss_fn=default_loss_fn, generator=None, round=None) -> List[Tensor]:
    """``draws`` defended gradients of each batch of ``inputs`` ``(N, B, ...)`` as one batched
    call (``Defense.many``; a plain callable is wrapped and called once per batch and draw),
    per parameter ``(N, draws, *shape)``; unchecked, like :func:`invoke_defense`."""
    wrapped = as_defense(defense)
    extra = {"round": int(round)} if round is not None and takes_round(wrapped.many) else {}
    seconds = _TIMEOUT.get()
    limit = None if seconds is None else seconds * len(inputs) * draws
    return _with_timeout(lambda: list(wrapped.many(model, inputs, labels, draws=draws, loss_fn=loss_fn,
                                                   generator=generator, **extra)),
                         defense_name(defense), limit)


def call_defense_many(defense: Any, model: nn.Module, inputs: Tensor, labels: Tensor, *, draws: int = 1,
                      loss_fn=default_loss_fn, generator=None, round=None) -> List[Tensor]:
    """:func:`invoke_defense_many` with :func:`call_defense`'s checks on every output."""
    try:
        stacked = invoke_defense_many(defense, model, inputs, labels, draws=draws, loss_fn=loss_fn,
                                      generator=generator, round=round)
    except GiaError:
        raise
    except Exception as err:
        raise DefenseError(f"defense {defense_name(defense)!r} raised {type(err).__name__}: {err}") from err
    expected = (len(inputs), draws)
    for g in stacked:
        if not isinstance(g, Tensor) or tuple(g.shape[:2]) != expected:
            raise DefenseError(f"defense {defense_name(defense)!r}: many() must return one tensor per parameter "
                               f"shaped (batches, draws, *shape) = {expected + ('...',)}")
    for n in range(len(inputs)):
        for d in range(draws):
            check_output(defense, [g[n, d] for g in stacked], model)
    return stacked
