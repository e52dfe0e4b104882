"""An optimisation run's whole iteration as one captured program (docs/performance.md,
"The capture rule").

One iteration -- the batched loss and image gradient (the run's functional ``vmap(grad_and_value)``
composition), the optimiser's in-place update (Adam with the watchdog's bookkeeping and its
recoveries applied by mask) and the box's projection -- is one function of static buffers: the
members' variables and optimiser state, the targets and labels, the model's weights and buffers,
the run's other tensors (per-layer weights, masks, a prior's or defense's tensors) and two 0-dim
inputs (the scheduled learning rate and the iteration). A route (:data:`ROUTES`) makes it a
program: ``eager`` calls it, ``compiled`` calls it through ``torch.compile``, ``graph`` captures it
in a CUDA graph after warm-up iterations on a side stream and replays it, ``compiled-graph`` does
the same with the compiled function, ``recording`` is a CPU stand-in for a graph (the capture logs
every ATen operation, refuses host synchronisation, and each replay must run the same operations).
Warm-up iterations are real ones.

Programs are kept in the process (:data:`PROGRAMS`), keyed by everything they bake in
(:mod:`attacks.program_keys`), at most :data:`MAX_PROGRAMS`, and dropped oldest first while the
GPU's reserved memory (a graph's private pool stays reserved) is above :data:`MEMORY_FRACTION`
(:func:`evict`); a run copies its weights, targets, state and tensors into a kept
program's buffers, so the next step, group or layer-drop candidate of that key replays it without
building again. A group is padded to a few observation counts (each route's ``sizes``: at most 25%
more work) with copies of its last observation, so shapes repeat. A run that cannot be captured,
or whose capture fails, runs the eager batched loop; its trace's ``capture`` says why, the error in
full.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import itertools
import math
import time
import types
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from audit.core.defense_call import abandoned_calls
from audit.core.errors import GiaError
from audit.core.reasons import Reason
from audit.core.registry import Registry

from attacks.kernel_cache import compiled
from attacks.program_keys import program_key
from attacks.search_space import Box, ClampBox, SigmoidBox

ROUTES = Registry("capture route")
SETTINGS = ("auto", "on", "off")  # or a route name
#: the rule's thresholds (docs/performance.md, "The capture rule")
GRAPH_MIN_ITERATIONS = 10
COMPILE_MIN_MEMBER_ITERATIONS = 35_000
MAX_PROGRAMS = 32  # an audit's attacks x group shapes, with room for the next audit's
MEMORY_FRACTION = 0.5  # kept programs are dropped, oldest first, while more than this of a GPU is reserved
#: the largest share of a padded group's work that padding may take
PADDING_WASTE = 0.25
#: programs built, runs served by a kept one, torch.compile calls and graphs captured in this process
STATS = {"built": 0, "reused": 0, "compiled": 0, "captured": 0}
#: boxes whose ``project_`` is pure in-place tensor work
CAPTURABLE_BOXES = (Box, ClampBox, SigmoidBox)


class Route:
    """How a program runs its iteration function: ``prepare`` once, ``warm`` for the first
    ``warmup`` calls, then ``capture`` gives the callable that replays it."""

    name = "eager"
    cuda_only = False
    compiles = False
    sizes: Tuple[int, ...] = ()  # member counts a group is padded to (none: not padded)
    warmup = 0
    fallback: Optional[str] = None

    def prepare(self, fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
        return fn

    def warm(self, fn: Callable[[], Tensor]) -> Tensor:
        return fn()

    def capture(self, fn: Callable[[], Tensor], state: Sequence[Tensor] = ()) -> Callable[[], Tensor]:
        """The callable that replays ``fn`` (``state``: the tensors an iteration writes)."""
        return fn


class Compiled(Route):
    name, compiles = "compiled", True

    def prepare(self, fn):
        STATS["compiled"] += 1
        return compiled(_own_code(fn), fullgraph=True, dynamic=False)


def padding_sizes(largest: int = 256, waste: float = PADDING_WASTE) -> Tuple[int, ...]:
    """Observation counts a group is padded to: each the largest that a group one above the
    previous may be padded to with at most ``waste`` of the work (padding / padded) wasted."""
    sizes = [1]
    while sizes[-1] < largest:
        sizes.append(min(largest, int((sizes[-1] + 1) / (1 - waste) + 1e-9)))
    return tuple(sizes)


@contextlib.contextmanager
def capturing(begin: Callable[[], None], end: Callable[[], None], stream: Any):
    """The block between ``begin()`` and ``end()`` with ``stream`` (a context manager) current: an
    error inside still ends the capture but keeps its own error (ending an invalidated capture
    raises one that would replace it), and the previous stream is current again however the
    block ends."""
    with stream:
        begin()
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                end()
            raise
        end()


def _no_abandoned_calls() -> None:
    running = abandoned_calls()
    if running:
        raise CaptureFailed(f"a defense call abandoned after its timeout still runs on a thread ({', '.join(running)}); "
                            "its device work could invalidate a capture")


class Graph(Route):
    name, cuda_only, warmup = "graph", True, 3
    sizes = padding_sizes()

    def warm(self, fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream().wait_stream(side)
        return out

    def capture(self, fn, state=()):
        _no_abandoned_calls()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()  # as torch.cuda.graph: nothing pending, cached memory returned
        gc.collect()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        generator = torch.cuda.default_generators[torch.cuda.current_device()]
        before = generator.clone_state()
        try:
            with capturing(lambda: graph.capture_begin(capture_error_mode="thread_local"), graph.capture_end,
                           torch.cuda.stream(side)):
                out = fn()
        except BaseException:
            # a capture that fails before its end leaves the generator in capture mode, and every
            # later random draw on this GPU (a compile's, a noise defense's) would then raise
            generator.graphsafe_set_state(before)
            raise
        torch.cuda.current_stream().wait_stream(side)
        STATS["captured"] += 1

        def replay() -> Tensor:
            graph.replay()
            return out

        replay.graph = graph  # keeps the graph (and its memory pool) with the program
        replay.reserved = max(0, torch.cuda.memory_reserved() - reserved)
        return replay


class CompiledGraph(Graph):
    name, compiles, fallback = "compiled-graph", True, "graph"
    prepare = Compiled.prepare


#: the recording route's stand-in for the current CUDA stream
RECORDING_STREAM = ["default"]
#: operations a CUDA graph capture cannot contain (they wait for the device)
HOST_SYNCS = ("_local_scalar_dense", "item", "nonzero", "equal", "is_nonzero")


class _Recorder(TorchDispatchMode):
    """Logs every ATen operation; while capturing, refuses host synchronisation as CUDA does."""

    def __init__(self, capturing: bool):
        super().__init__()
        self.ops: List[str] = []
        self.capturing, self.failed = capturing, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.capturing and name in HOST_SYNCS:
            self.failed = True
            raise RuntimeError(f"operation not permitted when stream is capturing ({name} waits for the device)")
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def begin(self) -> None:
        self.__enter__()

    def end(self) -> None:
        self.__exit__(None, None, None)
        if self.failed:
            raise RuntimeError("the capture was invalidated (an operation inside it was not permitted)")


@contextlib.contextmanager
def _recording_stream():
    saved = RECORDING_STREAM[0]
    RECORDING_STREAM[0] = "capture"
    try:
        yield
    finally:
        RECORDING_STREAM[0] = saved


class Recording(Route):
    """A CUDA graph's stand-in on any device: the capture pass runs as a graph's would (between
    a begin and an end, on its own "stream", refusing host synchronisation, leaving the
    program's state as it found it), and every replay runs the iteration again, checks that it
    ran the captured operations, and returns the captured output buffer."""

    name, warmup = "recording", 3
    sizes = padding_sizes()

    def capture(self, fn, state=()):
        _no_abandoned_calls()
        recorder = _Recorder(capturing=True)
        saved = [t.clone() for t in state]
        try:
            with torch.random.fork_rng(devices=[]), capturing(recorder.begin, recorder.end, _recording_stream()):
                out = fn()
        finally:  # a graph's capture computes nothing
            with torch.no_grad():
                for t, s in zip(state, saved):
                    t.copy_(s)
        STATS["captured"] += 1

        def replay() -> Tensor:
            with _Recorder(capturing=False) as again:
                value = fn()
            if again.ops != recorder.ops:
                first = next(i for i, (a, b) in enumerate(itertools.zip_longest(recorder.ops, again.ops)) if a != b)
                raise RuntimeError(f"a replay ran other operations than its capture (from operation {first})")
            with torch.no_grad():
                out.copy_(value)
            return out

        replay.ops = recorder.ops
        return replay


ROUTES.add("eager", Route(), "the iteration function called as is (the reference)")
ROUTES.add("compiled", Compiled(), "torch.compile(fullgraph=True) of the iteration (inductor kernels)")
ROUTES.add("graph", Graph(), "the eager iteration captured in a CUDA graph and replayed")
ROUTES.add("compiled-graph", CompiledGraph(), "the compiled iteration captured in a CUDA graph and replayed")
ROUTES.add("recording", Recording(), "a CUDA graph's stand-in on any device: the capture logs every operation and "
                                     "refuses host synchronisation, each replay must run the same operations")

_SERIAL = itertools.count()


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: torch.compile keeps its compiled graphs per code
    object, so each program gets its own cache instead of recompiling a shared one."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_SERIAL)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


# -- the rule
def program_blockers(run, per: str) -> List[Reason]:
    """Why ``run``'s iteration cannot be one traced program, captured or compiled (empty when it
    can): sequential execution asked for, a simulator that is not functional, or a group mean
    that changes ``per`` iteration or step."""
    return [why for why in (
        Reason("sequential-requested") if run.attack.execution == "sequential" else None,
        None if run.simulator.batchable else Reason("not-functional", simulator=run.simulator.describe()),
        Reason("group-mean-changes", per=per) if run.needs_group_mean else None,
    ) if why]


def _blockers(run) -> List[Reason]:
    box = getattr(run.box, "name", type(run.box).__name__)
    uncapturable = getattr(run.attack.optimizer, "uncapturable",
                           Reason("optimizer-not-capture-safe", optimizer=type(run.attack.optimizer).__name__))
    return program_blockers(run, "iteration") + [Reason.of(why) for why in (
        None if type(run.box) in CAPTURABLE_BOXES else Reason("box-not-capturable", box=box),
        uncapturable or None,
    ) if why]


def off(*why: Reason, replayed: int = 0) -> Reason:
    """The eager loop's reason: ``why`` it runs (and the iterations a program replayed before it)."""
    return Reason("capture-off", why=[w.to_dict() for w in why], replayed=replayed)


