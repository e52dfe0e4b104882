"""Federated training with defended updates, and the utility measurement."""
import copy
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from audit.core.errors import ConfigError, DataError
from audit.client.fl import client_splits, evaluate, train
from audit.core.models import build_model
from audit.core.types import clean_gradients, trainable_parameters
from audit.engine.utility import (PROTOCOL, SCHEDULES, Protocol, format_utility_table, measure_utility,
                                  utility_report)
from defenses import build_defense
from defenses.precode import bottlenecks

SHAPE = (3, 8, 8)


def synthetic(n_train=96, n_test=64, classes=4, seed=0):
    """A learnable Dataset-like object: each class is a colour / brightness pattern plus noise."""
    gen = torch.Generator().manual_seed(seed)
    protos = torch.rand(classes, *SHAPE, generator=gen)

    def split(n):
        labels = torch.arange(n) % classes
        noise = 0.15 * torch.randn(n, *SHAPE, generator=gen)
        return (protos[labels] + noise).clamp(0, 1), labels

    (xtr, ytr), (xte, yte) = split(n_train), split(n_test)
    return SimpleNamespace(name="synthetic", train_images=xtr, train_labels=ytr, test_images=xte, test_labels=yte,
                           input_shape=SHAPE, num_classes=classes, mean=(0.5,) * 3, std=(0.25,) * 3)


def mlp(seed=0):
    return build_model("mlp", SHAPE, 4, hidden=(32,), seed=seed)


def test_fedsgd_with_full_batches_is_gradient_descent():
    data = synthetic(n_train=24)
    model, reference = mlp(), mlp()
    history = train(model, data, None, 3, lr=0.1, batch_size=24, seed=0)
    for _ in range(3):
        grads = clean_gradients(reference, data.train_images, data.train_labels)
        with torch.no_grad():
            for p, g in zip(trainable_parameters(reference), grads):
                p -= 0.1 * g
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert len(history.losses) == 3 and history.losses[0] > history.losses[-1]


def test_the_schedule_scales_each_rounds_learning_rate():
    data = synthetic(n_train=24)
    factors = [1.0, 0.5, 0.0, 2.0]
    model, reference = mlp(), mlp()
    train(model, data, None, 4, lr=0.1, batch_size=24, seed=0, schedule=lambda k: factors[k])
    for factor in factors:  # full-batch gradient descent at lr 0.1 x the round's factor
        grads = clean_gradients(reference, data.train_images, data.train_labels)
        with torch.no_grad():
            for p, g in zip(trainable_parameters(reference), grads):
                p -= 0.1 * factor * g
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    # FedAvg: the factor scales the local steps; a zero factor leaves the model where it was
    frozen, start = mlp(), mlp()
    train(frozen, data, None, 2, lr=0.5, batch_size=6, clients=2, local_steps=3, seed=1, schedule=lambda k: 0.0)
    assert all(torch.equal(p, q) for p, q in zip(frozen.parameters(), start.parameters()))


def test_fedavg_averages_the_clients_local_training():
    data = synthetic(n_train=24)
    model, start = mlp(), mlp()
    train(model, data, None, 1, lr=1.0, batch_size=12, clients=2, local_steps=2, local_lr=0.2, seed=3)
    splits = client_splits(24, 2, torch.Generator().manual_seed(3))
    finals = []
    for split in splits:
        client = copy.deepcopy(start)
        for _ in range(2):
            grads = clean_gradients(client, data.train_images[split], data.train_labels[split])
            with torch.no_grad():
                for p, g in zip(client.parameters(), grads):
                    p -= 0.2 * g
        finals.append(list(client.parameters()))
    for i, p in enumerate(model.parameters()):
        assert torch.allclose(p, (finals[0][i] + finals[1][i]) / 2, atol=1e-6)


def test_server_optimizer_trains_as_torch_sgd_with_momentum_and_weight_decay():
    """One client, full batches, FedSGD: the server's SGD with momentum, Nesterov and weight
    decay, its state kept across rounds, is centralised training with ``torch.optim.SGD``."""
    data = synthetic(n_train=24)
    model, reference, plain = mlp(), mlp(), mlp()
    train(model, data, None, 4, lr=0.1, batch_size=24, seed=0,
          server_optimizer="sgd:momentum=0.9,nesterov=1,weight_decay=5e-4")
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    for _ in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(data.train_images), data.train_labels).backward()
        opt.step()
    train(plain, data, None, 4, lr=0.1, batch_size=24, seed=0)
    for p, q, r in zip(model.parameters(), reference.parameters(), plain.parameters()):
        assert torch.allclose(p, q, atol=1e-5)
    assert max(float((p - r).detach().abs().max()) for p, r in zip(model.parameters(), plain.parameters())) > 1e-3


