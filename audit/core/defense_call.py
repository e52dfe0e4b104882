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

import contextlib
import queue
import signal
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator, List, Optional, Tuple

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


# --------------------------------------------------------------------------- user code that ends things
#: what user code raises to end the process, the audit or a generator: inside a defense, a
#: failure of that defense (the audit goes on and says "incomplete"), never the process's end
EXITS = (SystemExit, KeyboardInterrupt, GeneratorExit)
_SIGINTS = [0]  # SIGINTs received while user code ran on the main thread (see user_code)


@contextmanager
def user_code(name: str, what: str = "") -> Iterator[None]:
    """Run a defense's code: its ``sys.exit``, ``KeyboardInterrupt`` or ``GeneratorExit``
    becomes a :class:`DefenseError` naming it (``what``: which of its methods, e.g.
    "wrap_model"). The user's own Ctrl-C still stops the audit: on the main thread, the SIGINTs
    that arrive meanwhile are counted (its handler wrapped), and a KeyboardInterrupt raised
    while one arrived passes through."""
    counting = threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGINT))
    before = _SIGINTS[0]
    previous = signal.signal(signal.SIGINT, _counted(signal.getsignal(signal.SIGINT))) if counting else None
    try:
        yield
    except EXITS as err:
        if isinstance(err, KeyboardInterrupt) and _SIGINTS[0] != before:
            raise  # the user pressed Ctrl-C
        where = f" in {what}" if what else ""
        raise DefenseError(f"defense {name!r} raised {type(err).__name__}{where} ({err!r}); a defense must return its "
                           "gradients or raise an Exception, never end the process") from None
    finally:
        if counting:
            signal.signal(signal.SIGINT, previous)


def _counted(handler: Callable) -> Callable:
    def count(signum, frame):
        _SIGINTS[0] += 1
        return handler(signum, frame)

    return count


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
            with user_code(defense_name(defense), "wrap_model"):
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
#: seconds a defense call may take before the audit abandons it (``--defense-timeout``): ~19x
#: the slowest built-in defense call measured (SOTERIA, ResNet-18, batch 8: 31.7 s on 2 CPU
#: threads; docs/performance.md, ``bench/bench_defenses.py --calls``), so only a hung call meets it
DEFAULT_DEFENSE_TIMEOUT = 600.0
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


class _Worker:
    """A daemon thread that runs the defense calls of one calling thread, one at a time (a
    thread per call would cost ~0.1 ms each); once a call outlives its timeout the worker is
    abandoned with it and the next call gets a new one."""

    def __init__(self):
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="defense-calls", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:  # abandoned: its thread ends once the abandoned call returns
                return
            fn, box, done = job
            try:
                box["value"] = fn()
            except BaseException as err:  # handed back to the caller's thread
                box["error"] = err
            done.set()

    def run(self, fn: Callable[[], Any], name: str, seconds: float) -> Tuple[bool, dict]:
        """``fn()`` on this worker: (whether it returned within ``seconds``, its result box)."""
        box: dict = {}
        done = threading.Event()
        self.thread.name = f"defense-{name}"
        self.jobs.put((fn, box, done))
        return done.wait(seconds), box


_WORKERS = threading.local()


def _with_timeout(fn: Callable[[], Any], name: str, seconds: Optional[float]) -> Any:
    """``fn()``, abandoned after ``seconds`` with a DefenseError naming the defense.

    The call runs on a daemon worker thread (with this thread's grad mode, CUDA stream and torch
    thread count: float sums depend on the count)
    that the caller stops waiting for; Python cannot kill a thread, so a timed-out call is
    *abandoned*: it keeps running in the background until it returns, its result is dropped,
    and :func:`abandoned_calls` names it meanwhile. Inside a torch.func transform or a CUDA
    graph capture (both bound to this thread) the call runs here, without a limit.
    """
    cuda = torch.cuda.is_initialized()
    if seconds is None or in_functorch_transform() or (cuda and torch.cuda.is_current_stream_capturing()):
        with user_code(name):
            return fn()
    grad_enabled, threads = torch.is_grad_enabled(), torch.get_num_threads()
    stream = torch.cuda.current_stream() if cuda else None

    def work() -> Any:
        if torch.get_num_threads() != threads:  # a thread keeps the count it first ran torch with
            torch.set_num_threads(threads)
        with torch.set_grad_enabled(grad_enabled), user_code(name), \
                (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            return fn()

    worker = getattr(_WORKERS, "worker", None) or _Worker()
    _WORKERS.worker = worker
    finished, box = worker.run(work, name, seconds)
    if not finished:
        _WORKERS.worker = None
        worker.jobs.put(None)
        _ABANDONED.append(worker.thread)
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