def decide(run, iterations: int) -> Tuple[Optional[Route], Reason]:
    """The route for ``run`` (None: the eager loop) and why (a reason the report words), from its
    ``capture`` setting, the device and its planned ``iterations`` x members (docs/performance.md,
    "The capture rule")."""
    setting, device = run.attack.capture, run.device.type
    if setting == "off":
        return None, off(Reason("capture-setting", setting=setting))
    blockers = _blockers(run)
    if blockers:
        return None, off(*blockers)
    if setting in ROUTES:
        route = ROUTES.get(setting)
        if route.cuda_only and device != "cuda":
            return None, off(Reason("route-needs-cuda", route=setting, device=device))
        return route, Reason("capture-setting", setting=setting)
    member_iterations = iterations * run.n * run.attack.restarts
    if device != "cuda":
        if setting == "on":
            return ROUTES.get("compiled"), Reason("capture-on-cpu")
        return None, off(Reason("capture-cuda-only", device=device))
    if setting == "auto" and iterations < GRAPH_MIN_ITERATIONS:
        return None, off(Reason("capture-too-few", iterations=iterations, minimum=GRAPH_MIN_ITERATIONS))
    many = Reason("member-iterations", count=member_iterations, minimum=COMPILE_MIN_MEMBER_ITERATIONS,
                  above=member_iterations >= COMPILE_MIN_MEMBER_ITERATIONS)
    if run.attack.compile or member_iterations >= COMPILE_MIN_MEMBER_ITERATIONS:
        return ROUTES.get("compiled-graph"), Reason("compile-requested") if run.attack.compile else many
    return ROUTES.get("graph"), many


