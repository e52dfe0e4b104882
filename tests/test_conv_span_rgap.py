"""R-GAP's recursion below conv-span's deep map: a convolution's input from its weight gradient and
backward signal (a linear system), and the image from a ResNet's deep map down through its blocks."""
import torch
from torch import nn

from attacks.conv_span_algebra import span_layers
from attacks.conv_span_graph import graph_split
from attacks.conv_span_rgap import Recursion, conv_input_lstsq
from audit.core.evidence import aligned_psnr
from audit.core.models import build_model


def test_a_convolutions_input_comes_back_exactly_from_its_weight_gradient_and_backward_signal():
    # 3x3 stride-2 convolution, 16 output channels, 16 positions: 16 x 27 equations on 3 x 8 x 8 inputs
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 3, 2, 1, bias=False).double()
    x = torch.rand(1, 3, 8, 8, dtype=torch.float64)
    out = conv(x)
    delta = torch.randn_like(out)
    grad = torch.autograd.grad(out, conv.weight, delta)[0]
    found = conv_input_lstsq(conv, delta, grad, x.shape)
    assert float((found - x).norm() / x.norm()) < 1e-6
    # a known share of the output adds its equations: the same input
    mask = (torch.rand_like(out) > 0.5).double()
    both = conv_input_lstsq(conv, delta, grad, x.shape, known=out.detach(), mask=mask)
    assert float((both - x).norm() / x.norm()) < 1e-6


def test_the_image_comes_back_through_residual_blocks_from_the_deep_map_and_its_signal():
    size = 8  # every map below the deep one has more equations than unknowns (16 x 144 against 16 x 8 x 8)
    model = build_model("resnet18", (3, size, size), 10, width=16, mean=[0.5] * 3, std=[0.25] * 3,
                        seed=0).double().eval()
    layers, _ = span_layers(model, (3, size, size), 1)
    cut = graph_split(model, [l.name for l in layers])
    g = torch.Generator().manual_seed(3)
    x = nn.functional.interpolate(torch.rand(1, 3, 3, 3, generator=g, dtype=torch.float64), size=(size, size),
                                  mode="bilinear", align_corners=False)
    y = torch.tensor([5])
    params = dict(model.named_parameters())
    upload = dict(zip(params, torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(params.values()))))
    deep = cut.map_of(x).detach().requires_grad_(True)
    signal = torch.autograd.grad(nn.functional.cross_entropy(cut.rest(deep), y), deep)[0]
    recursion = Recursion(cut.bottom, upload)
    found = recursion.run(deep.detach(), signal, torch.full_like(x, 0.5))  # no mask is guessed: a flat start
    assert float(aligned_psnr(found.float(), x.float())) > 40
    assert all(s["equations"] >= s["unknowns"] for s in recursion.stages)
