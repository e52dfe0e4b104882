"""The batched built-in defenses give what their straightforward references give
(tests/reference_defenses.py): the same outputs on the same generator (every rewritten
defense keeps its order of draws), the same input gradients, the same buffers; and
``Defense.many`` gives what the calls one after another give."""
import threading

import pytest
import torch
from torch import nn

import reference_defenses as ref
from attacks.simulator import ClientReplica, SimContext
from adaptive.through_defense import EOTSimulator
from audit.client.observe import observe
from audit.core.defense_call import call_defense_many, invoke_defense
from audit.core.models import build_model
from audit.core.types import FunctionDefense, clean_gradients
from defenses import DEFENSES, build_defense
from defenses.evaluator import train_evaluator
from defenses.streams import fill_normal

SHAPE = (3, 8, 8)


@pytest.fixture(scope="module")
def evaluator():
    return train_evaluator(torch.rand(32, *SHAPE, generator=torch.Generator().manual_seed(0)), width=4, epochs=1,
                           batch_size=16)


def model(name="mlp", mode="train", seed=0):
    extra = {"hidden": (24, 12)} if name == "mlp" else {}
    return build_model(name, SHAPE, 4, seed=seed, **extra).train(mode == "train")


def batch(n, seed=0):
    return torch.rand(n, *SHAPE, generator=torch.Generator().manual_seed(seed)), torch.arange(n) % 4


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rel(a, b):
    """Whole-gradient relative distance (tensors that are ~0, e.g. biases before BatchNorm,
    weigh by their size, not by their own norm)."""
    return float(torch.sqrt(sum(((u - v) ** 2).sum() for u, v in zip(a, b)))
                 / torch.sqrt(sum((v ** 2).sum() for v in b)))


def input_gradient(fn, x, params):
    """d/dx of a fixed random linear functional of the defended gradient (shaped like ``params``,
    broadcast over leading draw dimensions)."""
    w = [torch.randn(p.shape, generator=gen(9)) for p in params]
    dummy = x.clone().requires_grad_(True)
    out = fn(dummy)
    return torch.autograd.grad(sum((o * v).sum() for o, v in zip(out, w)), dummy)[0]


def buffers(m):
    return {k: v.clone() for k, v in m.state_dict().items()}


def same_buffers(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- CENSOR
@pytest.mark.parametrize("name,n,layerwise", [("mlp", 1, True), ("mlp", 3, True), ("mlp", 3, False),
                                              ("convnet", 2, True)])
def test_censor_matches_the_reference_draw_for_draw(name, n, layerwise):
    m, (x, y) = model(name), batch(n)
    defense = build_defense("censor", trials=6, layerwise=layerwise)
    for seed in range(3):
        before = buffers(m)
        shared = defense(m, x, y, generator=gen(seed))
        after = buffers(m)
        m.load_state_dict(before)
        expected = ref.censor(m, x, y, trials=6, layerwise=layerwise, generator=gen(seed))
        assert rel(shared, expected) < 1e-5
        assert same_buffers(after, buffers(m))
    if name == "mlp":  # the gradient through the chosen candidate's projection, draws held fixed
        got = input_gradient(lambda d: defense(m, d, y, generator=gen(4)), x, m.parameters())
        want = input_gradient(lambda d: ref.censor(m, d, y, trials=6, layerwise=layerwise, generator=gen(4)),
                              x, m.parameters())
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))


def test_censor_leaves_a_float64_models_parameters_alone():
    m, (x, y) = model().double(), batch(2)
    before = buffers(m)
    shared = build_defense("censor", trials=6)(m, x.double(), y, generator=gen(0))
    assert same_buffers(before, buffers(m))  # the float64 scoring buffers are copies, not the parameters
    m.load_state_dict(before)
    assert rel(shared, ref.censor(m, x.double(), y, trials=6, layerwise=True, generator=gen(0))) < 1e-9


def test_censor_scores_without_the_models_hooks_and_without_a_copy_when_it_cannot_copy():
    m, (x, y) = model("convnet"), batch(2)
    expected = ref.censor(m, x, y, trials=6, generator=gen(1))
    calls = []
    handle = m.register_forward_hook(lambda mod, inp, out: calls.append(1))
    shared = build_defense("censor", trials=6)(m, x, y, generator=gen(1))
    handle.remove()
    assert len(calls) == 2  # the clean gradient and the one per-example gradient, not the 6 candidates
    assert rel(shared, expected) < 1e-5
    m.lock = threading.Lock()  # deepcopy cannot copy it: the candidates are scored on the model itself
    assert rel(build_defense("censor", trials=6)(m, x, y, generator=gen(1)), expected) < 1e-5