def test_server_momentum_over_fedavg_rounds_steps_on_the_mean_delta():
    """FedAvg with a server momentum of 0.5: round 1 moves by the clients' mean delta d1
    (the buffer starts at it), round 2 by d2 + 0.5 d1 (FedAvgM)."""
    data = synthetic(n_train=24)
    fedavgm, start = mlp(), mlp()
    kwargs = dict(lr=0.3, batch_size=24, local_steps=2, seed=2)
    train(fedavgm, data, None, 2, server_optimizer="sgd:momentum=0.5", **kwargs)

    def local(model):  # two full-batch local steps of plain SGD at lr 0.3
        client = copy.deepcopy(model)
        for _ in range(2):
            grads = clean_gradients(client, data.train_images, data.train_labels)
            with torch.no_grad():
                for p, g in zip(client.parameters(), grads):
                    p -= 0.3 * g
        return client

    first = local(start)
    d1 = [p - q for p, q in zip(start.parameters(), first.parameters())]
    second = local(first)
    expected = [p - (q - r) - 0.5 * d for p, q, r, d in zip(first.parameters(), first.parameters(),
                                                             second.parameters(), d1)]
    for p, e in zip(fedavgm.parameters(), expected):
        assert torch.allclose(p, e, atol=1e-5)


def test_client_splits_are_disjoint_and_cover_the_data():
    splits = client_splits(10, 3, torch.Generator().manual_seed(0))
    assert sorted(torch.cat(splits).tolist()) == list(range(10)) and [len(s) for s in splits] == [4, 3, 3]
    with pytest.raises(ConfigError, match=r"clients must be in \[1, 10\]"):
        client_splits(10, 11, torch.Generator())


def test_training_learns_is_seeded_and_calls_back():
    data = synthetic()
    seen = []
    history = train(mlp(), data, build_defense("gaussian"), 40, lr=0.2, batch_size=8, clients=2, seed=1,
                    callback=lambda step, model: seen.append(step))
    assert seen == list(range(41))
    assert evaluate(history.model, data.test_images, data.test_labels) >= 0.9
    again = train(mlp(), data, build_defense("gaussian"), 40, lr=0.2, batch_size=8, clients=2, seed=1)
    other = train(mlp(), data, build_defense("gaussian"), 40, lr=0.2, batch_size=8, clients=2, seed=2)
    assert again.losses == history.losses and other.losses != history.losses


def test_precode_wrapped_model_trains():
    data = synthetic()
    precode = build_defense("precode", latent=16)
    model = precode.wrap_model(mlp())  # the caller wraps once; train never wraps
    history = train(model, data, precode, 60, lr=0.2, batch_size=8, seed=0)
    assert history.model is model and len(bottlenecks(model)) == 1
    assert sum(history.losses[-10:]) < 0.5 * sum(history.losses[:10])
    assert evaluate(model, data.test_images, data.test_labels) >= 0.9


def test_evaluate_counts_correct_predictions():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        model[1].weight.copy_(torch.eye(2))
    images = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]).view(4, 2, 1, 1)
    assert evaluate(model, images, torch.tensor([0, 1, 1, 1])) == 0.75
    assert model.training


def test_bad_training_arguments():
    with pytest.raises(DataError, match="load_dataset"):
        train(mlp(), object(), None, 1, lr=0.1, batch_size=4)
    with pytest.raises(ConfigError, match="lr > 0"):
        train(mlp(), synthetic(), None, 1, lr=-0.1, batch_size=4)
    with pytest.raises(ConfigError, match="resolve it first"):  # the client takes resolved defenses only
        train(mlp(), synthetic(), "prune", 1, lr=0.1, batch_size=4)


def test_utility_measures_the_defense_against_the_undefended_run_over_seeds():
    data = synthetic()
    small = dict(model_args={"hidden": (32,)}, lr=0.2, batch_size=8)
    result = measure_utility("prune", "mlp", data, 30, defense_params={"ratio": 0.5}, **small)
    assert result.defense == "prune" and result.params["ratio"] == 0.5
    seeds = [run.seed for run in result.defended.runs]
    assert len(set(seeds)) == 3 and seeds == [run.seed for run in result.undefended.runs]  # paired seeds
    assert result.undefended.min >= 0.9
    assert result.relative == pytest.approx(result.defended.mean / result.undefended.mean)
    # clipping every update to a negligible norm stops training: each seed's untrained accuracy
    destroyed = measure_utility("clip", "mlp", data, 30, defense_params={"bound": 1e-6}, seeds=2, **small)
    untrained = [evaluate(build_model("mlp", SHAPE, 4, mean=data.mean, std=data.std, seed=run.seed, hidden=(32,)),
                          data.test_images, data.test_labels) for run in destroyed.defended.runs]
    assert destroyed.defended.accuracies == untrained and destroyed.defended.std > 0  # seeds differ
    assert destroyed.defended.max <= destroyed.undefended.min - 0.4
    table = format_utility_table([result, destroyed])
    assert "prune" in table and "bound=1e-06" in table and "(3 training seeds)" in table


