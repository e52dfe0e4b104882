"""What identifies an audit's results: per-task seeds, the defense (its code, the values it
closes over and its output on a fixed probe), the data, the model, and the software versions."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import platform
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from audit.core import __version__
from audit.core.defense_call import defense_name, user_code


def derive_seed(seed: int, *parts: Any) -> int:
    """A stable per-task seed (same run settings -> same numbers, independent of order)."""
    blob = repr((int(seed),) + parts).encode()
    return int.from_bytes(hashlib.sha256(blob).digest()[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------- identities
# the behaviour probe: a fixed small model, batch and generator seed (see probe_fingerprint)
PROBE_SHAPE, PROBE_CLASSES, PROBE_BATCH, PROBE_SEED = (3, 8, 8), 4, 2, 0
PROBE_BITS = 20  # mantissa bits kept when the probe's output is hashed (about 6 significant digits)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DEPTH = 3  # how deep values inside values are followed


@contextlib.contextmanager
def torch_threads(count: int, device: Any = "cpu") -> Iterator[None]:
    """``count`` intra-op threads on the CPU within the block (restored after): float reductions
    depend on the thread count, so numbers that must not depend on the machine pin it."""
    if torch.device(device).type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sha(blob: Union[str, bytes]) -> str:
    return hashlib.sha256(blob.encode() if isinstance(blob, str) else blob).hexdigest()[:16]


def _code_names(code) -> List[str]:
    """The global names a code object (and the functions defined inside it) reads."""
    names = list(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names += _code_names(const)
    return names


def _function_values(fn: Any, depth: int) -> List[str]:
    """A function's closure cells, default and keyword-default values, and the module-level
    values it reads, each as a stable text."""
    cells = [c.cell_contents if _filled(c) else "<empty cell>" for c in (fn.__closure__ or ())]
    glob = fn.__globals__
    reads = sorted({n for n in _code_names(fn.__code__) if n in glob})
    return ([f"closure {_stable(v, depth)}" for v in cells]
            + [f"default {_stable(v, depth)}" for v in fn.__defaults__ or ()]
            + [f"kwdefault {k}={_stable(v, depth)}" for k, v in sorted((fn.__kwdefaults__ or {}).items())]
            + [f"global {n}={_stable(glob[n], depth, follow=False)}" for n in reads])


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _source_sha(obj: Any) -> str:
    try:
        return _sha(inspect.getsource(obj))
    except (OSError, TypeError):
        return "source unavailable"


def _stable(value: Any, depth: int = 0, follow: bool = True) -> str:
    """``value`` as a text that is the same in every process for the same content: tensors by
    digest, functions by source and values, objects by their attributes (``follow=False``:
    functions by name and source only)."""
    if value is None or isinstance(value, (bool, int, float, str, bytes, complex)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor {tensor_digest(value)}"
    if isinstance(value, torch.Generator):
        return f"generator {tensor_digest(value.get_state())}"
    if isinstance(value, nn.Module):
        return f"module {type(value).__qualname__} {model_identity(value, {})['state_sha256']}"
    if inspect.ismodule(value):
        return f"module {value.__name__}"
    if inspect.isclass(value):
        return f"class {value.__module__}:{value.__qualname__} {_source_sha(value)}"
    if depth >= _DEPTH:
        return type(value).__qualname__
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(_stable(v, depth + 1) for v in value)}]"
    if isinstance(value, (set, frozenset)):
        return f"set[{', '.join(sorted(_stable(v, depth + 1) for v in value))}]"
    if isinstance(value, dict):
        return f"dict[{', '.join(sorted(f'{_stable(k, depth + 1)}: {_stable(v, depth + 1)}' for k, v in value.items()))}]"
    if inspect.isfunction(value) or inspect.ismethod(value):
        fn = getattr(value, "__func__", value)
        head = f"function {fn.__module__}:{fn.__qualname__} {_source_sha(fn)}"
        return head if not follow else f"{head} ({'; '.join(_function_values(fn, depth + 1))})"
    if hasattr(value, "__dict__"):
        return f"{type(value).__qualname__}({_stable(vars(value), depth + 1)})"
    return _ADDRESS.sub("", repr(value))


def _built_in(defense: Any) -> bool:
    from defenses import DEFENSES

    return any(DEFENSES.get(n) is type(defense) for n in DEFENSES.names())


def _callable_identity(defense: Any) -> Dict[str, Any]:
    """What the defense's code is: its qualified name, the source of the function or class and
    of its whole module, and (user code) the values it closes over, its default arguments, the
    module-level values it reads, or a callable object's attributes."""
    target = getattr(defense, "fn", defense)
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        target = type(target)  # a callable object: its class holds the code
    module = inspect.getmodule(target)
    ident = {"callable": f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', '?')}",
             "source_sha256": _source_sha(target)}
    try:
        ident["module_sha256"] = _sha(Path(inspect.getsourcefile(module)).read_bytes())
    except (OSError, TypeError):
        ident["module_sha256"] = "module source unavailable"
    code = getattr(defense, "fn", defense)
    if inspect.isfunction(code) or inspect.ismethod(code):
        ident["values_sha256"] = _sha("\n".join(_function_values(getattr(code, "__func__", code), 0)))
    elif not _built_in(defense):  # a built-in's state is its params(); a user object's, its attributes
        ident["values_sha256"] = _sha(_stable(vars(code) if hasattr(code, "__dict__") else code))
    return ident