def test_parallel_streams_give_the_same_numbers_on_any_number_of_threads():
    threads = torch.get_num_threads()
    try:
        out = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            buffers = [torch.empty(5, 7), torch.empty(5, 300)]
            fill_normal(buffers, gen(3))
            out.append(buffers)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for other in out[1:] for a, b in zip(out[0], other))
    fresh = [torch.empty(5, 7), torch.empty(5, 300)]
    fill_normal(fresh, gen(4))
    assert not torch.equal(fresh[1], out[0][1])


# --------------------------------------------------------------------------- Soteria
@pytest.mark.parametrize("name,mode", [("mlp", "train"), ("convnet", "train"), ("convnet", "eval")])
def test_soteria_matches_the_reference(name, mode):
    m, (x, y) = model(name, mode), batch(3)
    before = buffers(m)
    shared = build_defense("soteria", chunk=5)(m, x, y)
    after = buffers(m)
    m.load_state_dict(before)
    expected = ref.soteria(m, x, y)
    assert all(torch.equal(a, b) for a, b in zip(shared, expected))
    assert same_buffers(after, buffers(m))  # the mask's forward leaves BatchNorm's statistics alone


class CountingNet(nn.Module):
    """A forward that updates its own state in place (torch.func cannot run it)."""

    def __init__(self):
        super().__init__()
        self.body = model("mlp")
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.body(x)


def test_soteria_runs_a_model_torch_func_cannot():
    m, (x, y) = CountingNet(), batch(3)
    shared = build_defense("soteria")(m, x, y)
    expected = ref.soteria(m, x, y)
    assert all(torch.equal(a, b) for a, b in zip(shared, expected))


# --------------------------------------------------------------------------- SVDefense
@pytest.mark.parametrize("params", [{}, {"energy": 0.9}, {"weighting": "square"}])
@pytest.mark.parametrize("name,n", [("mlp", 3), ("convnet", 2), ("cnn", 1)])
def test_svdefense_matches_the_float32_svd_reference(name, n, params):
    m, (x, y) = model(name), batch(n)
    grads = clean_gradients(m, x, y)
    shared = build_defense("svdefense", **params).transform(grads)
    expected = ref.svdefense(grads, **params)
    assert rel(shared, expected) < 1e-4
    assert all(s is g for s, g in zip(shared, grads) if g.dim() < 2)


# --------------------------------------------------------------------------- Refiner
@pytest.mark.parametrize("name,mode,params", [("mlp", "train", {}), ("convnet", "train", {}),
                                              ("convnet", "eval", {"eps": 100.0}),
                                              ("mlp", "train", {"eps": 100.0, "lr": 50.0})])
def test_refiner_matches_the_reference(name, mode, params, evaluator):
    m, (x, y) = model(name, mode), batch(2)
    defense = build_defense("refiner", evaluator=evaluator, iota=3, **params)
    before = buffers(m)
    shared = defense(m, x, y, generator=gen(1))
    after = buffers(m)
    m.load_state_dict(before)
    expected = ref.refiner(m, x, y, evaluator, iota=3, generator=gen(1), **params)
    assert rel(shared, expected) < 1e-5
    # both: one forward on x* updates the statistics
    assert all(torch.allclose(after[k].float(), v.float(), atol=1e-6) for k, v in buffers(m).items())
    # input gradients (train-mode BatchNorm with running statistics cannot give them, in both);
    # through the unrolled steps (third derivatives) on the small model only
    for unroll in {"mlp": (False, True), "convnet": (False,) if mode == "eval" else ()}[name]:
        fast = build_defense("refiner", evaluator=evaluator, iota=3, unroll=unroll, **params)
        got = input_gradient(lambda d: fast(m, d, y, generator=gen(2)), x, m.parameters())
        want = input_gradient(lambda d: ref.refiner(m, d, y, evaluator, iota=3, unroll=unroll, generator=gen(2),
                                                    **params), x, m.parameters())
        assert float((got - want).norm() / want.norm()) < (1e-4 if params.get("lr", 1) <= 1 else 1e-2)


