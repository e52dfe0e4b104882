"""Conv-span's deep-map stage: the cut of a sequential model, the map recovered from the span
alone, and the per-channel offsets train-mode BatchNorm hides from it."""
import torch
from torch import nn

from attacks.conv_span_algebra import row_spaces, span_layers, span_residual
from attacks.conv_span_maps import feature_mismatch, invert, map_residual, separate, split
from audit.core.data import load_dataset
from audit.core.evidence import aligned_psnr
from audit.core.models import build_model
from audit.core.types import trainable_names


def _setup(mode, seed=0):
    """ResNet-18 at width 32 on 16x16 images in float64: its upload's row spaces, the cut below
    stage 3 and the true 8x8x64 map there."""
    model = build_model("resnet18", (3, 16, 16), 10, width=32, seed=0).double().train(mode == "train")
    x = torch.rand(1, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    names = trainable_names(model)
    grads = torch.autograd.grad(nn.functional.cross_entropy(model(x), torch.tensor([3])),
                                [p for p in model.parameters() if p.requires_grad])
    by_module = {n.rsplit(".", 1)[0]: g for n, g in zip(names, grads) if n.endswith("weight")}
    layers, _ = span_layers(model, (3, 16, 16), 1)
    spaces, broken = row_spaces(by_module, layers, 1, centred=mode == "train")
    assert spaces and not broken
    cut = split(model, [s.layer.name for s in spaces])
    modules, maps = dict(model.named_modules()), {}
    for s in spaces:
        modules[s.layer.name].register_forward_hook(lambda m, i, o, n=s.layer.name: maps.__setitem__(n, i[0]))
    with torch.no_grad():
        truth = cut.map_of(x)
    return model, x, spaces, cut, map_residual(cut.top, spaces, modules, maps), truth


def test_split_cuts_below_the_first_span_child_and_refuses_what_it_cannot_cut():
    model = build_model("resnet18", (3, 16, 16), 10, width=32, seed=0)
    cut = split(model, ["8.conv1", "10.conv2"])
    assert len(cut.bottom) == 8 and len(cut.top) == 3  # children 0-7 below, 8-10 above
    x = torch.rand(2, 3, 16, 16)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(cut.top[-1](cut.top[:-1](cut.map_of(x))), model[:11](x))
    assert split(model, ["0"]) is None  # the first child: nothing below to cut

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x)
    assert split(Wrapped(), ["inner.8.conv1"]) is None


def test_the_deep_map_alone_comes_back_from_a_random_map_in_eval_mode():
    _model, _x, _spaces, _cut, residual, truth = _setup("eval")
    with torch.no_grad():
        assert float(residual(truth)) < 1e-20
    deep = torch.rand(truth.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    opt = torch.optim.LBFGS([deep], lr=1, max_iter=400, history_size=50, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-14, tolerance_change=1e-20)

    def closure():
        opt.zero_grad()
        value = residual(deep.abs())
        value.backward()
        return value
    opt.step(closure)
    found = deep.detach().abs().flatten()
    cosine = float(found @ truth.flatten() / found.norm() / truth.norm())
    assert cosine > 1 - 1e-6, cosine


def test_train_mode_hides_per_channel_offsets_on_the_stride_2_centre_taps_and_the_inversion_ignores_them():
    _model, x, _spaces, cut, residual, truth = _setup("train")
    offsets = torch.zeros_like(truth)
    offsets[..., 0::2, 0::2] = torch.randn(truth.shape[1], dtype=torch.float64)[None, :, None, None]
    assert float(residual(truth)) < 1e-20 and float(residual(truth + offsets)) < 1e-20  # the span cannot see them
    blind, plain = feature_mismatch(cut, truth + offsets, centred_stride=2), feature_mismatch(cut, truth + offsets)
    assert float(blind(x)) < 1e-20 and float(plain(x)) > 1e-3
    # offsets on the other taps are seen: the residual rises
    other = torch.zeros_like(truth)
    other[..., 1::2, 1::2] = torch.randn(truth.shape[1], dtype=torch.float64)[None, :, None, None]
    assert float(residual(truth + other)) > 1e-6


def test_the_inversion_in_the_pixels_box_recovers_an_image_an_unbounded_descent_stalls_on():
    # embedded test image 60 on the registered ResNet-18 (width 64), train-mode BatchNorm: from a start
    # around mid-grey, L-BFGS on the same mismatch without the box stalls at 0.45-0.5 (18 dB, what a
    # flat colour scores) after 300 to 3,000 evaluations, and Adam without the box at 0.37; in the box
    # it is exact
    data = load_dataset("embedded")
    model = build_model("resnet18", data.input_shape, data.num_classes, width=64, mean=data.mean, std=data.std,
                        seed=0).train()
    layers, _ = span_layers(model, data.input_shape, 1)
    cut = split(model, [layer.name for layer in layers])
    x = data.test_images[60:61]
    with torch.no_grad():
        target = cut.map_of(x)
    start = 0.5 + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    found, losses = invert(feature_mismatch(cut, target, centred_stride=2), start, 900)
    assert losses[-1] < 1e-3 and float(found.min()) >= 0 and float(found.max()) <= 1
    assert float(aligned_psnr(found, x)) > 40


def test_separate_parts_non_negative_mixtures_of_sparse_maps_into_the_maps():
    """Four ReLU-like maps (a quarter to a half of each zero), mixed by a positive matrix: every
    mixture is non-negative and meets any span the maps meet, and the sparsest directions of their
    space are the maps themselves."""
    g = torch.Generator().manual_seed(0)
    maps = torch.relu(torch.randn(4, 16, 8, 8, generator=g) + torch.linspace(0.0, 0.6, 4).view(4, 1, 1, 1))
    mixed = torch.einsum("ij,jchw->ichw", 0.2 + torch.rand(4, 4, generator=g), maps)
    before = nn.functional.normalize(mixed.flatten(1), dim=1) @ nn.functional.normalize(maps.flatten(1), dim=1).T
    parted = separate(mixed, torch.Generator().manual_seed(1))
    after = nn.functional.normalize(parted.flatten(1), dim=1) @ nn.functional.normalize(maps.flatten(1), dim=1).T
    assert float(before.max(1).values.max()) < 0.95  # each mixture is far from every map
    assert sorted(after.argmax(1).tolist()) == [0, 1, 2, 3]  # each map found once
    assert float(after.max(1).values.min()) > 0.999
    assert (parted >= 0).all() and torch.equal(separate(mixed[:1], g), mixed[:1])
