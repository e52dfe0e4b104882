"""Label inference from the last-layer gradient: exact at batch 1, counted at batch 4."""
import pytest
import torch
from torch import nn

from attacks import LABEL_METHODS, infer_labels, observe
from attacks.labels import allocate_counts, plan_labels
from audit.core.errors import ConfigError, NotApplicable
from audit.core.metrics import label_accuracy
from audit.core.models import build_model
from audit.report.reasons import word


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def data():
    from audit.core.data import load_dataset

    return load_dataset("embedded", size=16)


@pytest.mark.parametrize("name,kw", [("lenet", {}), ("convnet", {"width": 8}), ("mlp", {"hidden": (32,)})])
def test_idlg_is_exact_at_batch_1(data, name, kw):
    model = build_model(name, data.input_shape, data.num_classes, mean=data.mean, std=data.std, **kw)
    for index in range(0, len(data.train_labels), 48):  # one image of every class
        x, y = data.train_images[index:index + 1], data.train_labels[index:index + 1]
        inferred = infer_labels(observe(model, x, y))
        assert inferred.method == "idlg" and inferred.labels.tolist() == y.tolist()


def test_batch_counts_accuracy_is_reported_at_batch_4(data):
    model = build_model("lenet", data.input_shape, data.num_classes, mean=data.mean, std=data.std)
    gen = torch.Generator().manual_seed(0)
    accuracies = []
    for _ in range(5):
        rows = torch.randint(0, len(data.train_labels), (4,), generator=gen)
        y = data.train_labels[rows]
        inferred = infer_labels(observe(model, data.train_images[rows], y))
        assert inferred.method == "counts" and sum(inferred.counts) == 4
        accuracies.append(label_accuracy(inferred.labels, y))
    print(f"counts label accuracy at batch 4 (LeNet, 5 batches): {accuracies}")
    assert sum(accuracies) / len(accuracies) >= 0.9


def test_counts_without_a_bias_and_with_duplicates():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 6, bias=False))
    x = torch.rand(4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([5, 1, 5, 2])
    inferred = infer_labels(observe(model, x, y))
    assert "weight-row" in word(inferred.note)
    assert sorted(inferred.labels.tolist()) == sorted(y.tolist())


def test_fedavg_update_and_shared_labels(data):
    model = build_model("lenet", data.input_shape, data.num_classes, mean=data.mean, std=data.std)
    x, y = data.train_images[100:101], data.train_labels[100:101]
    assert infer_labels(observe(model, x, y, local_steps=4, local_lr=0.05)).labels.tolist() == y.tolist()
    shared = infer_labels(observe(model, data.train_images[:3], data.train_labels[:3], share_labels=True))
    assert shared.method == "shared" and shared.labels.tolist() == data.train_labels[:3].tolist()


def test_allocation_and_errors(data):
    counts = allocate_counts(torch.tensor([0.2, 2.6, 1.1, 0.1]), torch.tensor([True, True, False, False]), 4)
    assert counts.tolist() == [1, 2, 1, 0]
    model = build_model("lenet", data.input_shape, data.num_classes)
    obs = observe(model, data.train_images[:2], data.train_labels[:2])
    with pytest.raises(NotApplicable, match="idlg-one-image"):
        LABEL_METHODS.get("idlg")(obs)
    with pytest.raises(ConfigError, match="Valid label methods"):
        infer_labels(obs, method="majority")
    with pytest.raises(NotApplicable, match="labels-not-shared"):
        plan_labels("shared", obs)
