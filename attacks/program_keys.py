"""What a captured program is keyed by, and which tensors it reads as inputs
(``attacks.capture``; docs/performance.md, "The capture rule").

A program bakes in every Python value its iteration reads (an Adam beta, a prior's weight, a
defense's pruning ratio, which layers a mask covers) and reads tensors at fixed addresses.
So :func:`program_key` summarises the run's objects by content -- every value that is not a
tensor in full, every tensor by shape, dtype and device -- and lists, in walk order, the
tensors it met (per-layer weights, masks, a prior's or a defense's tensors): a kept program
copies a run's list into its own, so one program serves any weights, masks and per-run
constants of the same shapes. Tensors are keyed by their strides too (a channels-last
convolution runs other kernels than a contiguous one), ``functools.partial`` objects by their
function and arguments, numpy arrays and scalars by content, and the key holds the process's
arithmetic settings a capture bakes in (:data:`SETTINGS`: TF32, cuDNN's flags). Objects no
summary reaches are keyed by identity and held by the key, so an identity is never reused
while its programs are kept.
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

#: the observation's fields a program may read (besides its model, defense and targets)
OBSERVATION_FIELDS = ("input_shape", "num_classes", "batch_size", "local_steps", "local_lr", "local_batch_size",
                      "client_mode", "labels_shared", "data_mean", "data_std", "loss_fn", "optimizer", "shares",
                      "extra")
#: entries of ``attack.describe()`` summarised from the objects themselves (their values may be inputs)
_DESCRIBED_BY_OBJECT = ("objective", "simulator")
#: a module's own containers, summarised by name and shape instead
_MODULE_CONTAINERS = ("_parameters", "_buffers", "_modules")
#: process-wide settings that choose the kernels a program runs (read when a key is made)
SETTINGS: Dict[str, Callable[[], Any]] = {
    "matmul allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "matmul fp16 reduced-precision reduction": lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    "matmul bf16 reduced-precision reduction": lambda: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    "float32 matmul precision": torch.get_float32_matmul_precision,
    "cudnn enabled": lambda: torch.backends.cudnn.enabled,
    "cudnn allow_tf32": lambda: torch.backends.cudnn.allow_tf32,
    "cudnn benchmark": lambda: torch.backends.cudnn.benchmark,
    "cudnn deterministic": lambda: torch.backends.cudnn.deterministic,
    "deterministic algorithms": torch.are_deterministic_algorithms_enabled,
}


def settings() -> Tuple[Tuple[str, Any], ...]:
    """The current value of every :data:`SETTINGS` entry."""
    return tuple((name, read()) for name, read in SETTINGS.items())


class Identity:
    """An object no content summary reaches: equal only to itself, and held, so its id cannot
    be reused by another object while a key holds it."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Identity) and other.value is self.value

    def __repr__(self) -> str:
        return f"Identity({type(self.value).__qualname__})"


