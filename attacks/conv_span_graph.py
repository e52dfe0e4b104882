"""Conv-span's view of a model as a graph: where to cut it below its span convolutions.

The model is traced (``torch.fx``) and its nodes taken in execution order. A *cut* is a node after
which it is the only value computed from the image that later nodes still read: the whole rest of
the network sees the image through that one map. In a ResNet the cuts are the stem's maps and the
blocks' outputs (inside a block the shortcut keeps the block's input alive). The deep map of
:mod:`attacks.conv_span_maps` is the last cut before the first span convolution; the cuts below it
part the bottom into segments that :mod:`attacks.conv_span_rgap` solves from the top down.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, fx, nn


@dataclass
class GraphSplit:
    """The model cut at one map: ``bottom`` maps the image to it, ``top`` runs from it through the
    last span convolution, ``rest`` from it to the model's output; ``segments`` part ``bottom`` at
    every cut below (first from the image), ``maps`` names the cut nodes (the last is the deep map)."""

    bottom: fx.GraphModule
    top: fx.GraphModule
    rest: fx.GraphModule
    segments: List[fx.GraphModule] = field(default_factory=list)
    maps: List[str] = field(default_factory=list)

    def map_of(self, images: Tensor) -> Tensor:
        return self.bottom(images)


_GRAPHS: "weakref.WeakKeyDictionary[nn.Module, Optional[fx.Graph]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def graph_of(model: nn.Module) -> Optional[fx.Graph]:
    """The model's traced graph, kept per model object; None where its forward does not trace
    (data-dependent control flow). Tracing patches ``nn.Module.__call__`` for the whole process, so
    it must not run while another thread calls a module: trace before starting threads."""
    with _LOCK:
        if model not in _GRAPHS:
            try:
                _GRAPHS[model] = fx.symbolic_trace(model).graph
            except Exception:  # noqa: BLE001  (any tracing failure means: no graph to cut)
                _GRAPHS[model] = None
        return _GRAPHS[model]


def trace(model: nn.Module, like: Optional[nn.Module] = None) -> Optional[fx.GraphModule]:
    """The graph of ``like`` (a model of the same structure: the one traced; default ``model``) run
    on ``model``'s own modules (leaf modules kept as calls, so hooks on them still fire)."""
    graph = graph_of(model if like is None else like)
    if graph is None:
        return None
    copied = fx.Graph()
    copied.output(copied.graph_copy(graph, {}))
    return fx.GraphModule(model, copied)


def _depends(graph: fx.Graph) -> Dict[fx.Node, bool]:
    """Whether each node's value is computed from the input (constants and attributes are not)."""
    found: Dict[fx.Node, bool] = {}
    for node in graph.nodes:
        found[node] = node.op == "placeholder" or any(found.get(a, False) for a in node.all_input_nodes)
    return found


def cut_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    """The nodes, in execution order, after which they are the only input-dependent value still
    read by a later node (the placeholder first)."""
    nodes = list(gm.graph.nodes)
    depends = _depends(gm.graph)
    position = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((position[u] for u in n.users), default=position[n]) for n in nodes}
    found = []
    for i, node in enumerate(nodes):
        if not depends[node] or node.op == "output" or not node.users:
            continue
        live = [n for n in nodes[:i + 1] if depends[n] and last_use[n] > i]
        if live == [node]:
            found.append(node)
    return found


def _module_call(gm: fx.GraphModule, name: str) -> Optional[fx.Node]:
    return next((n for n in gm.graph.nodes if n.op == "call_module" and n.target == name), None)


def subgraph(gm: fx.GraphModule, start: Optional[fx.Node], end: fx.Node,
             also: Sequence[fx.Node] = ()) -> fx.GraphModule:
    """The graph from ``start``'s value (a new input; None: the model's own input) to ``end``'s (with
    ``also``'s values, earlier nodes, returned beside it as a tuple where given)."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    nodes = list(gm.graph.nodes)
    depends = _depends(gm.graph)
    begin = -1 if start is None else nodes.index(start)
    for i, node in enumerate(nodes[:nodes.index(end) + 1]):
        if node is start:
            env[node] = graph.placeholder("deep")
        elif i > begin or not depends[node]:
            env[node] = _out_of_place(gm, graph, node, graph.node_copy(node, lambda n: env[n]))
    graph.output(tuple(env[n] for n in (*also, end)) if also else env[end])
    out = fx.GraphModule(gm, graph)
    out.graph.eliminate_dead_code()
    out.recompile()
    return out


def _out_of_place(gm: fx.GraphModule, graph: fx.Graph, node: fx.Node, copied: fx.Node) -> fx.Node:
    """``copied`` with an in-place ReLU made out of place (a cut's map may be a leaf that requires grad)."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.ReLU) \
            and gm.get_submodule(node.target).inplace:
        with graph.inserting_after(copied):
            plain = graph.call_function(torch.relu, copied.args)
        copied.replace_all_uses_with(plain)
        graph.erase_node(copied)
        return plain
    if node.op == "call_function" and copied.kwargs.get("inplace"):
        copied.kwargs = {**copied.kwargs, "inplace": False}
    if node.op == "call_method" and isinstance(node.target, str) and node.target.endswith("_") \
            and node.target in ("relu_", "add_"):
        copied.target = node.target[:-1]
    return copied


def graph_split(model: nn.Module, layer_names: Sequence[str],
                like: Optional[nn.Module] = None) -> Optional[GraphSplit]:
    """The cut of ``model`` (traced as ``like``, a model of the same structure, where given) at its
    last cut map below every layer of ``layer_names`` (module names), or None where the model does
    not trace, a layer is not called in its graph, or the only cut below them is the image itself."""
    gm = trace(model, like)
    if gm is None or not layer_names:
        return None
    calls = [_module_call(gm, name) for name in layer_names]
    if any(c is None for c in calls):
        return None
    nodes = list(gm.graph.nodes)
    first = min(nodes.index(c) for c in calls)
    last = max(calls, key=nodes.index)
    below = [c for c in cut_nodes(gm) if nodes.index(c) < first]
    if len(below) < 2:  # the placeholder alone: nothing to cut
        return None
    deep = below[-1]
    output = next(n for n in nodes if n.op == "output")
    result = output.args[0]
    if not isinstance(result, fx.Node):
        return None
    segments = [subgraph(gm, a if a.op != "placeholder" else None, b) for a, b in zip(below, below[1:])]
    return GraphSplit(bottom=subgraph(gm, None, deep), top=subgraph(gm, deep, last, [c for c in calls if c is not last]), rest=subgraph(gm, deep, result),
                      segments=segments, maps=[n.name for n in below[1:]])


def run_segments(segments: Sequence[fx.GraphModule], images: Tensor) -> List[Tensor]:
    """The value at every cut for ``images`` (the image's own first), without gradients."""
    out = [images]
    with torch.no_grad():
        for seg in segments:
            out.append(seg(out[-1]))
    return out
