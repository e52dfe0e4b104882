"""R-GAP's recursion below conv-span's deep map: each lower map solved from the one above it.

Once a map and the backward signal at it are known, every convolution below has a weight gradient
``dW = sum_p delta_p (outer) patch_p(X)`` that is linear in its input ``X`` as soon as its output's
signal ``delta`` is known (:func:`conv_input_lstsq`: ``F.unfold``, least squares by conjugate
gradients on the normal operator, float64). :class:`Recursion` walks the traced bottom of the model
(:mod:`attacks.conv_span_graph`) from the deep map down, node by node: a ReLU passes its output's
positive entries and mask down, an eval-mode BatchNorm and the input normalisation are inverted, a
residual sum gives one term once the other is computed forward, a max-pool routes its values to
where the current estimate has its maxima; each map read by convolutions is solved from their
weight gradients, their outputs where known, and its own entries where known. Each solve counts its
equations against its unknowns; a map short of them, or whose equations disagree (the masks read
off the estimate are wrong), stops the recursion, and :func:`descend` inverts the image to the
lowest map found whole instead.
"""
from __future__ import annotations

import math
import operator
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torch.func import vjp

from attacks.conv_span_graph import subgraph

def cg(normal: Callable[[Tensor], Tensor], rhs: Tensor, iterations: int, tol: float = 1e-24) -> Tensor:
    """Conjugate gradients on ``normal(v) = rhs`` (``normal`` symmetric positive semi-definite) from zero."""
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rr = float((r * r).sum())
    stop = tol * rr
    for _ in range(iterations):
        if rr <= stop or rr == 0:
            break
        q = normal(p)
        alpha = rr / float((p * q).sum())
        x, r = x + alpha * p, r - alpha * q
        new = float((r * r).sum())
        p, rr = r + (new / rr) * p, new
    return x


def conv_input_lstsq(conv: nn.Conv2d, delta: Tensor, grad: Tensor, shape: Sequence[int],
                     known: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                     iterations: int = 500) -> Tensor:
    """The input map ``X`` of ``shape`` for which ``sum_p delta_p (outer) patch_p(X)`` is ``grad``
    (the convolution's weight gradient for its output's backward signal ``delta``), and, where
    ``mask`` is set, ``conv(X)`` (no bias) is ``known``: least squares in float64 by conjugate
    gradients on the normal operator. ``delta`` is ``(B, Cout, H', W')``; groups must be 1."""
    d = delta.double().flatten(2)  # (B, Cout, N)
    parts = [(_weight_gradient(conv, d), grad.double().reshape(grad.shape[0], -1))]
    if mask is not None:
        parts.append((_masked_conv(conv, mask), known.double() * mask))
    zero = torch.zeros(tuple(shape), dtype=torch.float64, device=delta.device)
    return lstsq(parts, zero, iterations)[0]


def _weight_gradient(conv: nn.Conv2d, delta: Tensor) -> Callable[[Tensor], Tensor]:
    """``X -> sum_p delta_p (outer) patch_p(X)``, ``delta`` ``(B, Cout, N)``: the weight gradient, linear in X."""
    def grad(x: Tensor) -> Tensor:
        cols = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)  # (B, D, N)
        return torch.einsum("bcn,bdn->cd", delta, cols)
    return grad


def _masked_conv(conv: nn.Conv2d, mask: Tensor) -> Callable[[Tensor], Tensor]:
    weight = conv.weight.detach().double()
    return lambda x: F.conv2d(x, weight, None, conv.stride, conv.padding, conv.dilation) * mask


class Unsupported(Exception):
    """Where the recursion stops: the node's name and why (``operation``: one it cannot pass;
    ``short``: a map with fewer equations than unknowns; ``disagree``: its equations do not fit)."""

    def __init__(self, node: str, why: str):
        super().__init__(f"{node}: {why}")
        self.node, self.why = node, why