def _digest(t: Tensor) -> str:
    data = t.detach().cpu().contiguous()
    return hashlib.sha1(data.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def summary(value: Any, inputs: Optional[List[Tensor]] = None, _open: frozenset = frozenset()) -> Any:
    """A hashable summary of ``value``'s content. Tensors: appended to ``inputs`` and summarised by
    shape, strides, dtype and device when ``inputs`` is a list, else by their bytes; numpy values
    by their bytes; ``functools.partial`` by function, arguments and keywords. Functions by module,
    name, code, defaults and closure (whose tensors are always summarised by their bytes: a
    function is shared, not copied, so its tensors cannot be a program's own); bound methods by
    function and object; modules by every submodule's type and attributes and every tensor's
    name and shape; other objects by type and attributes; sets in a fixed order."""
    if isinstance(value, Tensor):
        if inputs is None:
            return ("tensor", tuple(value.shape), value.stride(), str(value.dtype), _digest(value))
        inputs.append(value)
        return ("input", tuple(value.shape), value.stride(), str(value.dtype), value.device.type)
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return ("ndarray", value.shape, summary(value.tolist(), inputs, _open))
        return ("ndarray", value.shape, str(value.dtype), hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest())
    if isinstance(value, np.generic):
        return ("numpy", str(value.dtype), value.item())
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)):
        return value
    if isinstance(value, type):
        return ("class", value.__module__, value.__qualname__)
    if id(value) in _open:
        return ("cycle",)
    inner = _open | {id(value)}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(summary(v, inputs, inner) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), summary(v, inputs, inner)) for k, v in value.items()),
                                     key=lambda kv: kv[0])))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted((summary(v, inputs, inner) for v in value), key=repr)))
    if isinstance(value, torch.nn.Module):
        return _module(value, inputs, inner)
    if isinstance(value, types.FunctionType):
        code = value.__code__
        cells = tuple(c.cell_contents for c in value.__closure__ or ())
        return ("function", value.__module__, value.__qualname__, code.co_firstlineno,
                hashlib.sha1(code.co_code + repr(code.co_consts).encode()).hexdigest(),
                summary((value.__defaults__, value.__kwdefaults__, cells), None, inner))
    if isinstance(value, functools.partial):
        return ("partial", summary(value.func, inputs, inner), summary(value.args, inputs, inner),
                summary(value.keywords, inputs, inner))
    if isinstance(value, types.MethodType):
        return ("method", summary(value.__func__, inputs, inner), summary(value.__self__, inputs, inner))
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        owner = getattr(value, "__self__", None)
        bound = owner is not None and not isinstance(owner, types.ModuleType)
        return ("builtin", getattr(value, "__module__", None), value.__qualname__,
                summary(owner, inputs, inner) if bound else None)
    if isinstance(value, types.ModuleType):
        return ("python module", value.__name__)
    if hasattr(value, "__dict__") and not isinstance(value, torch.Generator):
        slots = {k: getattr(value, k) for k in getattr(type(value), "__slots__", ()) if hasattr(value, k)}
        return (type(value).__module__, type(value).__qualname__, summary({**vars(value), **slots}, inputs, inner))
    return Identity(value)


def _module(module: torch.nn.Module, inputs: Optional[List[Tensor]], _open: frozenset) -> Tuple:
    """Every submodule's type and attributes (hooks and flags included) and every parameter's
    and buffer's name, shape, strides, dtype and ``requires_grad``; tensors that are neither are summarised
    as any attribute is."""
    parts = []
    for name, sub in module.named_modules():
        own = {k: v for k, v in vars(sub).items() if k not in _MODULE_CONTAINERS}
        parts.append((name, type(sub).__module__, type(sub).__qualname__, summary(own, inputs, _open)))
    tensors = tuple((n, tuple(t.shape), t.stride(), str(t.dtype), t.requires_grad)
                    for n, t in itertools.chain(module.named_parameters(), module.named_buffers()))
    return ("module", tuple(parts), tensors)


def program_key(run, n_padded: int) -> Tuple[Tuple, List[Tensor]]:
    """The key of ``run``'s program over ``n_padded`` observations, and the run's tensors it reads
    as inputs (in the order a program built from a run of the same key lists its own). The
    model's weights, the targets and labels are loaded apart (``Program.load``) and keyed by shape
    and strides. The restarts are the attack's, not the run's current ones: after the restart
    selection the run's survivors fill the same program (``Program.load``)."""
    inputs: List[Tensor] = []
    described = {k: v for k, v in run.attack.describe().items() if k not in _DESCRIBED_BY_OBJECT}
    obs = run.obs
    key = (
        str(run.device), settings(), n_padded, run.attack.restarts, run.labels.shape, run.labels.fixed is None,
        summary(described),
        summary(run.objective, inputs), summary(run.priors, inputs), summary(run.simulator, inputs),
        summary(run.box, inputs), summary(run.attack.optimizer),
        summary(getattr(getattr(run, "side", None), "revealed", None), inputs),
        summary(obs.defense, inputs), summary(obs.model),
        tuple(summary(getattr(obs, f)) for f in OBSERVATION_FIELDS),
        tuple((tuple(t.shape), t.stride(), str(t.dtype)) for t in run.targets[0]),
    )
    return key, inputs