def padded_observations(n: int, route: Route) -> int:
    """Observations a group of ``n`` is padded to for ``route`` (its restarts come with each)."""
    return next((s for s in route.sizes if s >= n), n)


# -- programs
def _fill(static: Tensor, real: Tensor, n: int, slots: int = 1) -> None:
    """Copy ``real`` (``n`` observations' rows, as many each) into ``static`` (``slots`` rows an
    observation, as many observations or more): an observation's slots after its rows repeat its
    last row (the survivor after the restart selection fills its restarts' slots), and a padded
    observation is a copy of the last real one."""
    per = real.shape[0] // n
    grid, rows = static.view(-1, slots, *static.shape[1:]), real.view(n, per, *real.shape[1:])
    grid[:n, :per].copy_(rows)
    if slots > per:
        grid[:n, per:].copy_(rows[:, -1:].expand(n, slots - per, *rows.shape[2:]))
    if grid.shape[0] > n:
        grid[n:].copy_(grid[n - 1:n].expand_as(grid[n:]))


def _real(static: Tensor, n: int, per: int, slots: int) -> Tensor:
    """The rows of ``static`` that :func:`_fill` copied from a real tensor of ``n`` x ``per`` rows."""
    return static.view(-1, slots, *static.shape[1:])[:n, :per].reshape(n * per, *static.shape[1:])


