"""Conv-span on a model whose forward is not the order of its children: the span layers and the
cut below them are read off the traced graph, and the image comes back exact from the cut's map."""
import torch
from torch import nn

from attacks.conv_span_algebra import span_layers
from attacks.conv_span_graph import cut_nodes, graph_split, run_segments, trace
from attacks.conv_span_rgap import Recursion
from audit.core.evidence import aligned_psnr


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.down(x)
        return self.relu(out)


class Shuffled(nn.Module):
    """A small ResNet whose children are declared head first and stem last (torchvision style:
    the order of ``children()`` says nothing about the forward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(128, 10)
        self.deep = Block(64, 128, 2)
        self.middle = Block(16, 64, 2)
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())

    def forward(self, x):
        x = self.deep(self.middle(self.stem((x - 0.5) / 0.25)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _images(seed):
    g = torch.Generator().manual_seed(seed)
    return nn.functional.interpolate(torch.rand(1, 3, 4, 4, generator=g), size=(16, 16), mode="bilinear",
                                     align_corners=False)


def test_span_layers_and_the_cut_below_them_come_from_the_graph_not_the_children():
    model = Shuffled().eval()
    layers, why = span_layers(model, (3, 16, 16), 1)
    assert why is None and [l.name for l in layers][:2] == ["deep.conv1", "deep.conv2"]  # in forward order
    cut = graph_split(model, [l.name for l in layers])
    x = _images(0)
    with torch.no_grad():
        want = model.middle(model.stem((x - 0.5) / 0.25))  # the map entering the span block
        assert torch.allclose(cut.map_of(x), want) and torch.allclose(run_segments(cut.segments, x)[-1], want)
        assert torch.allclose(cut.rest(want), model(x))
    # inside a block the shortcut keeps its input alive: no cut there
    assert not any("middle_conv2" in n.name for n in cut_nodes(trace(model)))


def test_the_image_comes_back_exact_from_the_cut_map_through_a_non_sequential_model():
    # R-GAP's recursion from the map at the graph's cut (the middle block's output) down to the image
    model = Shuffled().double().eval()
    layers, _ = span_layers(model, (3, 16, 16), 1)
    cut = graph_split(model, [l.name for l in layers])
    x, y = _images(1).double(), torch.tensor([7])
    params = dict(model.named_parameters())
    upload = dict(zip(params, torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(params.values()))))
    deep = cut.map_of(x).detach().requires_grad_(True)
    signal = torch.autograd.grad(nn.functional.cross_entropy(cut.rest(deep), y), deep)[0]
    found = Recursion(cut.bottom, upload).run(deep.detach(), signal, torch.full_like(x, 0.5))
    assert float(aligned_psnr(found.float(), x.float())) > 40


def test_on_the_registered_sequential_models_the_graph_cuts_where_the_children_did():
    """The stored conv-span results on the registered models stay valid: the graph's deep map is the
    one the sequential split gave (same map, same values), at batch 1 and where the span holds at 4."""
    from attacks.conv_span_maps import split
    from audit.core.models import build_model

    for name, batch in (("resnet18", 1), ("resnet18", 4), ("convnet9", 1)):
        model = build_model(name, (3, 32, 32), 10).eval()
        layers, why = span_layers(model, (3, 32, 32), batch)
        assert why is None
        names = [l.name for l in layers]
        x = torch.rand(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            assert torch.equal(graph_split(model, names).map_of(x), split(model, names).map_of(x)), (name, batch)
