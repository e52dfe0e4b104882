"""The power bench's cells: every registered model at each batch size, in both client modes
where BatchNorm makes them differ; a kept cell is reused only under today's run key."""
from pathlib import Path

import torch

from audit.core.models import MODELS, build_model
from bench.bench_control import BATCHNORM, MODELS as BENCHED, call_of, cells, run_key, stored
from bench.jsonl import Lines


def test_the_bench_covers_every_registered_model_and_names_those_with_batchnorm():
    assert set(BENCHED) == set(MODELS.names())
    with_bn = {name for name in MODELS.names()
               if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                      for m in build_model(name, (3, 32, 32), 10, seed=0).modules())}
    assert with_bn == set(BATCHNORM)


def test_a_model_without_batchnorm_runs_in_one_mode():
    got = cells(["lenet", "resnet18"], [1, 4], ["train", "eval"])
    assert [(c["model"], c["batch"], c["mode"]) for c in got] == [
        ("lenet", 1, "train"), ("lenet", 4, "train"),
        ("resnet18", 1, "train"), ("resnet18", 1, "eval"), ("resnet18", 4, "train"), ("resnet18", 4, "eval")]


def test_a_kept_cell_is_reused_only_under_its_run_key(tmp_path: Path):
    def key(**cell):
        return run_key(call_of({"model": "cnn", "batch": 1, "mode": "train", **cell}, 4, 25600, 30.0, 0, "cpu",
                               tmp_path / "out"))

    one, four, other_mode = key(), key(batch=4), key(mode="eval")
    assert len({one, four, other_mode}) == 3
    assert key() == one  # the same inputs: the same key
    kept = Lines(tmp_path / "results.jsonl")
    kept.put("cnn", {"key": one, "recovered": 4})
    assert stored(kept, "cnn", one) == {"key": one, "recovered": 4}
    assert stored(kept, "cnn", four) is None  # changed inputs never reuse the kept result
    assert stored(kept, "lenet", one) is None
    kept.path.write_text('{"key": "cnn", "value": {"trunc')  # a cut write
    assert stored(kept, "cnn", one) is None