class CaptureFailed(RuntimeError):
    """A program could not be built, warmed up or captured."""


class Program:
    """One iteration function over static buffers and its route's callable. A template run over
    the padded group, built from copies of the run's attack and first observation (so loading
    another run never writes into the first one's objects), holds the weights, targets, labels
    and the tensors the key lists as inputs. Its members are the attack's restarts of each
    observation; after the restart selection a run's one survivor an observation fills all of
    its observation's slots (copies run alongside), so the run keeps its program."""

    def __init__(self, run, variables: Sequence[Tensor], route: Route, key: Tuple, inputs: List[Tensor]):
        start = time.perf_counter()
        n_padded = padded_observations(run.n, route)
        self.route, self.n_padded, self.restarts, self.device = route, n_padded, run.attack.restarts, run.device
        first = run.group[0]
        own = dataclasses.replace(first, model=copy.deepcopy(first.model), defense=copy.deepcopy(first.defense))
        padded = [own] + run.group[1:] + [run.group[-1]] * (n_padded - run.n)
        with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
            self.template = type(run)(copy.deepcopy(run.attack), padded, [0] * n_padded, show_bars=False)
        self.inputs = program_key(self.template, n_padded)[1]
        shapes = lambda ts: [(tuple(t.shape), t.dtype) for t in ts]  # noqa: E731
        if shapes(self.inputs) != shapes(inputs):
            raise CaptureFailed("the program's copy of the run reads other tensors than the run")
        members = n_padded * self.restarts
        self.loaded = (run.n, run.restarts)  # the loaded run's observations and restarts each
        self.variables = [torch.zeros((members, *v.shape[1:]), dtype=v.dtype, device=v.device) for v in variables]
        self.optimizer = copy.deepcopy(run.attack.optimizer)
        self.optimizer.start(self.variables, 1)
        self.targets, self.fixed = self.template.step_inputs()
        self.lr = torch.zeros((), dtype=variables[0].dtype, device=run.device)
        self.clock = torch.zeros((), dtype=torch.long, device=run.device)
        step, template, box = self.template._batched_step(compiled=False), self.template, self.template.box
        statics, optimizer, lr, clock = self.variables, self.optimizer, self.lr, self.clock
        targets, fixed = self.targets, self.fixed

        def iteration() -> Tensor:
            loss, _, grads = template.batched_call(step, targets, fixed, None, statics)
            optimizer.update(statics, loss, grads, lr, clock)
            box.project_(statics[0])
            return loss

        self.fn = route.prepare(iteration)
        self.replay: Optional[Callable[[], Tensor]] = None
        self.calls = 0
        self.reserved = 0  # bytes its capture reserved (its graph's private pool)
        self.runs = 0  # runs that loaded it
        self.setup_s = time.perf_counter() - start  # building, compiling, warming up, capturing
        STATS["built"] += 1

    def state(self) -> List[Tensor]:
        """The tensors an iteration writes."""
        return [*self.variables, *self.optimizer.state().values()]

    def weights(self, run) -> List[Tensor]:
        """The model tensors the iteration reads (the template's are the static ones): the
        replica's, and the observation's model's (a transform may read it)."""
        replica = run.replica
        bn = [t for pair in replica.bn_running or () for t in pair]
        model = run.obs.model
        return [*replica.params.values(), *replica.frozen.values(), *bn,
                *model.parameters(), *model.buffers()]

    def load(self, run, variables: Sequence[Tensor], optimizer, inputs: Sequence[Tensor]) -> None:
        """Copy ``run``'s weights, targets, labels, input tensors, variables and optimiser state in."""
        self.runs += 1
        n, per = self.loaded = (run.n, run.restarts)
        with torch.no_grad():
            for static, real in zip(self.weights(self.template), self.weights(run)):
                static.copy_(real)
            for static, real in zip(self.inputs, inputs):
                if static is not real:
                    static.copy_(real)
            targets, fixed = run.step_inputs()
            for static, real in zip(self.targets, targets):
                _fill(static, real, n)
            if fixed is not None:
                _fill(self.fixed, fixed, n)
            for static, real in zip(self.variables, variables):
                _fill(static, real, n, self.restarts)
            own = optimizer.state()
            for name, static in self.optimizer.state().items():
                _fill(static, own[name], n, self.restarts)

    def store(self, variables: Sequence[Tensor], optimizer) -> None:
        """Copy the real members' variables and optimiser state back out."""
        with torch.no_grad():
            for static, real in zip(self.variables, variables):
                real.copy_(self.real(static))
            own = optimizer.state()
            for name, static in self.optimizer.state().items():
                own[name].copy_(self.real(static))

    def real(self, static: Tensor) -> Tensor:
        """The loaded run's members' rows of a per-member tensor of the program."""
        return _real(static, *self.loaded, self.restarts)

    def __call__(self, lr: float, iteration: int) -> Tensor:
        """One iteration: the padded group's per-member loss at the point it evaluated."""
        self.lr.fill_(lr)
        self.clock.fill_(iteration)
        self.calls += 1
        if self.replay is not None:
            return self.replay()
        start = time.perf_counter()
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            if self.calls > self.route.warmup:  # streams and graphs on the run's GPU
                self.replay = self.route.capture(self.fn, self.state())
                self.reserved = getattr(self.replay, "reserved", 0)
                out = self.replay()
            else:
                out = self.route.warm(self.fn)
        self.setup_s += time.perf_counter() - start
        return out


