"""Conv-span: the batch from the row spaces of the deep convolutions' weight gradients.

Where a convolution has fewer output positions than output channels and patch entries, its
weight gradient's row space is exactly the span of its input's patches
(:mod:`attacks.conv_span_algebra`): on ResNet-18 at batch 1, every convolution of stages 3 and
4. Asking every patch of a candidate's deep maps to lie in those row spaces is tens of
thousands of equations on a 3,072-pixel image, and needs no second-order gradient. Three stages:

1. the deep map: the last map of the traced graph through which the image reaches every span
   convolution (:mod:`attacks.conv_span_graph`), found from a random map so that every span
   convolution above it sees patches in its row space (L-BFGS, :mod:`attacks.conv_span_maps`);
2. the image whose lower layers map to it (feature inversion, scale-free: Adam coarse to fine,
   projected onto the pixels' range); optionally (``recursion``) R-GAP's recursion below it;
3. from there, the same residual over the image (L-BFGS), in float32 then float64, restarted
   from a new draw where it stalls.

The residual cannot see a gain of the normalised image, so a last step fits each image's gain
(and each channel's relative gain and offset) and the labels to the whole upload; the
certificate, as SPEAR's, is the relative error with which the recovered batch reproduces the
upload. Under train-mode BatchNorm the upload barely sees that gain either: the fit keeps the
recovered pattern and its sign, and the certificate can refuse an image right up to its gain.

Measured in docs/conv-span.md.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from audit.core.errors import ConfigError, NotApplicable
from audit.core.reasons import Reason
from audit.core.types import Observation, Reconstruction, trainable_names

from attacks.conv_span_algebra import GAP, RowSpace, row_spaces, span_layers, span_residual
from attacks.conv_span_graph import graph_of, graph_split
from attacks.conv_span_rgap import descend, scaled_signal
from attacks.conv_span_maps import feature_mismatch, invert, map_residual, non_negative, separate
from attacks.labels import infer_labels
from attacks.presets import ATTACKS
from attacks.simulator import ClientReplica, GradientSimulator, SimContext
from priors import classifier_head
from priors.features import per_image_features

#: relative error of the reproduced upload under which the recovered batch is certified exact (float32
#: through ResNet-18: an image exact to 88 dB reproduces it to 1.6e-3; a stalled one to ~0.3)
CERTIFICATE_TOLERANCE = 1e-2
#: L-BFGS evaluations when no budget is given (eval-mode ResNet-18: exact in about 400)
DEFAULT_EVALUATIONS = 400
#: residual evaluations per gradient evaluation of the budget: one costs a forward and a first-order
#: backward pass, about half of a gradient-matching iteration's (which differentiates a gradient)
EVALUATIONS_PER_BUDGET = 2
#: the float32 descent runs in this many parts; after a part that ends with the residual above
#: ``STALL`` (stalled starts sit at 0.04-0.05 on ResNet-18, converging ones below 1e-3 by then) the
#: rest restarts from a new draw, and the lowest residual found is kept
STALL_CHUNKS = 3
STALL = 1e-2
#: the share of the evaluations run in float64 at the end (none where the upload is float64 already)
FLOAT64_SHARE = 0.25
#: evaluations of the deep-map stage (:mod:`attacks.conv_span_maps`) per image-domain evaluation: the map's
#: descent (one costs ~0.7 of an image-domain one on ResNet-18; at 600 its residual is 2e-8 to 5e-7, and an
#: image whose map stopped at 5e-7 stalled in the inversion) and the image's inversion under it (an Adam
#: step, ~0.3; train-mode ResNet-18 reaches a mismatch of 3e-4 in 900 steps, 2.25 at budget 200)
MAP_EVALUATIONS = 2.0
INVERT_EVALUATIONS = 2.25
#: the share of the deep-map stage run on a batch before its maps are parted (:func:`separate`); the
#: rest runs from the parted maps (eval-mode ResNet-18 at batch 4: the joint maps span the true ones to
#: 1-2%, and the parted ones reach each true map to a cosine of 0.998-0.9997)
SEPARATE_AFTER = 0.5
#: an inversion that ends above this mismatch is run once more from a new draw, and the better kept (exact
#: ones end at 1e-5 to 3e-4; on ResNet-18 an unlucky start stops at 0.07, 27 dB)
INVERT_STALL = 1e-3
#: float64 L-BFGS evaluations of the deep map before the recursion reads its ReLU masks
POLISH_EVALUATIONS = 40
#: Gauss-Newton iterations of the colour fit to the whole upload
FIT_EVALUATIONS = 10
#: the log-gains of the normalised images' spread the colour fit tries before its descent (a normalised
#: data set spreads about 1; the flattest embedded images about 0.1). Steps of 6%: under train-mode
#: BatchNorm the upload's minimum in the gain is about 10% wide (ResNet-18)
FIT_GAINS = tuple(k / 16 for k in range(-40, 17))


def applicability(observation: Observation) -> Tuple[List, Optional[Reason]]:
    """The convolutions the attack reads, or why it does not apply (None when it does). An update
    after several local steps is a sum of the steps' gradients where the optimiser is SGD
    (momentum included) without weight decay: its row space is the union of the steps' patch
    spans, which holds the images' patches at the shared weights where every step takes the
    whole batch."""
    steps, optimizer = observation.local_steps, observation.optimizer
    if steps > 1 and (optimizer.name != "sgd" or optimizer.weight_decay):
        return [], Reason("conv-span-nonlinear-steps", steps=steps, optimizer=optimizer.describe())
    local = observation.local_batch_size
    if steps > 1 and local is not None and local < observation.batch_size:
        return [], Reason("conv-span-minibatch-steps", steps=steps, local=local, batch=observation.batch_size)
    return span_layers(observation.model, observation.input_shape, observation.batch_size, steps)


class _Maps:
    """Forward hooks on the replica's span convolutions that keep each one's input map."""

    def __init__(self, replica: ClientReplica, spaces: List[RowSpace]):
        modules = dict(replica.model.named_modules())
        self.convs = {s.layer.name: modules[s.layer.name] for s in spaces}
        self.maps: Dict[str, Tensor] = {}

    def __enter__(self) -> "_Maps":
        self.maps = {}
        self.handles = [m.register_forward_hook(self._keep(n)) for n, m in self.convs.items()]
        return self

    def _keep(self, name):
        def keep(_module, inputs, _output):
            self.maps[name] = inputs[0]
        return keep

    def __exit__(self, *exc) -> None:
        for h in self.handles:
            h.remove()


class ConvSpan:
    """The conv-span attack (module docstring). ``evaluations``: L-BFGS evaluations when no budget
    is given; ``fit``: Gauss-Newton iterations of the colour fit; ``init_std``: spread of the start
    around mid-grey; ``tolerance``: the certificate's relative error; ``layers``: module names to
    read (None: every convolution whose uploaded gradient shows the rank gap); ``recursion``: solve the
    maps below the deep map by R-GAP's recursion (eval mode, one image, one gradient; off in the
    registered attack: from the span's deep map it stops at its first map, docs/conv-span.md)."""

    name = "conv-span"
    uses_budget = True

    def __init__(self, evaluations: int = DEFAULT_EVALUATIONS, fit: int = FIT_EVALUATIONS, init_std: float = 0.1,
                 tolerance: float = CERTIFICATE_TOLERANCE, layers: Optional[List[str]] = None,
                 deep_map: bool = True, recursion: bool = False):
        if evaluations < 1 or fit < 0 or not init_std >= 0 or not tolerance > 0:
            raise ConfigError(f"conv-span: need evaluations >= 1, fit >= 0, init_std >= 0 and tolerance > 0, got "
                              f"{evaluations}, {fit}, {init_std}, {tolerance}")
        self.evaluations, self.fit, self.init_std = int(evaluations), int(fit), float(init_std)
        self.tolerance, self.layers = float(tolerance), None if layers is None else list(layers)
        self.deep_map, self.recursion = bool(deep_map), bool(recursion)

    #: the fit and the certificate compare the upload only where it is not zero (a pruned upload)
    replay_zeros = False

    def _row_spaces(self, gradients: Dict[str, Tensor], layers: List, batch: int, centred: bool,
                    steps: int) -> Tuple[List[RowSpace], List[Tuple[str, float]]]:
        """The row spaces the attack reads (:func:`attacks.conv_span_algebra.row_spaces`); an
        adaptive form reads them through its defense."""
        return row_spaces(gradients, layers, batch, centred, steps)

    def reconstruct(self, observation: Observation, budget: Optional[int] = None, seed: int = 0,
                    progress: Optional[Callable] = None) -> Reconstruction:
        layers, why = applicability(observation)
        if not layers:
            return Reconstruction.not_applicable(why)
        if self.layers is not None:
            layers = [layer for layer in layers if layer.name in self.layers]
            if not layers:
                return Reconstruction.not_applicable(Reason("conv-span-layers-no-rank", layers=list(self.layers)))
        start = time.perf_counter()
        names = trainable_names(observation.model)
        by_module = {n.rsplit(".", 1)[0]: g for n, g in zip(names, observation.gradients) if n.endswith("weight")}
        b, centred = observation.batch_size, observation.client_mode == "train"
        spaces, broken = self._row_spaces(by_module, layers, b, centred, observation.local_steps)
        trace = {"attack": self.name, "layers": [s.layer.name for s in spaces], "gaps": [s.gap for s in spaces],
                 "layers_without_gap": [n for n, _ in broken], "centred": centred}
        if not spaces:
            return Reconstruction.not_applicable(
                Reason("conv-span-no-gap", checked=len(broken), gap=min(g for _, g in broken), limit=GAP), **trace)
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
        x = 0.5 + self.init_std * torch.randn((b, *observation.input_shape), generator=generator)
        evaluations = self.evaluations if budget is None else max(1, EVALUATIONS_PER_BUDGET * int(budget))
        # most of the descent in the upload's precision, the last share in float64, where the
        # residual can fall far enough for the colour fit and the certificate to be exact
        fine = int(round(FLOAT64_SHARE * evaluations)) if observation.gradients[0].dtype != torch.float64 else 0
        history: List[float] = []
        restarts = 0
        calls = [0]  # evaluations so far over every start and stage, for the progress bar
        mapped, inverted = (int(round(f * evaluations)) if self.deep_map else 0
                            for f in (MAP_EVALUATIONS, INVERT_EVALUATIONS))
        total = evaluations + mapped + inverted

        def report(_n: int, _of: int, loss: float) -> None:
            calls[0] += 1
            if progress is not None:  # a line search may run past its stage's share by an evaluation
                progress(min(calls[0], total), total, loss)
        if mapped:
            x = self._deep_map_start(observation, spaces, x, mapped, inverted, generator, report, trace)
        for stage, count in ((observation, evaluations - fine), (_float64(observation), fine)):
            if count < 1:
                continue
            sim = GradientSimulator()
            replica = sim.prepare(stage)
            params = {n: p.detach() for n, p in replica.params.items()}
            hooks = _Maps(replica, spaces)
            x = x.detach().to(stage.gradients[0]).requires_grad_(True)
            here = [dataclasses.replace(s, basis=s.basis.to(x)) for s in spaces]  # once, not per evaluation

            def residual(images: Tensor) -> Tensor:
                with hooks:
                    replica.forward(params, images)
                return sum(span_residual(s, hooks.convs[s.layer.name], hooks.maps[s.layer.name])
                           for s in here) / len(here)

            # a start that stalls far from zero stays there: after each part of the float32 descent that
            # ends above STALL, the rest restarts from a new draw; the lowest residual found is kept
            chunks = STALL_CHUNKS if stage is observation else 1
            descent, best = _Descent([x], lambda: residual(x), report), (math.inf, x.detach().clone())
            for k in range(chunks):
                part = count // chunks + (count % chunks if k == chunks - 1 else 0)
                history += descent.run(part)
                if history and history[-1] < best[0]:
                    best = (history[-1], x.detach().clone())
                if k < chunks - 1 and history and history[-1] > STALL:
                    restarts += 1
                    x = (0.5 + self.init_std * torch.randn(x.shape, generator=generator)).to(x).requires_grad_(True)
                    descent = _Descent([x], lambda: residual(x), report)
            x = best[1].requires_grad_(True)
        if progress is not None and history:  # a descent that converged early ends the bar all the same
            progress(total, total, history[-1])
        labels, label_source = self._labels(stage, replica, params, x.detach(), seed)
        images, labels, error, fitted = self._fit(stage, sim, replica, x.detach(), labels, scout=observation)
        certified = error <= self.tolerance
        trace.update(residual=history[-1] if history else math.nan, residual_start=history[0] if history else math.nan,
                     evaluations=len(history), restarts=restarts, fit_evaluations=fitted, labels_from=label_source,
                     certificate_error=error, certified=certified, certificate_tolerance=self.tolerance,
                     seconds=time.perf_counter() - start)
        return Reconstruction(images.clamp(0, 1).to(observation.gradients[0].dtype), labels, trace)

    def reconstruct_many(self, observations: Sequence[Observation], budget: Optional[int] = None,
                         seeds: Optional[Sequence[int]] = None, progress: Optional[Callable] = None,
                         max_members: int = 64) -> List[Reconstruction]:
        """:meth:`reconstruct` for several observations, each its own, run side by side on a CPU's
        cores (one thread each: at batch 1 the attack's operations are too small to spread one over
        several cores), one after another elsewhere. Each result is the one :meth:`reconstruct`
        gives."""
        observations = list(observations)
        seeds = list(seeds) if seeds is not None else [0] * len(observations)
        if len(seeds) != len(observations):
            raise ConfigError(f"reconstruct_many: {len(seeds)} seeds for {len(observations)} observations")
        done, lock = [0] * len(observations), threading.Lock()

        def member(k: int) -> Optional[Callable]:
            if progress is None:
                return None

            def report(n: int, of: int, loss: float) -> None:
                with lock:
                    done[k] = n
                    progress(sum(done), of * len(observations), loss)
            return report
        on_cpu = all(o.device.type == "cpu" for o in observations)
        workers = min(len(observations), max(1, int(max_members)), torch.get_num_threads()) if on_cpu else 1
        for o in observations:  # traced here: tracing patches every module call in the process
            graph_of(o.model)
        if workers <= 1:
            return [self.reconstruct(o, budget, s, member(k)) for k, (o, s) in enumerate(zip(observations, seeds))]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(workers) as pool:
                return list(pool.map(lambda k: self.reconstruct(observations[k], budget, seeds[k], member(k)),
                                     range(len(observations))))
        finally:
            torch.set_num_threads(threads)

    def _deep_map_start(self, observation: Observation, spaces: List[RowSpace], x: Tensor, mapped: int,
                        inverted: int, generator: torch.Generator, report: Callable, trace: Dict) -> Tensor:
        """The image-domain descent's start: the span convolutions' common input map found first (from a
        random map), then the image whose bottom maps to it (:mod:`attacks.conv_span_maps`); ``x`` is
        returned unchanged where the model does not split."""
        replica = GradientSimulator().prepare(observation)
        cut = graph_split(replica.model, [s.layer.name for s in spaces], like=observation.model)
        if cut is None:
            trace["deep_map"] = "no-cut"
            return x
        x = x.to(observation.gradients[0])
        hooks = _Maps(replica, spaces)
        here = [dataclasses.replace(s, basis=s.basis.to(x)) for s in spaces]
        began = time.perf_counter()
        with torch.no_grad():
            shape, positive = cut.map_of(x).shape, non_negative(cut, x)
        deep = torch.rand(shape, generator=generator).to(x).requires_grad_(True)
        with hooks:
            residual = map_residual(cut.top, here, hooks.convs, hooks.maps)
            # a batch's maps meet the span together as any mixture of the true ones: the descent runs a
            # share, the sparsest directions of what it found part them (:func:`separate`), and it ends from those
            joint = len(deep) > 1 and positive
            share = int(round(SEPARATE_AFTER * mapped)) if joint else mapped
            def loss() -> Tensor:  # the map as it stands (``deep`` is rebound once parted)
                return residual(deep.abs() if positive else deep)
            history = _Descent([deep], loss, report).run(share)
            if joint:
                # the later convs' spans see each map through the block's nonlinearity, so a mixture of
                # the true maps misses them: parted maps that end above the joint ones' residual mixed
                # images up (ResNet-18 at batch 4: one parted map at cosine 0.68, residual 0.24 against
                # the joint maps' 9e-5 at cosines >= 0.9997), and the joint maps are kept
                kept, reached = deep.detach().clone(), history[-1]
                deep = separate(deep.detach().abs(), generator).requires_grad_(True)
                parted = _Descent([deep], loss, report).run(mapped - share)
                trace["separated"] = bool(parted) and parted[-1] <= reached
                if not trace["separated"]:
                    deep = kept.requires_grad_(True)
                    parted = parted + [reached]
                history += parted
        target = (deep.abs() if positive else deep).detach()
        first = hooks.convs[spaces[0].layer.name]
        stride = int(first.stride[0]) if spaces[0].centred else 0
        mismatch = feature_mismatch(cut, target, stride)
        # coarse to fine in the pixels' box (:func:`attacks.conv_span_maps.invert`): under train-mode
        # BatchNorm an inversion from a full-resolution start stalls (ResNet-18, stage 2's output: 15 dB)
        trace["deep_map_seconds"], began = time.perf_counter() - began, time.perf_counter()
        x, inversion = invert(mismatch, x, inverted, report=report)
        if inversion and inversion[-1] > INVERT_STALL:  # a start that ends short of the map: one more draw
            again, more = invert(mismatch, (0.5 + self.init_std * torch.randn(x.shape, generator=generator)).to(x),
                                 inverted, report=report)
            trace["inversion_restarted"] = True
            x, mismatched = (again, more[-1]) if more[-1] < inversion[-1] else (x, inversion[-1])
            inversion = inversion + more
        else:
            mismatched = inversion[-1] if inversion else math.nan
        trace.update(deep_map_residual=history[-1], deep_map_evaluations=len(history),
                     inversion_mismatch=mismatched, inversion_evaluations=len(inversion),
                     inversion_seconds=time.perf_counter() - began)
        if self.recursion and len(x) == 1 and observation.client_mode == "eval" and observation.local_steps == 1 \
                and observation.shares == "gradient":
            x = self._recursion(observation, spaces, target, x, inverted, trace)
        return x

    def _recursion(self, observation: Observation, spaces: List[RowSpace], deep: Tensor, x: Tensor,
                   steps: int, trace: Dict) -> Tensor:
        """The image under the deep map by R-GAP's recursion (:mod:`attacks.conv_span_rgap`), in float64,
        from the map at the scale the gradients above it fix; ``x`` (the inverted image) gives the masks
        no map fixes, and the stretch where the recursion stops is inverted again."""
        start = time.perf_counter()
        wide = _float64(observation)
        split = graph_split(wide.model.eval(), [s.layer.name for s in spaces], like=observation.model)
        if split is None:
            return x
        names = trainable_names(wide.model)
        upload = dict(zip(names, wide.gradients))
        labels = infer_labels(observation).labels.to(x.device).long()
        deep = self._polished(wide.model, split, spaces, deep.double(), POLISH_EVALUATIONS)
        with torch.no_grad():
            seen = split.map_of(x.double())
        guess = float((seen * deep.double()).sum() / deep.double().pow(2).sum().clamp_min(1e-300))
        scaled, signal, error = scaled_signal(split.rest, deep.double(), labels, observation.loss_fn, upload,
                                              guess if guess > 0 else 1.0)
        image, found = descend(split.bottom, upload, scaled, signal, x.double(),
                               lambda mismatch, first: invert(mismatch, first.to(x), steps)[0])
        trace.update(recursion=found, recursion_scale_error=error, recursion_seconds=time.perf_counter() - start)
        return image.to(x)

    @staticmethod
    def _polished(model, split, spaces: List[RowSpace], deep: Tensor, evaluations: int) -> Tensor:
        """The deep map's descent continued in float64 (the recursion reads ReLU masks off it)."""
        modules = dict(model.named_modules())
        convs = {s.layer.name: modules[s.layer.name] for s in spaces}
        maps: Dict[str, Tensor] = {}
        handles = [m.register_forward_hook(lambda _m, i, _o, n=n: maps.__setitem__(n, i[0])) for n, m in convs.items()]
        try:
            here = [dataclasses.replace(s, basis=s.basis.double()) for s in spaces]
            residual = map_residual(split.top, here, convs, maps)
            found = deep.clone().requires_grad_(True)
            _Descent([found], lambda: residual(found.abs()), None).run(evaluations)
        finally:
            for h in handles:
                h.remove()
        return found.detach().abs()

    def _labels(self, observation: Observation, replica: ClientReplica, params: Dict[str, Tensor], x: Tensor,
                seed: int) -> Tuple[Tensor, str]:
        """The labels, and for a batch each one given to the recovered image whose features are
        nearest its own reading off the output layer's gradient (images are found in no order)."""
        inferred = infer_labels(observation, seed=seed)
        labels = inferred.labels.to(x.device).long()
        if len(labels) < 2:
            return labels, inferred.method
        try:
            weight, bias = classifier_head(observation.model)
        except NotApplicable:
            return labels, inferred.method
        names = trainable_names(observation.model)
        head = dict(replica.model.named_modules())[names[weight].rsplit(".", 1)[0]]
        kept: List[Tensor] = []
        handle = head.register_forward_pre_hook(lambda _m, inp: kept.append(inp[0].detach()))
        try:
            with torch.no_grad():
                replica.forward(params, x)
        finally:
            handle.remove()
        reading, usable = per_image_features(observation.gradients[weight].detach(),
                                             observation.gradients[bias].detach(), labels)
        mine = torch.nn.functional.normalize(kept[0].double(), dim=1)
        theirs = torch.nn.functional.normalize(reading.double(), dim=1)
        cost = -(theirs @ mine.T) * usable.double()[:, None]
        rows, cols = linear_sum_assignment(cost.cpu().numpy())
        assigned = torch.empty_like(labels)
        assigned[torch.as_tensor(cols, device=labels.device)] = labels[torch.as_tensor(rows, device=labels.device)]
        return assigned, f"{inferred.method}-matched"  # each label given to the image nearest its feature reading

    def _fit(self, observation: Observation, sim: GradientSimulator, replica: ClientReplica, x: Tensor,
             labels: Tensor, scout: Optional[Observation] = None) -> Tuple[Tensor, Tensor, float, int]:
        """Each image's gain about the data mean, and a per-channel gain and offset, fitted to the
        whole upload; and the certificate: the relative error of the upload reproduced (clamped to
        the data's range, as scored). ``scout``: the upload in its own precision, where the grid of
        gains is scored (float32 on a float64 fit: the grid is about a third of the attack's time)."""
        observed = [g.detach() for g in observation.gradients]
        ref = _upload_norm(observed)
        channels = x.shape[1]
        shape = (1, channels, 1, 1)
        mean = torch.tensor(observation.data_mean or [0.0] * channels, dtype=x.dtype, device=x.device).view(shape)
        std = torch.tensor(observation.data_std or [1.0] * channels, dtype=x.dtype, device=x.device).view(shape)
        z = (x - mean) / std  # what the model's first layer sees, up to its normalisation
        n = len(x)

        def images(theta: Tensor) -> Tensor:
            gain, rho, offset = theta[:n].view(n, 1, 1, 1), theta[n:n + n * channels], theta[n + n * channels:]
            return mean + std * gain.exp() * (rho.view(n, channels, 1, 1).exp() * z + offset.view(n, channels, 1, 1))

        def replaying(upload: Observation, sim_: GradientSimulator, replica_: ClientReplica) -> Callable:
            context, dtype = SimContext(upload, capture_features=False), upload.gradients[0].dtype
            kept = [g.detach() for g in upload.gradients]
            masks = [g != 0 for g in kept] if self.replay_zeros else None

            def mismatch(theta: Tensor, clamp: bool = False) -> Tensor:
                fitted = images(theta).to(dtype)
                return _upload_mismatch(sim_, replica_, fitted.clamp(0, 1) if clamp else fitted, labels, context,
                                        kept, ref, masks)
            return mismatch
        mismatch = replaying(observation, sim, replica)

        # Under train-mode BatchNorm the upload is nearly blind to a gain of the normalised image (zero
        # padding keeps a scaled image's border, the normalisation divides the gain out; the residual
        # before this fit is blind to it alike), and it moves by 1% for an offset of 1e-4: a fit over
        # each channel's gain and offset from the data set's statistics slides along that valley and ends
        # far from it (ResNet-18: images exact to 82 dB fitted to 35 dB, some flipped). So the images'
        # gains are tried on a log grid, in the data's range as scored (a gain that clamps the images
        # reproduces the upload worse), keeping the recovered pattern and its sign (the ReLUs see it);
        # then Levenberg-Marquardt fits the gains, then each channel's relative gain and offset too, from
        # the best, each kept only where it reproduces the upload better in the data's range
        zero = torch.zeros(n * (1 + 2 * channels), dtype=x.dtype, device=x.device)
        spread = z.flatten(2).std(-1).mean(-1).clamp_min(1e-6).log()

        def at(shift: float) -> Tensor:
            start = zero.clone()
            start[:n] = shift - spread  # the normalised images' spread at exp(shift)
            return start
        score = mismatch
        if scout is not None and scout.gradients[0].dtype != x.dtype:
            scouting = GradientSimulator()
            score = replaying(scout, scouting, scouting.prepare(scout))
        grid = [(float(score(at(shift), clamp=True).norm()), at(shift)) for shift in FIT_GAINS]
        theta = min(grid, key=lambda t: t[0])[1]
        error, fitted = float(mismatch(theta, clamp=True).norm()), len(grid) + 1
        if not error < 1:  # no gain reproduces the upload better than sharing nothing: the images as
            # recovered, at the data set's spread (a descent would flatten them to the zero upload)
            theta = at(0.0)
            return images(theta).detach(), labels, float(mismatch(theta, clamp=True).norm()), fitted + 1
        # the gains alone first (smooth where the offsets' valley is sharp), then every parameter
        for free in (n, len(theta)):
            def partial(head: Tensor, rest=theta[free:].clone()) -> Tensor:
                return mismatch(torch.cat([head, rest]))
            head, used = _gauss_newton(partial, theta[:free].clone(), self.fit)
            descended = torch.cat([head, theta[free:]])
            better = float(mismatch(descended, clamp=True).norm())
            fitted += used + 1
            if better < error:
                error, theta = better, descended
        return images(theta).detach(), labels, error, fitted