def lstsq(parts: List[Tuple[Callable[[Tensor], Tensor], Tensor]], start: Tensor,
          iterations: int) -> Tuple[Tensor, float]:
    """The ``x`` nearest ``start`` (where the parts leave it free) minimising ``sum ||f(x) - b||^2 /
    ||b||^2`` over linear ``f`` and targets ``b``; and the relative residual."""
    scales = [b.norm().clamp_min(1e-300) for _, b in parts]

    def operator(x: Tensor) -> Tensor:
        return torch.cat([(f(x) / w).flatten() for (f, _), w in zip(parts, scales)])
    target = torch.cat([(b / w).flatten() for (_, b), w in zip(parts, scales)])
    _, adjoint = vjp(operator, start)
    gap = target - operator(start)
    found = start + cg(lambda v: adjoint(operator(v))[0], adjoint(gap)[0], iterations)
    residual = float((operator(found) - target).norm() / target.norm().clamp_min(1e-300))
    return found.detach(), residual


#: conjugate-gradient iterations of one map's least squares
LSTSQ_ITERATIONS = 200
_ADD = {operator.add, torch.add}
#: a map's least squares is taken as right below this relative residual (from the exact deep map: 1e-12;
#: from the span's float32 map, 1e-5 to 5e-3; with a max-pool's choices wrong, 0.1-0.2)
ACCEPT = 2e-2
#: the deep map's entries below this share of its largest are a ReLU's zeros. An exact map needs no more;
#: the span's descent leaves its zeros at 1e-6 to 1e-4, and snapping there also zeroes true entries (a
#: wrong mask entry passes a whole backward-signal entry): both break the first solve (residual ~4e-3)
SNAP_DEEP = 1e-9
#: a solved ReLU output's entries below this share of its largest are its zeros
SNAP = 1e-7


def _bn_affine(bn: nn.BatchNorm2d, like: Tensor) -> Tuple[Tensor, Tensor]:
    """An eval-mode BatchNorm as ``a * x + b`` per channel, shaped to broadcast over ``like``."""
    a = (bn.weight if bn.affine else torch.ones_like(bn.running_var)) / (bn.running_var + bn.eps).sqrt()
    b = (bn.bias if bn.affine else torch.zeros_like(a)) - bn.running_mean * a
    shape = (1, -1) + (1,) * (like.dim() - 2)
    return a.detach().to(like).view(shape), b.detach().to(like).view(shape)


