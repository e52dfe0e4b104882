"""A captured program's key holds every setting its capture bakes in (attacks.program_keys):
arithmetic flags (TF32, cuDNN), the memory format of the model's weights, a ``functools.partial``'s
function and arguments, numpy values by content. A changed setting builds another program; the
same setting in other objects reuses the kept one."""
import contextlib
import functools

import numpy as np
import pytest
import torch

from attacks import ATTACKS, capture, observe
from attacks.program_keys import settings, summary
from audit.core.models import build_model
from audit.report.reasons import word

SHAPE = (3, 8, 8)
pytestmark = pytest.mark.usefixtures("one_thread")


def _scaled_ce(logits, labels, scale):
    return scale * torch.nn.functional.cross_entropy(logits, labels)


def _smoothed_ce(logits, labels, scale):
    return scale * torch.nn.functional.cross_entropy(logits, labels, label_smoothing=0.1)


def _group(memory_format=torch.contiguous_format, loss_fn=None, extra=None):
    """Two observations of a fresh cnn (the same weights each call), ``loss_fn`` a new partial object."""
    model = build_model("cnn", SHAPE, 4, seed=0).to(memory_format=memory_format)
    x = torch.rand(2, *SHAPE, generator=torch.Generator().manual_seed(3))
    loss_fn = loss_fn or functools.partial(_scaled_ce, scale=1.0)
    out = [observe(model, x[i:i + 1], torch.tensor([i]), seed=i, loss_fn=loss_fn) for i in range(2)]
    for o in out:
        o.extra.update(extra() if extra else {"weights": np.array([1.0, 2.0]), "scale": np.float32(0.5)})
    return out


@contextlib.contextmanager
def _flag(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


_CHANGES = {  # each: a context the changed run is in, and its observations
    "matmul tf32": (lambda: _flag(torch.backends.cuda.matmul, "allow_tf32",
                                  not torch.backends.cuda.matmul.allow_tf32), _group),
    "cudnn tf32": (lambda: _flag(torch.backends.cudnn, "allow_tf32", not torch.backends.cudnn.allow_tf32), _group),
    "cudnn benchmark": (lambda: _flag(torch.backends.cudnn, "benchmark", not torch.backends.cudnn.benchmark), _group),
    "cudnn deterministic": (lambda: _flag(torch.backends.cudnn, "deterministic",
                                          not torch.backends.cudnn.deterministic), _group),
    "channels-last weights": (contextlib.nullcontext, lambda: _group(memory_format=torch.channels_last)),
    "partial's arguments": (contextlib.nullcontext, lambda: _group(loss_fn=functools.partial(_scaled_ce, scale=2.0))),
    "partial's function": (contextlib.nullcontext, lambda: _group(loss_fn=functools.partial(_smoothed_ce, scale=1.0))),
    "numpy array's content": (contextlib.nullcontext,
                              lambda: _group(extra=lambda: {"weights": np.array([1.0, 3.0]), "scale": np.float32(0.5)})),
    "numpy scalar's value": (contextlib.nullcontext,
                             lambda: _group(extra=lambda: {"weights": np.array([1.0, 2.0]), "scale": np.float32(0.25)})),
}


def _run(obs):
    return ATTACKS.build("ig", capture="eager").reconstruct_many(obs, 4, [0, 1])


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_changed_setting_builds_its_own_program_and_the_same_one_reuses(change, fresh_programs):
    context, group = _CHANGES[change]
    _run(_group())
    _run(_group())  # equal settings in new objects (a new partial, new numpy arrays): the kept program
    assert (capture.STATS["built"], capture.STATS["reused"]) == (1, 1), change
    with context():
        changed = _run(group())
    assert capture.STATS["built"] == 2, f"{change} replayed the program built without it"
    assert "program built here" in word(changed[0].trace["capture"])


def test_the_settings_read_the_flags_as_they_are_now():
    with _flag(torch.backends.cudnn, "allow_tf32", False):
        off = dict(settings())
    with _flag(torch.backends.cudnn, "allow_tf32", True):
        on = dict(settings())
    assert (off["cudnn allow_tf32"], on["cudnn allow_tf32"]) == (False, True)


def test_summaries_of_partials_and_numpy_values_follow_their_content():
    part = functools.partial(_scaled_ce, scale=1.0)
    assert summary(part) == summary(functools.partial(_scaled_ce, scale=1.0))
    assert summary(part) != summary(functools.partial(_scaled_ce, scale=3.0))
    assert summary(part) != summary(functools.partial(_smoothed_ce, scale=1.0))
    assert summary(np.arange(4)) == summary(np.arange(4)) != summary(np.arange(1, 5))
    assert summary(np.arange(4)) != summary(np.arange(4).astype(np.float32))
    contiguous = torch.zeros(1, 3, 4, 4)
    assert summary(contiguous, []) != summary(contiguous.to(memory_format=torch.channels_last), [])