def upload_error(observation: Observation, images: Tensor, labels: Tensor) -> float:
    """The relative error with which ``images`` labelled ``labels`` reproduce the observed upload
    (the certificate's measure, before any fit): what the attacker can compare candidates by."""
    sim = GradientSimulator()
    observed = [g.detach() for g in observation.gradients]
    return float(_upload_mismatch(sim, sim.prepare(observation), images.to(observed[0]), labels.to(images.device),
                                  SimContext(observation, capture_features=False), observed,
                                  _upload_norm(observed)).norm())


def _upload_norm(observed: List[Tensor]) -> float:
    """The observed upload's Euclidean norm over every tensor (1 for a silent upload): the scale of
    the certificate's relative error."""
    return math.sqrt(sum(float(g.double().pow(2).sum()) for g in observed)) or 1.0


def _upload_mismatch(sim: GradientSimulator, replica: ClientReplica, images: Tensor, labels: Tensor,
                     context: SimContext, observed: List[Tensor], ref: float,
                     masks: Optional[List[Tensor]] = None) -> Tensor:
    """The replayed upload of ``images`` less the observed one, flattened, over the observed norm
    (where ``masks`` are given, the replayed upload kept where they are set, as a pruned one)."""
    with torch.enable_grad():
        grads, _ = sim(replica, images, labels, functional=False, context=context)
    kept = [g.detach() for g in grads] if masks is None else [g.detach() * m for g, m in zip(grads, masks)]
    return torch.cat([(g - o).flatten() for g, o in zip(kept, observed)]) / ref