class Recursion:
    """R-GAP's recursion over a traced bottom (:class:`~attacks.conv_span_graph.GraphSplit`), from its
    output map and the backward signal there down to its input. ``upload``: the uploaded gradients by
    parameter name; ``estimate``: an input whose forward values give the masks no known map fixes
    (a max-pool's choices); ``stages`` collects, per map solved, its equations and unknowns."""

    def __init__(self, bottom: fx.GraphModule, upload: Dict[str, Tensor], iterations: int = LSTSQ_ITERATIONS):
        self.gm, self.upload, self.iterations = bottom, upload, iterations
        self.nodes = [n for n in bottom.graph.nodes if n.op != "output"]
        self.depends = {}
        for n in self.nodes:
            self.depends[n] = n.op == "placeholder" or any(self.depends.get(a, False) for a in n.all_input_nodes)
        self.params = dict(bottom.named_parameters())
        self.stages: List[Dict] = []

    # -- values
    def _run_node(self, node: fx.Node, env: Dict[fx.Node, Tensor]) -> Tensor:
        args = fx.node.map_arg(node.args, lambda a: env[a])
        kwargs = fx.node.map_arg(node.kwargs, lambda a: env[a])
        if node.op == "get_attr":
            value = self.gm
            for part in node.target.split("."):
                value = getattr(value, part)
            return value
        if node.op == "call_module":
            return self.gm.get_submodule(node.target)(*args, **kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        raise Unsupported(node.name, "operation")

    def forward_values(self, x: Tensor) -> Dict[fx.Node, Tensor]:
        env: Dict[fx.Node, Tensor] = {}
        with torch.no_grad():
            for n in self.nodes:
                env[n] = x if n.op == "placeholder" else self._run_node(n, env)
        return env

    def _merge(self, node: fx.Node, value: Tensor, mask: Tensor) -> None:
        if node not in self.value:
            self.value[node], self.known[node] = torch.where(mask, value, self.estimate[node]), mask.clone()
        else:
            self.value[node] = torch.where(mask & ~self.known[node], value, self.value[node])
            self.known[node] = self.known[node] | mask

    def _full(self, node: fx.Node) -> bool:
        return not self.depends[node] or (node in self.known and bool(self.known[node].all()))

    def _fill(self) -> None:
        """Every value computable from full ones: forward where all inputs are full, and a sum's other
        term where one is."""
        changed = True
        while changed:
            changed = False
            for n in self.nodes:
                if not self.depends[n] or self._full(n):
                    continue
                inputs = [a for a in n.all_input_nodes if self.depends[a]]
                if inputs and all(self._full(a) for a in inputs):
                    env = {a: self.value[a] if self.depends[a] else self.estimate[a] for a in n.all_input_nodes}
                    with torch.no_grad():
                        self._merge(n, self._run_node(n, env), torch.ones_like(self.estimate[n], dtype=torch.bool))
                    changed = True
            for n in self.nodes:
                if n.op == "call_function" and n.target in _ADD and n in self.known and len(n.args) == 2:
                    u, v = n.args
                    for a, b in ((u, v), (v, u)):
                        if isinstance(a, fx.Node) and isinstance(b, fx.Node) and self.depends[a] \
                                and self._full(b) and not self._full(a):
                            before = int(self.known.get(a, torch.zeros(1, dtype=torch.bool)).sum())
                            other = self.value[b] if self.depends[b] else self.estimate[b]
                            self._merge(a, self.value[n] - other, self.known[n])
                            changed |= int(self.known[a].sum()) > before

    # -- the pass
    def run(self, out: Tensor, g_out: Tensor, estimate: Tensor) -> Tensor:
        """The input whose bottom gives ``out`` and whose parameters' gradients for ``g_out`` there are
        the uploaded ones (masks the maps leave open read off ``estimate``'s forward values). Raises
        :class:`Unsupported` at a node it cannot pass or a map short of equations."""
        self.estimate = self.forward_values(estimate.double())
        self.value, self.known, self.grad = {}, {}, {}
        self.parts: Dict[fx.Node, List] = {}
        self.guessed = False
        last = self.nodes[-1]
        out = out.double()
        if self._non_negative(last):
            out = torch.where(out > SNAP_DEEP * out.abs().max(), out, torch.zeros_like(out))
        self._merge(last, out, torch.ones_like(out, dtype=torch.bool))
        self.grad[last] = g_out.double()
        for node in reversed(self.nodes):
            if not self.depends[node]:
                continue
            if self.parts.get(node):
                self._solve(node)
                self._fill()
            if node.op == "placeholder":
                if not self._full(node):
                    raise Unsupported(node.name, "short")
                return self.value[node]
            self._pass(node)
        raise Unsupported("input", "operation")

    def _is_relu(self, node: fx.Node) -> bool:
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        return isinstance(module, nn.ReLU) or (node.op == "call_function" and node.target in (torch.relu, F.relu)) \
            or (node.op == "call_method" and node.target == "relu")

    def _non_negative(self, node: fx.Node) -> bool:
        """Whether the node leaves a ReLU (through max-pools)."""
        if self._is_relu(node):
            return True
        if node.op == "call_module" and isinstance(self.gm.get_submodule(node.target), nn.MaxPool2d):
            return self._non_negative(node.args[0])
        return False

    def _add_grad(self, node: fx.Node, g: Tensor) -> None:
        self.grad[node] = self.grad[node] + g if node in self.grad else g

    def _solve(self, node: fx.Node) -> None:
        parts = list(self.parts[node])
        mask = self.known.get(node)
        if mask is not None and bool(mask.any()):
            m = mask.double()
            parts.append((lambda x, m=m: x * m, self.value[node] * m, 0))
        count = sum(int(c) for _, _, c in self.parts[node]) + (int(mask.sum()) if mask is not None else 0)
        start = self.value.get(node, self.estimate[node])
        unknowns = start.numel()
        stage = {"map": node.name, "shape": list(start.shape[1:]), "equations": count, "unknowns": unknowns}
        self.stages.append(stage)
        if count < unknowns:
            stage["short"] = True
            raise Unsupported(node.name, "short")
        found, residual = lstsq([(f, b) for f, b, _ in parts], start, self.iterations)
        if self._non_negative(node):
            # a ReLU's output: what the solve leaves at rounding level is its zeros
            found = torch.where(found > max(SNAP, 100 * residual) * found.abs().max(), found, torch.zeros_like(found))
        stage["residual"] = residual
        if residual > ACCEPT:  # the masks read off the estimate do not fit: the equations disagree
            raise Unsupported(node.name, "disagree")
        self._merge(node, found, torch.ones_like(found, dtype=torch.bool))
        self.known[node][:] = True
        self.value[node] = found

    def _pass(self, node: fx.Node) -> None:
        """The node's input(s): their known values and backward signals, and the equations the node
        gives on them."""
        g = self.grad.get(node, torch.zeros_like(self.estimate[node]))
        value, known = self.value.get(node), self.known.get(node)
        inputs = [a for a in node.all_input_nodes if self.depends[a]]
        module = self.gm.get_submodule(node.target) if node.op == "call_module" else None
        relu = self._is_relu(node)
        if not inputs:
            return
        src = inputs[0]
        if relu:
            positive = torch.where(known, value > 0, self.estimate[node] > 0) if known is not None \
                else self.estimate[node] > 0
            self._add_grad(src, g * positive)
            if known is not None:
                self._merge(src, value, known & (value > 0))
        elif isinstance(module, nn.BatchNorm2d) and not module.training:
            a, b = _bn_affine(module, g)
            self._add_grad(src, g * a)
            if known is not None:
                self._merge(src, (value - b) / a, known)
        elif isinstance(module, nn.Conv2d) and module.groups == 1:
            weight = module.weight.detach().double()
            conv = lambda x: F.conv2d(x, weight, None, module.stride, module.padding, module.dilation)  # noqa: E731
            self._add_grad(src, vjp(conv, self.estimate[src])[1](g)[0])
            equations = self.parts.setdefault(src, [])
            name = f"{node.target}.weight"
            if name in self.upload:
                positions = g[0, 0].numel() * len(g)
                equations.append((_weight_gradient(module, g.flatten(2)), self.upload[name].double().reshape(
                    weight.shape[0], -1), min(module.out_channels, positions) * weight[0].numel()))
            if known is not None and bool(known.any()):
                bias = 0 if module.bias is None else module.bias.detach().double().view(1, -1, 1, 1)
                m = known.double()
                equations.append((lambda x, m=m: conv(x) * m, (value - bias) * m, int(known.sum())))
        elif isinstance(module, nn.MaxPool2d):
            def pool(x):
                return F.max_pool2d(x, module.kernel_size, module.stride, module.padding, module.dilation,
                                    module.ceil_mode)
            _, pull = vjp(pool, self.estimate[src])
            self.guessed = True  # the maxima's positions are the estimate's
            self._add_grad(src, pull(g)[0])
            if known is not None:
                count = pull(known.double())[0]  # known windows whose maximum sits at each position
                self._merge(src, pull(value * known)[0] / count.clamp_min(1), count > 0)
        elif node.op == "call_function" and node.target in _ADD and len(inputs) == 2:
            for a in inputs:
                self._add_grad(a, g)
        elif node.op == "call_function" and node.target in (operator.sub, operator.truediv, operator.mul, *_ADD) \
                and node.args[0] is src and not (isinstance(node.args[1], fx.Node) and self.depends[node.args[1]]):
            c = self.estimate[node.args[1]] if isinstance(node.args[1], fx.Node) else node.args[1]
            inverse = {operator.sub: lambda y: y + c, operator.truediv: lambda y: y * c,
                       operator.mul: lambda y: y / c}.get(node.target, lambda y: y - c)
            slope = {operator.truediv: 1 / c, operator.mul: c}.get(node.target, 1)
            self._add_grad(src, g * slope)
            if known is not None:
                self._merge(src, inverse(value), known)
        else:
            raise Unsupported(node.name, "operation")


def scaled_signal(rest: nn.Module, deep: Tensor, labels: Tensor, loss_fn: Callable, upload: Dict[str, Tensor],
                  guess: float = 1.0) -> Tuple[Tensor, Tensor, float]:
    """The deep map at the scale whose gradients above it reproduce the upload best (the span fixes
    its direction only), the backward signal there, and the relative error of those gradients: a
    log-spaced scan about ``guess``, then golden-section search."""
    named = [(n, p) for n, p in rest.named_parameters() if n in upload]
    ref = math.sqrt(sum(float(upload[n].double().pow(2).sum()) for n, _ in named)) or 1.0

    def error(log_scale: float) -> float:
        grads = torch.autograd.grad(loss_fn(rest(deep * math.exp(log_scale)), labels), [p for _, p in named])
        return math.sqrt(sum(float((g - upload[n]).pow(2).sum()) for g, (n, _) in zip(grads, named))) / ref
    grid = [math.log(guess) + k / 4 for k in range(-16, 17)]
    best = min(range(len(grid)), key=lambda k: error(grid[k]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if error(a) < error(b):
            hi = b
        else:
            lo = a
    scaled = (deep * math.exp((lo + hi) / 2)).detach().requires_grad_(True)
    signal = torch.autograd.grad(loss_fn(rest(scaled), labels), scaled)[0]
    return scaled.detach(), signal.detach(), error((lo + hi) / 2)


def descend(bottom: fx.GraphModule, upload: Dict[str, Tensor], deep: Tensor, signal: Tensor, estimate: Tensor,
            invert: Callable[[Callable, Tensor], Tensor], rounds: int = 2) -> Tuple[Tensor, Dict]:
    """The image under ``deep`` (its backward signal ``signal``) by the recursion; where it stops (a node
    it cannot pass, a map short of equations or whose masks the estimate gets wrong), the image is
    inverted (``invert(mismatch, start)``) to the lowest map the recursion found whole, and the
    recursion runs again from that image, ``rounds`` times in all. Returns the image and a trace."""
    recursion = Recursion(bottom, upload)
    trace: Dict = {"rounds": []}
    image = estimate.double()
    for _ in range(rounds):
        try:
            image = recursion.run(deep, signal, image).clamp(0, 1)
            trace["rounds"].append({"solved": True})
            break
        except Unsupported as stop:
            trace["rounds"].append({"stopped_at": stop.node, "why": stop.why})
            if not any(s.get("residual", math.inf) <= ACCEPT for s in recursion.stages):
                break  # nothing solved below the deep map: the estimate stands
            whole = [n for n in recursion.nodes if recursion.depends[n] and n in recursion.known
                     and bool(recursion.known[n].all())]
            lowest = whole[0] if whole else recursion.nodes[-1]
            target = recursion.value.get(lowest, deep)
            below = _subgraph_to(bottom, lowest)

            def mismatch(images: Tensor, below=below, target=target) -> Tensor:
                return (below(images.to(target)) - target).pow(2).sum() / target.pow(2).sum()
            image = invert(mismatch, image).double()
            trace["rounds"][-1]["inverted_to"] = lowest.name
            if not recursion.guessed:  # the masks were the maps' own: another round finds the same
                break
    trace["stages"] = recursion.stages
    return image, trace


def _subgraph_to(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule:
    return subgraph(gm, None, node)