#: programs kept in this process, least recently used first
PROGRAMS: "OrderedDict[Tuple, Program]" = OrderedDict()
#: keys whose capture failed, and why (not tried again)
FAILED: Dict[Tuple, str] = {}


def program_for(run, variables: Sequence[Tensor], route: Route) -> Tuple[Program, bool, List[Tensor]]:
    """The kept program for ``run``'s key (one of ``route``, or a compiled one already paid
    for), or a new one; whether it was reused; and the run's tensors to load into it."""
    key, inputs = program_key(run, padded_observations(run.n, route))
    kept = PROGRAMS.get(key)
    if kept is not None and (kept.route is route or kept.route.compiles):
        PROGRAMS.move_to_end(key)
        STATS["reused"] += 1
        return kept, True, inputs
    if (key, route.name) in FAILED:
        raise CaptureFailed(FAILED[(key, route.name)])
    evict(run.device, room=1)
    program = Program(run, variables, route, key, inputs)
    PROGRAMS[key] = program
    return program, False, inputs


def evictions(reserved: int, limit: float, entries: Sequence[Tuple[Any, int]],
              max_entries: int = MAX_PROGRAMS) -> List[Any]:
    """The keys to drop, oldest first, of ``entries`` (key and the bytes its program holds,
    oldest first): those beyond the newest ``max_entries``, then more while ``reserved`` less
    what the dropped hold is above ``limit``."""
    over = max(0, len(entries) - max_entries)
    left = reserved - sum(held for _, held in entries[:over])
    drop = [key for key, _ in entries[:over]]
    for key, held in entries[over:]:
        if left <= limit:
            break
        drop.append(key)
        left -= held
    return drop


def device_memory(device: torch.device) -> Tuple[int, float]:
    """Bytes the caching allocator holds on ``device`` (freed blocks of every graph's private
    pool included) and the :data:`MEMORY_FRACTION` limit; no limit off CUDA."""
    if device.type != "cuda":
        return 0, math.inf
    return torch.cuda.memory_reserved(device), MEMORY_FRACTION * torch.cuda.get_device_properties(device).total_memory


def evict(device: torch.device, room: int = 0) -> List[Tuple]:
    """Drop kept programs by :func:`evictions` (``room``: programs about to be added) and give
    their memory back to ``device``; again while the device stays above the limit. The keys dropped."""
    dropped: List[Tuple] = []
    while True:
        reserved, limit = device_memory(device)
        keys = evictions(reserved, limit, [(k, p.reserved) for k, p in PROGRAMS.items()], MAX_PROGRAMS - room)
        if not keys:
            return dropped
        for key in keys:
            del PROGRAMS[key]
        dropped += keys
        release_memory(device)


def release_memory(device: torch.device) -> None:
    """Return the memory of dropped programs (their graphs' private pools) to ``device``."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def release(device: torch.device) -> None:
    """Drop every kept program and give its memory back to ``device``."""
    PROGRAMS.clear()
    release_memory(device)


# -- the loop's step, captured or not
class EagerSteps:
    """The eager batched loop's step: the optimiser's ``step`` with the run's closure, then
    the box's projection."""

    read_every = 1
    captured = False

    def __init__(self, run, variables: List[Tensor], optimizer, note: Optional[Reason]):
        self.run, self.variables, self.optimizer, self.note = run, variables, optimizer, note

    def step(self, iteration: int) -> Tensor:
        loss = self.optimizer.step(self.variables, self.run.closure, iteration)
        self.run.box.project_(self.variables[0])
        return loss

    def release(self) -> None:
        """Nothing to hand back: the run's tensors are the loop's."""

    def describe(self) -> Reason:
        """How the run's iterations ran: a reason (the report words it)."""
        return self.note