def _gauss_newton(residual: Callable[[Tensor], Tensor], theta: Tensor, iterations: int,
                  step: float = 1e-6) -> Tuple[Tensor, int]:
    """Levenberg-Marquardt on a few parameters with a forward-difference Jacobian; the result and
    the residual evaluations it took."""
    r = residual(theta)
    used, damping = 1, 1e-3
    for _ in range(iterations):
        h = step * theta.abs().clamp_min(1e-2)
        jac = torch.stack([(residual(theta + h[k] * torch.eye(len(theta), dtype=theta.dtype, device=theta.device)[k])
                            - r) / h[k] for k in range(len(theta))], 1)
        used += len(theta)
        normal, rhs = jac.T @ jac, -(jac.T @ r)
        if not float(normal.diagonal().max()) > 0:  # the residual does not move with the parameters
            break
        while True:
            delta = torch.linalg.solve(normal + damping * normal.diagonal().mean() * torch.eye(len(theta), dtype=theta.dtype,
                                                                                               device=theta.device), rhs)
            trial = residual(theta + delta)
            used += 1
            if trial.norm() < r.norm():
                theta, r, damping = theta + delta, trial, max(damping / 10, 1e-12)
                break
            damping *= 10
            if damping > 1e6:
                return theta, used
        if float(delta.norm()) <= 1e-12 * float(theta.norm()):
            break
    return theta, used


