"""Throughput of the grouped optimisation attack beside its floor: one IG iteration per image
for N images of one model, as the floor computes it and as the audit runs it.

For each model (the project's ``cnn`` and CIFAR ``resnet18``, 32x32) and each N, in one table:

* the floor: the same loss (cosine gradient distance + TV, Adam on the pixels, the [0, 1]
  clamp) as one plain ``vmap`` program over the N problems, and that program with its Adam
  step and clamp captured in a CUDA graph and replayed ("n/a (no CUDA)" on a CPU);
* the audit: IG on N observations as one grouped run (``reconstruct_many``) of k iterations,
  with the eager batched loop (``capture='off'``) and with the whole iteration captured
  (``--route``), timed from its iteration k/4 (at least 4: after the warm-up) to its last;
* on CUDA, ms per image per iteration (wall time) and the captured run's one-off cost (its
  first run less a later one); on a CPU, ratios of process CPU time to the plain vmapped
  floor of the same row.

Also, in the same process: R restarts batched against the same R restarts one after another
(``--restarts``), and with ``--precision-check`` on cuda IG's PSNR with TF32 and channels-last
beside float32; ``--ops``: kernels per iteration instead (``op_counts.py``);
``--gpu-turn`` (cuda only): what a lent GPU should measure, resumable (``gpu_turn.py``)::

    python -m bench.bench_throughput --device cpu --threads 2 --members 1,8 --iterations 4
    python -m bench.bench_throughput --ops --threads 1 --docs ops
    python -m bench.bench_throughput --device cuda --gpu-turn

Times are the best of ``--repeats`` interleaved runs (see bench_attack.best_of).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time

# idle OpenMP threads sleep instead of spinning, so a CPU run's process time counts its work
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
from torch.func import functional_call, grad, replace_all_batch_norm_modules_, vmap  # noqa: E402

from attacks import ATTACKS, observe  # noqa: E402
from audit.core.data import load_dataset  # noqa: E402
from audit.core.metrics import psnr  # noqa: E402
from audit.core.models import build_model  # noqa: E402
from bench import gpu_turn  # noqa: E402
from bench import op_counts  # noqa: E402
from bench.bench_attack import _sync, best_of  # noqa: E402
from bench.docs_table import ROOT, add_docs_option, publish  # noqa: E402

TV = 5e-2  # IG's total-variation weight, in the floor's loss too


def clock(device: torch.device) -> float:
    """Wall seconds on CUDA (after synchronising); this process's CPU seconds on a CPU (its
    OpenMP threads passive), which the other processes of a shared machine do not inflate as
    they do wall time."""
    _sync(device)
    return time.perf_counter() if device.type == "cuda" else time.process_time()


def observations(model, images, labels, mode: str):
    """One observation per image, all sharing the first one's model copy (as the audit's do
    in content; sharing the object keeps 256 ResNet-18 observations in memory)."""
    first = observe(model, images[:1], labels[:1], client_mode=mode)
    out = [first]
    for i in range(1, images.shape[0]):
        o = observe(model, images[i:i + 1], labels[i:i + 1], client_mode=mode, seed=i)
        out.append(dataclasses.replace(o, model=first.model))
    return out


def floor_step(model, mode: str, images, labels):
    """One floor iteration on N independent one-image problems, in place on its pixels: the
    vmapped gradient of cosine distance + TV, then ``torch.optim.Adam`` and the clamp."""
    net = copy.deepcopy(model).train(mode == "train")
    if mode == "train":
        replace_all_batch_norm_modules_(net)
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = dict(net.named_buffers())

    def loss_of(p, x, y):
        return torch.nn.functional.cross_entropy(functional_call(net, (p, buffers), (x[None],)), y[None])

    targets = vmap(grad(loss_of), in_dims=(None, 0, 0))(params, images, labels)

    def match(x, y, t):
        g = grad(loss_of)(params, x, y)
        dot = sum((g[k] * t[k]).sum() for k in g)
        norms = sum((g[k] ** 2).sum() for k in g).sqrt() * sum((t[k] ** 2).sum() for k in t).sqrt()
        tv = (x[:, 1:, :] - x[:, :-1, :]).abs().mean() + (x[:, :, 1:] - x[:, :, :-1]).abs().mean()
        return 1 - dot / (norms + 1e-12) + TV * tv

    gradients = vmap(grad(match))
    x = torch.rand_like(images).requires_grad_(True)
    x.grad = torch.zeros_like(x)
    adam = torch.optim.Adam([x], lr=0.1, capturable=images.device.type == "cuda")

    def step() -> None:
        x.grad.copy_(gradients(x.detach(), labels, targets))
        adam.step()
        with torch.no_grad():
            x.clamp_(0, 1)

    return step


def replayed(step):
    """``step`` captured in a CUDA graph after three warm-up calls on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    def replay() -> None:
        graph.replay()

    replay.captured = step  # the graph reads step's tensors by address: they must live as long as it
    return replay


