"""One JSON converter: records, tensors and numpy values become plain JSON, a non-finite float its
string, and what the store writes reads back as the same values."""
import json
import math
from pathlib import Path

import numpy as np
import torch

from audit.core.jsonable import from_jsonable, to_jsonable
from audit.core.metrics import MetricValue
from audit.core.reasons import Reason
from audit.core.records import AttackResult
from audit.report.store import ResultStore, atomic_write_json, read_json


def test_records_tensors_and_numpy_values_become_plain_json():
    value = {"m": MetricValue.of([1.0, 2.0]), "why": Reason("text", text="no"), "t": torch.tensor([1.5]),
             "a": np.array([[1, 2]]), "f": np.float32(0.5), "b": np.bool_(True), "s": {3}, "p": Path("x/y"),
             "k": (1, -math.inf), 2: float("nan")}
    assert to_jsonable(value) == {"m": {"value": 1.5, "per_image": [1.0, 2.0]},
                                  "why": {"code": "text", "params": {"text": "no"}}, "t": [1.5], "a": [[1, 2]],
                                  "f": 0.5, "b": True, "s": [3], "p": "x/y", "k": [1, "-inf"], "2": "nan"}
    json.dumps(to_jsonable(value), allow_nan=False)  # strict JSON


def test_what_the_store_writes_reads_back_with_its_non_finite_floats(tmp_path):
    path = tmp_path / "x.json"
    atomic_write_json(path, {"epsilon": math.inf, "low": -math.inf, "name": "ig", "per": [1.0, math.inf]})
    assert read_json(path) == {"epsilon": math.inf, "low": -math.inf, "name": "ig", "per": [1.0, math.inf]}
    assert math.isnan(from_jsonable(to_jsonable(math.nan)))


def test_a_result_stored_with_an_infinite_setting_or_certificate_is_reused_as_it_was(tmp_path):
    store = ResultStore.create(tmp_path, {"a": 1})
    result = AttackResult(step=0, attack_id="spear", image=0, settings={"clip": math.inf}, metrics={"psnr": 20.0},
                          trace={"certificate_error": math.inf})
    store.save_result(result)
    assert store.has(0, "spear", 0, settings={"clip": math.inf})
    assert not store.has(0, "spear", 0, settings={"clip": 1.0})
    assert store.records()[0].trace.certificate_error == math.inf