def _float64(observation: Observation) -> Observation:
    """The observation with its model and upload in float64 (the model copied, never changed)."""
    return dataclasses.replace(observation, model=copy.deepcopy(observation.model).double(),
                               gradients=[g.detach().double() for g in observation.gradients])


class _Descent:
    """L-BFGS (strong Wolfe line search) on ``variables``, resumable: each :meth:`run` continues
    with the curvature pairs the last one kept; ``history`` holds the loss at each evaluation."""

    def __init__(self, variables: List[Tensor], loss: Callable[[], Tensor], progress: Optional[Callable] = None):
        self.loss, self.progress, self.history = loss, progress, []
        self.optimizer = torch.optim.LBFGS(variables, lr=1, history_size=50, line_search_fn="strong_wolfe",
                                           tolerance_grad=1e-14, tolerance_change=1e-18)

    def run(self, evaluations: int) -> List[float]:
        group = self.optimizer.param_groups[0]
        group["max_iter"] = group["max_eval"] = max(1, int(evaluations))
        start = len(self.history)

        def closure():
            self.optimizer.zero_grad()
            value = self.loss()
            value.backward()
            self.history.append(float(value.detach()))
            if self.progress is not None:
                self.progress(len(self.history), evaluations, self.history[-1])
            return value

        self.optimizer.step(closure)
        return self.history[start:]


@ATTACKS.register("conv-span", "Conv-span: the batch whose deep feature maps' patches lie in the row spaces of the "
                  "convolutions' weight gradients (exact where positions < channels), colour fitted to the upload "
                  "and certified by reproducing it")
def conv_span(evaluations: int = DEFAULT_EVALUATIONS, fit: int = FIT_EVALUATIONS, init_std: float = 0.1,
              tolerance: float = CERTIFICATE_TOLERANCE, layers: Optional[List[str]] = None,
              deep_map: bool = True) -> ConvSpan:
    return ConvSpan(evaluations, fit, init_std, tolerance, layers, deep_map)