def test_the_utility_recipe_is_recorded_and_keys_the_stored_utility():
    from dataclasses import replace

    from audit.engine.audit import UTILITY_FORMAT

    base = Protocol(100, 0.05, 16, "cosine")
    variants = [base, replace(base, lr=0.1), replace(base, batch_size=8), replace(base, schedule="constant"),
                replace(base, clients=2), replace(base, local_steps=2)]
    assert len({p.recipe_key() for p in variants}) == len(variants)  # any change measures the utility again
    assert replace(base, rounds=5).recipe_key() == base.recipe_key()  # the rounds are the audit's utility_steps
    assert PROTOCOL.recipe_key() in UTILITY_FORMAT
    assert [SCHEDULES["cosine"](k, 4) for k in range(4)] == pytest.approx([1.0, 0.8536, 0.5, 0.1464], abs=1e-4)
    with pytest.raises(ConfigError, match="unknown learning-rate schedule"):
        Protocol(10, 0.1, 8, "linear")
    result = measure_utility("none", "mlp", synthetic(), 2, model_args={"hidden": (8,)}, seeds=1)
    assert {k: result.setting[k] for k in ("lr", "schedule", "batch_size", "clients", "local_steps")} == {
        "lr": PROTOCOL.lr, "schedule": PROTOCOL.schedule, "batch_size": PROTOCOL.batch_size,
        "clients": PROTOCOL.clients, "local_steps": PROTOCOL.local_steps}


def test_a_diverging_run_is_scored_on_the_model_it_left():
    data = synthetic()
    small = dict(model_args={"hidden": (32,)}, lr=0.2, batch_size=8, seeds=2)

    def nan_from_round_2(model, inputs, labels, *, loss_fn, generator, round):
        grads = clean_gradients(model, inputs, labels, loss_fn)
        return [g * float("nan") for g in grads] if round >= 2 else grads

    nan = measure_utility(nan_from_round_2, "mlp", data, 10, **small)
    assert [r.diverged_at for r in nan.defended.runs] == [2, 2] and "update was not finite" in nan.defended.runs[0].note
    two_rounds = measure_utility("none", "mlp", data, 2, **small)  # what training left: the model after round 1
    assert nan.defended.accuracies == two_rounds.defended.accuracies

    def overflow(model, inputs, labels, *, loss_fn, generator):  # finite, but lr x update overflows float32
        return [torch.full_like(p, 3e38) for p in trainable_parameters(model)]

    blown = measure_utility(overflow, "mlp", data, 10, **{**small, "lr": 2.0})
    # the parameters are infinite after round 0: every output is non-finite, a constant guess of 1/4
    assert [r.diverged_at for r in blown.defended.runs] == [0, 0] and "parameters" in blown.defended.runs[0].note
    assert blown.defended.accuracies == [0.25, 0.25] and "constant guess" in blown.defended.runs[0].note
    assert blown.relative == pytest.approx(0.25 / blown.undefended.mean)

    def broken(model, inputs, labels, *, loss_fn, generator):
        raise RuntimeError("boom")

    failed = measure_utility(broken, "mlp", data, 3, **small)
    assert failed.defended.mean is None and "boom" in failed.defended.error and failed.relative is None
    table = format_utility_table([nan, blown, failed])
    assert "diverged at round 2 of 10" in table and "training failed" in table
    with pytest.raises(ConfigError, match="single --defense"):
        utility_report(["prune", "clip"], ["ratio=0.5"], dataset=data)
    with pytest.raises(ConfigError, match="utility seeds must be a positive integer"):
        measure_utility("none", "mlp", data, 1, seeds=0)


def test_utility_cli_prints_the_table():
    from cli import main

    runner = CliRunner()
    result = runner.invoke(main, ["utility", "--defense", "clip", "--defense-arg", "bound=0.5", "--model", "mlp",
                                  "--model-arg", "hidden=16", "--size", "8", "--utility-steps", "3",
                                  "--utility-batch-size", "4", "--utility-schedule", "constant"])
    assert result.exit_code == 0, result.output
    assert "clip" in result.output and "bound=0.5" in result.output and "undefended" in result.output
    assert f"lr {PROTOCOL.lr} (constant), batch 4" in result.output  # given options over the recipe's
    bad = runner.invoke(main, ["utility", "--defense", "prune", "--defense-arg", "ratio=1.5", "--utility-steps", "1"])
    assert bad.exit_code == 2 and "ratio must be in [0, 1)" in bad.output


def test_audit_cli_names_a_bad_server_optimizer_before_work(tmp_path):
    from cli import main

    out = tmp_path / "run"
    bad = CliRunner().invoke(main, ["audit", "--defense", "none", "--server-optimizer", "sgd:momentum=1.5",
                                    "--out", str(out)])
    assert bad.exit_code == 2 and "momentum must be in [0, 1)" in bad.output
    assert len(bad.output.strip().splitlines()) == 1 and not out.exists()
