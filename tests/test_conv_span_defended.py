"""The span read through a defense: a pruned conv gradient completed by its rank, a truncated one
still contained in the patches' span, a noisy one's top singular subspace, and the structure test
that tells an upload without the low-rank structure (CENSOR's) from an undefended one."""
import pytest
import torch

from attacks.conv_span_algebra import patches, span_layers
from adaptive.span_through import AGREEMENT_LIMIT
from attacks.conv_span_defended import (STRUCTURE_THRESHOLD, complete_span, containment_residual, denoised_basis,
                                        layer_gradients, principal_sines, structure_test, transmitted_basis)
from audit.core.models import build_model
from audit.core.types import trainable_names
from defenses import DEFENSES


@pytest.fixture(scope="module")
def upload():
    """The registered ResNet-18 (32x32, eval mode) and the exact gradient of one image, with the
    input map of every span layer."""
    torch.manual_seed(0)
    model = build_model("resnet18", num_classes=10, input_shape=(3, 32, 32)).double().eval()
    x, y = torch.rand(1, 3, 32, 32, dtype=torch.float64), torch.tensor([3])
    layers, _ = span_layers(model, (3, 32, 32), 1)
    modules = dict(model.named_modules())
    maps = {}
    hooks = [modules[l.name].register_forward_hook(lambda m, i, o, n=l.name: maps.update({n: i[0].detach()}))
             for l in layers]
    grads = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), list(model.parameters()))
    for h in hooks:
        h.remove()
    return model, x, y, layers, maps, [g.detach() for g in grads]


def _defended(name, model, x, y, **params):
    defense = DEFENSES.build(name, **params)
    out = defense(model, x, y, loss_fn=torch.nn.functional.cross_entropy, generator=torch.Generator().manual_seed(0))
    return layer_gradients(model, [g.detach() for g in out], trainable_names(model))


def test_a_magnitude_pruned_conv_gradient_is_completed_by_its_rank(upload):
    model, x, y, layers, maps, grads = upload
    pruned = _defended("prune", model, x, y, ratio=0.9)
    layer = max(layers, key=lambda l: l.out_channels)  # a stage-4 convolution: 16 positions, 512 channels
    conv = dict(model.named_modules())[layer.name]
    done = complete_span(pruned[layer.name], layer.positions)
    truth = patches(conv, maps[layer.name])[:, done.columns]
    # where patch coordinates keep enough entries, the row space is the patches' span exactly
    # (856 of its 2,304 patch coordinates keep 32 entries or more: 16 x 856 equations on its input map)
    assert len(done.columns) > conv.weight[0].numel() / 4 and done.completion.misfit < 1e-6
    assert float(principal_sines(done.basis, truth)[0]) < 1e-4
    # the pruned upload itself has lost the span: its top singular directions are far from it
    top = torch.linalg.svd(pruned[layer.name].reshape(layer.out_channels, -1), full_matrices=False)[2][:layer.positions]
    assert float(principal_sines(top[:, done.columns], truth)[0]) > 0.1
    assert done.agreement < AGREEMENT_LIMIT  # a completion from a random start finds the same row space


def test_a_completion_the_kept_entries_cannot_determine_is_told_by_a_second_start():
    # a rank-8 64 x 64 matrix has 960 degrees of freedom: its largest 20% (819 entries) cannot determine
    # it, its largest 60% (2,458) can
    g = torch.Generator().manual_seed(0)
    full = torch.randn(64, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 64, generator=g, dtype=torch.float64)
    def pruned(keep):
        cut = full.abs().flatten().kthvalue(int(round((1 - keep) * full.numel()))).values
        return full * (full.abs() > cut)
    assert complete_span(pruned(0.6), 8, need=8).agreement < 1e-6
    assert complete_span(pruned(0.2), 8, need=8).agreement > 0.1


def test_an_svd_truncated_upload_stays_inside_the_true_maps_patch_span(upload):
    model, x, y, layers, maps, grads = upload
    truncated = _defended("svdefense", model, x, y)
    layer = max(layers, key=lambda l: l.out_channels)
    conv = dict(model.named_modules())[layer.name]
    basis = transmitted_basis(truncated[layer.name])
    assert 0 < len(basis) < layer.positions  # fewer directions than the span: the plain span test fails
    assert float(containment_residual(basis, conv, maps[layer.name])) < 1e-12
    other = maps[layer.name].roll(1, dims=-1)  # another map of the same statistics is not
    assert float(containment_residual(basis, conv, other)) > 1e-2


def test_the_structure_test_tells_a_censor_upload_from_an_undefended_one(upload):
    model, x, y, layers, maps, grads = upload
    exact = layer_gradients(model, grads, trainable_names(model))
    assert structure_test(exact, layers, 1, centred=False).present
    censored = structure_test(_defended("censor", model, x, y, trials=2), layers, 1, centred=False)
    assert not censored.present and censored.weakest[1] < STRUCTURE_THRESHOLD / 2

    layer = max(layers, key=lambda l: l.out_channels)  # noise at a hundredth of the spread of the entries
    clean = exact[layer.name]
    noisy = clean + 0.01 * clean.std() * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0),
                                                    dtype=clean.dtype)
    basis, ratio = denoised_basis(noisy, layer.positions)
    truth = patches(dict(model.named_modules())[layer.name], maps[layer.name])
    assert float(principal_sines(basis, truth)[0]) < 0.2 and ratio < 0.5