def _rounded_digest(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 (16 hex digits) of the tensors' shapes and values rounded to ``PROBE_BITS``
    mantissa bits, so a last-bit difference between machines does not change it."""
    digest = hashlib.sha256()
    for t in tensors:
        mantissa, exponent = torch.frexp(t.detach().cpu().double())
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(torch.round(mantissa * 2 ** PROBE_BITS).to(torch.int64).numpy().tobytes())
        digest.update(exponent.to(torch.int64).numpy().tobytes())
    return digest.hexdigest()[:16]


def _redraw(model: Any) -> Any:
    """``model``'s parameters drawn again in float64 from a seeded generator (uniform in
    +-1/sqrt(fan-in)), in place: torch's float32 initialisation (the probe network's, and the
    layers a defense such as PRECODE adds) differs in the last bit between CPUs' vectorised
    kernels, these draws do not."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    with torch.no_grad():
        for p in model.parameters() if isinstance(model, nn.Module) else ():
            bound = 1.0 / float(p[0].numel() if p.dim() > 1 else p.numel()) ** 0.5
            p.copy_((torch.rand(p.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound)
    return model


def probe_fingerprint(defense: Any, timeout: Optional[float] = None) -> str:
    """What the defense does: its output on a fixed probe (the planner's small network, a
    seeded batch of ``PROBE_BATCH`` random ``PROBE_SHAPE`` images, a seeded generator, round
    0, one CPU thread), hashed after rounding; a defense that fails the probe is fingerprinted
    by its failure (``"failed: ..."``), never a crash. Runs on a copy of the defense.

    The probe runs in float64, so that CPUs whose kernels sum in another order (the digest of
    a stored run must match on the next machine) differ far below the rounding. Where that
    cannot hold the defense is not probed, and its code and parameters key it alone: a defense
    that declares ``unstable_probe`` (it trains a network before it answers), and one that
    cannot run in float64 (its float32 output differs between CPUs' kernels within any
    rounding a hash could keep)."""
    from adaptive.planner.probe import exact_math, probe_network, random_batch
    from audit.core.defense_call import call_defense, defense_timeout, wrap_client_model

    name = defense_name(defense)
    unstable = getattr(defense, "unstable_probe", None)
    if unstable:
        return f"not probed: {unstable}; keyed by its code and parameters"

    def probe(dtype: torch.dtype) -> str:
        try:
            with user_code(name):
                probed = copy.deepcopy(defense)
        except Exception:  # an object that cannot be copied: probe it as is
            probed = defense
        with torch.random.fork_rng(devices=[]), torch_threads(1), exact_math(), defense_timeout(timeout):
            torch.manual_seed(PROBE_SEED)  # a defense drawing from the global generator
            try:
                net = probe_network(PROBE_SHAPE, PROBE_CLASSES, seed=PROBE_SEED).to(dtype)
                model = _redraw(wrap_client_model(probed, net, PROBE_SEED))
                x, y = random_batch(PROBE_BATCH, PROBE_SHAPE, PROBE_CLASSES, PROBE_SEED, "cpu", dtype)
                out = call_defense(probed, model, x, y, generator=torch.Generator().manual_seed(PROBE_SEED), round=0)
                return f"sha256:{_rounded_digest(out)}"
            except Exception as err:
                return f"failed: {type(err).__name__}: {_ADDRESS.sub('', str(err))[:300]}"

    exact = probe(torch.float64)
    if not exact.startswith("failed"):
        return exact
    single = probe(torch.float32)
    if single.startswith("failed"):
        return single
    return "not probed: it runs in float32 only, whose output differs between CPUs; keyed by its code and values"


def defense_identity(defense, spec: Any, timeout: Optional[float] = None) -> Dict[str, Any]:
    """What identifies the audited defense, so that another defense never reuses its results:
    name, parameters, its code (:func:`_callable_identity`) and its behaviour on a fixed probe
    (:func:`probe_fingerprint`; ``timeout``: seconds the probe's defense call may take)."""
    ident: Dict[str, Any] = {"name": getattr(defense, "name", "defense"),
                             "spec": spec if isinstance(spec, str) else type(spec).__name__}
    try:
        with user_code(ident["name"], "params"):
            ident["params"] = {k: repr(v) if not isinstance(v, (int, float, str, bool, type(None))) else v
                               for k, v in defense.params().items()}
    except Exception as err:  # a user's Defense subclass with a broken params()
        ident["params"] = {"unavailable": f"{type(err).__name__}: {err}"}
    ident["stochastic"] = bool(getattr(defense, "stochastic", False))
    ident.update(_callable_identity(defense))  # values are read before the probe calls the defense
    ident["probe"] = probe_fingerprint(defense, timeout)
    return ident


def tensor_digest(*tensors: torch.Tensor) -> str:
    """sha256 (16 hex digits) of the tensors' shapes, dtypes and values."""
    digest = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.numpy().tobytes())
    return digest.hexdigest()[:16]


def data_identity(dataset, data_args: Dict[str, Any], image_size: int) -> Dict[str, Any]:
    """What identifies the data: name, shape, size, the loader's arguments (a path made
    absolute; grid, limit, ...) and a digest of the images and labels themselves, so other
    private images never reuse stored results."""
    args = {k: str(Path(v).expanduser().resolve()) if k == "path" and v is not None else v
            for k, v in (data_args or {}).items()}
    return {"name": dataset.name, "input_shape": list(dataset.input_shape), "image_size": int(image_size),
            "args": args, "content_sha256": tensor_digest(dataset.train_images, dataset.train_labels,
                                                          dataset.test_images, dataset.test_labels)}


def model_identity(model: Any, model_args: Dict[str, Any]) -> Dict[str, Any]:
    if isinstance(model, str):
        return {"name": model, "args": model_args}
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().to(torch.float64 if tensor.is_floating_point() else torch.int64)
                      .contiguous().numpy().tobytes())
    return {"name": type(model).__name__, "architecture_sha256": _sha(repr(model)), "state_sha256": digest.hexdigest()[:16]}


def audited_model_identity(settings: Any, model: nn.Module) -> Dict[str, Any]:
    """What identifies the audited model as built: a registered model without a checkpoint by
    its architecture and its builder's module source (its weights follow from the run's seed,
    which the key holds: their bytes differ in the last bit between CPUs' vectorised kernels,
    and a stored run must resume on the next machine); any other model, or weights loaded from
    a checkpoint, by the weights themselves (:func:`model_identity`)."""
    from audit.core.model_source import source_kind
    from audit.core.models import MODELS

    if source_kind(settings.model) != "name" or settings.checkpoint is not None:
        return model_identity(model, {})
    builder = inspect.getmodule(MODELS.get(settings.model))
    return {"name": type(model).__name__, "architecture_sha256": _sha(repr(model)),
            "builder_sha256": _sha(Path(inspect.getsourcefile(builder)).read_bytes()), "weights": "drawn from the seed"}


def versions() -> Dict[str, str]:
    import numpy

    return {"gia_audit": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "platform": platform.platform()}