class CapturedSteps(EagerSteps):
    """Steps through a kept program: the run's state is copied in at the first step (and
    after each :meth:`release`) and back out by :meth:`release`. A failure before the first
    replay hands the state back and continues with the fallback route or the eager loop."""

    read_every = 16  # the progress callback's loss is read from the device this often

    def __init__(self, run, variables, optimizer, route: Route, note: Reason):
        super().__init__(run, variables, optimizer, note)
        self.events: List[Reason] = [note]  # why this route, then each failure and fallback
        self.route, self.program, self.eager = route, None, None
        self.replays, self.warm, self.built = 0, 0, []  # programs this run built
        self.reused = 0  # loads of a program an earlier run built
        self.done = 0  # iterations done on the current program since its load
        self.kept: Optional[Tuple[Program, List[Tensor]]] = None  # this run's program and inputs, once found

    def step(self, iteration: int) -> Tensor:
        if self.eager is not None:
            return self.eager.step(iteration)
        run = self.run
        try:
            if self.program is None:  # found once: the restart selection does not change the key
                if self.kept is None:
                    program, reused, inputs = program_for(run, self.variables, self.route)
                    self.built += [] if reused else [program]
                    self.reused += reused
                    self.kept = program, inputs
                self.program, inputs = self.kept
                self.program.load(run, self.variables, self.optimizer, inputs)
                self.done = 0
            loss = self.program(self.optimizer.lr_at(iteration), iteration)
        except GiaError:
            raise
        except Exception as err:  # breaks capture: the fallback route, else the eager loop
            return self._fall_back(err, iteration)
        replayed = self.program.replay is not None  # this call replayed (the capturing one included)
        self.replays += replayed
        self.warm += not replayed
        self.done += 1
        run.evaluations += 1
        run._count()
        return self.program.real(loss).clone()

    @property
    def captured(self) -> bool:
        return self.eager is None

    def _fall_back(self, err: Exception, iteration: int) -> Tensor:
        program, self.program, self.kept = self.program, None, None
        error = f"{type(err).__name__}: {str(err).strip()}"
        if program is not None:
            if self.done:  # the iterations done on it are the run's
                program.store(self.variables, self.optimizer)
                self._flush()
            key = next((k for k, p in PROGRAMS.items() if p is program), None)
            if key is not None:
                del PROGRAMS[key]
                FAILED[(key, self.route.name)] = error
        self.events.append(Reason("route-failed", route=self.route.name, error=error))
        if self.route.fallback is not None:
            self.route = ROUTES.get(self.route.fallback)
            self.events.append(Reason("route-instead", route=self.route.name))
            return self.step(iteration)
        self.eager = EagerSteps(self.run, self.variables, self.optimizer, None)
        return self.eager.step(iteration)

    def _flush(self) -> None:
        flush = getattr(self.optimizer, "flush_log", None)
        if flush is not None:
            flush()

    def release(self) -> None:
        """Copy the run's members back out of the program (before the restart selection and at
        the end); the next step copies them in again."""
        if self.program is not None:
            self.program.store(self.variables, self.optimizer)
            self._flush()
            self.program = None

    def describe(self) -> Reason:
        if self.eager is not None:
            return off(*self.events, replayed=self.replays)
        return Reason("captured", route=self.route.name, why=[e.to_dict() for e in self.events],
                      members=self.run.n * self.run.attack.restarts, padded=self.program_members(),
                      replays=self.replays, warm=self.warm, built=len(self.built), reused=self.reused,
                      setup_s=round(sum(p.setup_s for p in self.built), 2))

    def program_members(self) -> int:
        return padded_observations(self.run.n, self.route) * self.run.attack.restarts


def stepper(run, variables: List[Tensor], optimizer, iterations: int) -> EagerSteps:
    """The loop's step for ``run``: captured where :func:`decide` picks a route."""
    route, why = decide(run, iterations)
    if route is None:
        return EagerSteps(run, variables, optimizer, why)
    return CapturedSteps(run, variables, optimizer, route, why)