def loop_block(step, iterations: int, device):
    """Seconds per call of ``step``, over ``iterations`` calls."""
    def block() -> float:
        start = clock(device)
        for _ in range(iterations):
            step()
        return (clock(device) - start) / iterations

    return block


def grouped_block(obs, iterations: int, device, restarts: int = 1, runs: int = 1):
    """Seconds per run of IG on every observation at once (``runs`` runs in a row)."""
    attack = ATTACKS.build("ig", restarts=restarts)

    def block() -> float:
        start = clock(device)
        for _ in range(runs):
            attack.reconstruct_many(obs, iterations * restarts, list(range(len(obs))),
                                    max_members=len(obs) * restarts)
        return clock(device) - start

    return block


class IterationTimer:
    """Seconds per iteration of one grouped IG run of ``k`` iterations, from its iteration
    ``max(4, k // 4)`` to its last (by :func:`clock`); ``runs`` keeps each whole run's
    seconds (the first one pays the one-off costs)."""

    def __init__(self, obs, k: int, device, **settings):
        self.attack, self.obs, self.k, self.device = ATTACKS.build("ig", **settings), obs, k, device
        self.runs = []

    def __call__(self) -> float:
        first, marks = max(4, self.k // 4), {}

        def progress(done, total, loss):
            if done in (first, self.k):
                marks[done] = clock(self.device)

        start = clock(self.device)
        self.attack.reconstruct_many(self.obs, self.k, list(range(len(self.obs))), progress=progress,
                                     max_members=len(self.obs))
        self.runs.append(clock(self.device) - start)
        return (marks[self.k] - marks[first]) / (self.k - first)


def precision_check(data, device, iterations: int, images: int) -> dict:
    """IG's mean PSNR on natural test images in float32, with TF32, and channels-last."""
    model = build_model("convnet", data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                        seed=0).to(device)
    x, y = data.test_images[:images].to(device), data.test_labels[:images].to(device)
    out = {}
    for name in ("float32", "tf32", "channels_last"):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = name == "tf32"
        net = model.to(memory_format=torch.channels_last) if name == "channels_last" else model
        obs = observations(net, x, y, "train")
        start = time.perf_counter()
        recs = ATTACKS.build("ig").reconstruct_many(obs, iterations, list(range(images)), max_members=images)
        _sync(device)
        out[name] = (sum(float(psnr(r.inputs, x[i:i + 1])) for i, r in enumerate(recs)) / images,
                     time.perf_counter() - start)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return out


def measure(model, pool, labels, args, device, n: int) -> dict:
    """ms per image per iteration of each column for N = ``n`` images (None: not measurable)."""
    k, route = args.iterations, args.route
    obs = observations(model, pool[:n], labels[:n], args.client_mode)
    step = floor_step(model, args.client_mode, pool[:n], labels[:n])
    timed = k - max(4, k // 4)  # the floor runs as many iterations as a timed audit run
    timers = {"floor vmapped": loop_block(step, timed, device)}
    if device.type == "cuda":
        timers["floor graph"] = loop_block(replayed(floor_step(model, args.client_mode, pool[:n], labels[:n])),
                                           timed, device)
    timers["eager"] = IterationTimer(obs, k, device, capture="off")
    timers["captured"] = captured = IterationTimer(obs, k, device, capture=route)
    rows = best_of(timers, args.repeats)
    per_image = {name: 1e3 * seconds / n for name, seconds in rows.items()}
    per_image["one-off s"] = captured.runs[0] - min(captured.runs[1:])
    return per_image


def table_rows(model_name: str, n: int, cells: dict, cuda: bool) -> str:
    """One row: ms per image per iteration on CUDA, ratios to the vmapped floor on a CPU."""
    base = cells["floor vmapped"]
    show = (lambda v: f"{v:.3f}") if cuda else (lambda v: f"{v / base:.2f}x")
    graph = show(cells["floor graph"]) if "floor graph" in cells else "n/a (no CUDA)"
    tail = f" {cells['captured'] / cells['floor graph']:.2f} | {cells['one-off s']:.1f} |" if cuda else ""
    return (f"| {model_name} | {n} | {show(base)} | {graph} | {show(cells['eager'])} | {show(cells['captured'])} |"
            + tail)


def throughput(args, device) -> tuple:
    """The floor table (and the batched-restarts ratios, and on cuda the precision check):
    its Markdown and the measured cells."""
    cuda = device.type == "cuda"
    data = load_dataset("embedded", size=32)
    sizes = [int(m) for m in args.members.split(",")]
    sizes_of = {name: [int(m) for m in members.split(",")] for name, members in
                (item.split("=", 1) for item in args.members_of)}
    gen = torch.Generator().manual_seed(args.seed)
    largest = max(sizes + [m for members in sizes_of.values() for m in members])
    pool = torch.rand(largest, *data.input_shape, generator=gen).to(device)
    pool_labels = torch.randint(0, data.num_classes, (largest,), generator=gen).to(device)
    name = torch.cuda.get_device_name(device) if cuda else f"cpu, {args.threads} thread(s)"
    print(f"IG, 32x32, client {args.client_mode} mode, {name}; k={args.iterations}, best of {args.repeats}")
    unit = "ms per image per iteration" if cuda else \
        "process CPU time per image-iteration, x the plain vmapped floor of the same row"
    table = [f"| model | images N | floor: vmapped program | floor: replayed CUDA graph | audit: grouped, eager | "
             f"audit: grouped, captured ({args.route}) |" + (" captured / graph floor | captured one-off s |"
                                                            if cuda else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if cuda else "")]
    ratios = [f"| model | {args.restarts} restarts batched / the same run one after another |", "|---|---:|"]
    results = {}
    for model_name in args.models.split(","):
        model = build_model(model_name, data.input_shape, data.num_classes, mean=data.mean, std=data.std,
                            seed=args.seed).to(device)
        results[model_name] = {}
        for n in sizes_of.get(model_name, sizes):
            cells = measure(model, pool, pool_labels, args, device, n)
            results[model_name][n] = cells
            table.append(table_rows(model_name, n, cells, cuda))
            print(table[-1], flush=True)
        obs = observations(model, pool[:1], pool_labels[:1], args.client_mode)
        r, k = args.restarts, args.iterations
        rows = best_of({"batched": grouped_block(obs, k, device, restarts=r),
                        "sequential": grouped_block(obs, k, device, runs=r)}, args.repeats)
        ratios.append(f"| {model_name} | {rows['batched'] / rows['sequential']:.2f} |")
    text = f"{unit}:\n\n" + "\n".join(table) + "\n\n" + "\n".join(ratios)
    if args.precision_check and cuda:
        checked = precision_check(load_dataset("embedded", size=32), device, 200, 8)
        lines = ["| arithmetic (convnet, 8 test images, IG 200 iterations) | mean PSNR dB | difference | seconds |",
                 "|---|---:|---:|---:|"]
        for key, (value, seconds) in checked.items():
            lines.append(f"| {key} | {value:.3f} | {value - checked['float32'][0]:+.3f} dB | {seconds:.1f} |")
        text += "\n\n" + "\n".join(lines)
        results["precision"] = checked
    return text, results, name


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="cnn,resnet18")
    p.add_argument("--members", default="1,8,64", help="numbers of images N")
    p.add_argument("--members-of", action="append", default=[], metavar="MODEL=N,N",
                   help="other numbers of images for one model (e.g. resnet18=1,8 where memory is short)")
    p.add_argument("--route", default=None, help="the captured column's route (attacks.capture.ROUTES; default: "
                                                 "graph on cuda, eager on cpu, where compiling takes minutes a shape)")
    p.add_argument("--restarts", type=int, default=4, help="R for batched against sequential restarts")
    p.add_argument("--iterations", type=int, default=40, help="k, the iterations of a timed audit run (>= 5)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--client-mode", default="eval", choices=["train", "eval"])
    p.add_argument("--precision-check", action="store_true")
    p.add_argument("--ops", action="store_true", help="count kernels per iteration instead (bench/op_counts.py)")
    p.add_argument("--ops-members", type=int, default=8, help="images N of the operation counts")
    p.add_argument("--gpu-turn", action="store_true", help="on cuda: the default audit on CUDA and CPU, a sweep, the "
                                                           "CUDA tests, the floor table, the kernel counts and the "
                                                           "paper-scale audit, into one Markdown file")
    p.add_argument("--gpu-turn-section", choices=[n for n in gpu_turn.SECTIONS if n not in ("tests", gpu_turn.REPEATED)], default=None,
                   help="one section of --gpu-turn (on its device), its result printed (the turn runs each in its "
                        "own process)")
    p.add_argument("--gpu-turn-out", default="docs/gpu-turn.md", help="the --gpu-turn file (from the project root)")
    p.add_argument("--gpu-turn-dir", default="bench/results/gpu-turn",
                   help="where --gpu-turn keeps each section's result as it finishes (from the project root); a "
                        "turn runs only the sections not kept there (remove it for a fresh turn)")
    p.add_argument("--gpu-turn-budget", type=float, default=gpu_turn.TURN_BUDGET_S,
                   help="seconds a turn may take: a section starts only while its estimate fits")
    p.add_argument("--gpu-turn-only", default=None, help="comma-separated sections of --gpu-turn to run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    add_docs_option(p, "docs/performance.md")
    args = p.parse_args(argv)

    needs_cuda = args.gpu_turn or (args.gpu_turn_section and gpu_turn.SECTIONS[args.gpu_turn_section].device == "cuda")
    if needs_cuda and (not args.device.startswith("cuda") or not torch.cuda.is_available()):
        print(f"--gpu-turn and --gpu-turn-section need --device cuda on a machine with a CUDA GPU "
              f"(device {args.device!r}, CUDA "
              f"{'available' if torch.cuda.is_available() else 'not available'})", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.route = args.route or ("graph" if cuda else "eager")
    setting = f"torch {torch.__version__}, " + (torch.cuda.get_device_name(device) if cuda else
                                                 f"cpu, {args.threads} thread(s)")
    if args.gpu_turn:
        only = args.gpu_turn_only.split(",") if args.gpu_turn_only else None
        written = gpu_turn.run(device, ROOT / args.gpu_turn_out, ROOT / args.gpu_turn_dir, args.gpu_turn_budget, only)
        print(f"written: {written}")
        return {}
    if args.gpu_turn_section:
        args.members, args.iterations, args.repeats = "8,32", 20, 2  # the turn's floor table: about 2 minutes
        own = {"floor": lambda: (throughput(args, device)[0], {}),
               "ops": lambda: (op_counts.table(op_counts.count(floor_step, device, args.ops_members),
                                               args.ops_members), {})}
        body, data = own[args.gpu_turn_section]() if args.gpu_turn_section in own else \
            gpu_turn.BODIES[args.gpu_turn_section](device)
        print(f"{gpu_turn.BODY}\n{json.dumps({'body': body, 'data': data})}")
        return {}
    if args.ops:
        rows = op_counts.count(floor_step, device, args.ops_members)
        text = op_counts.table(rows, args.ops_members)
        print("\n" + text)
        publish(args, "bench.bench_throughput", argv, text, setting)
        return {"ops": rows}
    text, results, name = throughput(args, device)
    print("\n" + text)
    publish(args, "bench.bench_throughput", argv, text, f"torch {torch.__version__}, {name}")
    return results


if __name__ == "__main__":
    main()