# --------------------------------------------------------------------------- DP-SGD
@pytest.mark.parametrize("params", [{}, {"per_layer": True}, {"clip": 1e-3, "noise_multiplier": 0.0}])
@pytest.mark.parametrize("name,mode", [("mlp", "train"), ("convnet", "train"), ("convnet", "eval")])
def test_dp_sgd_matches_the_reference(name, mode, params):
    m, (x, y) = model(name, mode), batch(3)
    before = buffers(m)
    shared = build_defense("dp-sgd", **params)(m, x, y, generator=gen(1))
    after = buffers(m)
    m.load_state_dict(before)
    expected = ref.dp_sgd(m, x, y, generator=gen(1), **params)
    assert rel(shared, expected) < 1e-5
    assert all(torch.allclose(after[k].float(), v.float()) for k, v in buffers(m).items())


# --------------------------------------------------------------------------- many
def _small(name, evaluator):
    return {"refiner": {"evaluator": evaluator, "iota": 2}, "censor": {"trials": 4},
            "precode": {"latent": 8}}.get(name, {})


@pytest.mark.parametrize("name", DEFENSES.names())
def test_many_gives_the_calls_one_after_another(name, evaluator):
    """Batch by batch, draw by draw from one generator, each call on the model as it was;
    the batched call leaves the buffers (BatchNorm in train mode here) unchanged."""
    defense = build_defense(name, **_small(name, evaluator))
    m = defense.wrap_model(model("convnet"))
    xs = torch.rand(2, 3, *SHAPE, generator=gen(1))
    ys = torch.tensor([[0, 1, 2], [3, 0, 1]])
    before = buffers(m)
    stacked = call_defense_many(defense, m, xs, ys, draws=2, generator=gen(5), round=0)
    assert same_buffers(before, buffers(m))
    g, calls = gen(5), []
    for i in range(2):
        for _ in range(2):
            m.load_state_dict(before)
            calls.append([t.detach() for t in invoke_defense(defense, m, xs[i], ys[i], generator=g, round=0)])
    expected = [torch.stack(column).view(2, 2, *column[0].shape) for column in zip(*calls)]
    assert rel(stacked, expected) < 1e-6


def test_a_plain_callable_answers_many_call_by_call_or_with_its_own():
    m, (x, y) = model(), batch(2)
    seen = []

    def noisy(model, inputs, labels, *, loss_fn, generator):
        seen.append(inputs.shape[0])
        return [g + torch.randn(g.shape, generator=generator) for g in clean_gradients(model, inputs, labels, loss_fn)]

    stacked = call_defense_many(noisy, m, x.unsqueeze(0), y.unsqueeze(0), draws=3, generator=gen(0))
    assert seen == [2, 2, 2] and stacked[0].shape == (1, 3, *list(m.parameters())[0].shape)

    def own_many(model, inputs, labels, *, draws, loss_fn, generator):
        return [torch.zeros(len(inputs), draws, *p.shape) for p in model.parameters()]

    noisy.many = own_many
    assert float(call_defense_many(FunctionDefense(noisy), m, x.unsqueeze(0), y.unsqueeze(0), draws=2)[0].abs().sum()) == 0


@pytest.mark.parametrize("name", ["censor", "refiner", "dp-sgd"])
def test_eot_draws_are_the_defense_calls_on_the_dummy(name, evaluator):
    """The EOT simulator's one batched call gives the draws of the per-draw calls."""
    m, (x, y) = model(), batch(1)
    defense = build_defense(name, **_small(name, evaluator))
    obs = observe(m, x, y, defense)
    replica = ClientReplica(obs)
    dummy = torch.rand(1, *SHAPE, generator=gen(3))
    stacked, _ = EOTSimulator(3).client_gradients(replica, dummy, y, functional=False,
                                                  context=SimContext(obs, generator=gen(4), capture_features=False))
    g = gen(4)
    calls = [invoke_defense(defense, replica.model, dummy, y, generator=g, round=obs.step) for _ in range(3)]
    assert rel(stacked, [torch.stack(column) for column in zip(*calls)]) < 1e-6

    def eot(d):  # the attack's gradient through the batched draws and through the calls
        ctx = SimContext(obs, generator=gen(4), capture_features=False)
        return EOTSimulator(3).client_gradients(replica, d, y, functional=False, context=ctx)[0]

    def by_calls(d):
        g = gen(4)
        draws = [invoke_defense(defense, replica.model, d, y, generator=g, round=obs.step) for _ in range(3)]
        return [torch.stack(column) for column in zip(*draws)]

    got = input_gradient(eot, dummy, [s[0] for s in stacked])
    want = input_gradient(by_calls, dummy, [s[0] for s in stacked])
    assert float((got - want).norm() / want.norm()) < 1e-4
