"""SPEAR against batch size and gaussian noise, side by side with `analytic` and `ig` on the
same private batches (``gia-audit attack`` end to end; docs/strength.md (SPEAR)).

An image counts as exact at PSNR >= 50 dB; "certified" says whether SPEAR's recovered batch
reproduced the upload within its tolerance.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from bench.docs_table import add_docs_option, publish
from audit.engine.single import run_attack

EXACT_DB = 50.0


def audits(sigmas, batch: int, seed: int) -> list:
    """The whole audit (``gia-audit audit --model mlp --batch-size B --steps 0``: 8 private batches,
    the planner's attacks, utility) with no defense (sigma 0) and with ``gaussian`` at each sigma,
    stored and resumed under ``bench-out/spear-audits/``: its verdict, how many images it marks
    exact (certified by SPEAR), and SPEAR's own images at >= 50 dB."""
    import statistics

    from audit.engine.audit import run

    rows = []
    for sigma in sigmas:
        name = "none" if sigma == 0 else f"gaussian-{sigma:g}"
        start = time.perf_counter()
        report = run("none" if sigma == 0 else "gaussian", defense_args=None if sigma == 0 else {"sigma": sigma},
                     model="mlp", batch_size=batch, steps=[0], seed=seed, progress=False,
                     out=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench-out",
                                      "spear-audits", name))
        verdict = report.data["steps"][0]["verdict"]
        spear = [min(p, 200.0) for r in report.data["results"] if r.get("attack") == "spear" and r.get("metrics")
                 for p in r["metrics"]["psnr_per_image"]]
        rate = verdict["recovery_rate"]
        rows.append({"sigma": sigma, "verdict": verdict["label"],
                     "recovered": f"{verdict['recovered']} of {verdict['images']} ({100 * rate['low']:.0f}-"
                                  f"{100 * rate['high']:.0f}%)",
                     "exact": verdict.get("exact", 0),
                     "spear": f"{sum(p >= EXACT_DB for p in spear)} of {len(spear)}, mean {statistics.mean(spear):.1f}"
                     if spear else "-", "seconds": time.perf_counter() - start})
    return rows


def isolation(model_name: str, batch: int, batches: int, seed: int, samples: int) -> list:
    """Why SPEAR can or cannot separate a batch, from the private batch itself (a diagnosis, not
    an attack): per audit private batch (the audit's own draw), the live rows of the layer's
    ``dZ``, each image's zero rows among them, the images some row subset can isolate (the other
    images' ``dZ`` on its zero rows has rank ``B - 1``), the same on the other side (the layer's
    input: its zero share per image, the images its zeros isolate), and what SPEAR certified."""
    import torch

    from attacks import ATTACKS, observe
    from attacks.spear import relu_linear_layers
    from audit.core.data import load_dataset
    from audit.core.models import build_model
    from audit.engine.audit import _private_batches

    data = load_dataset("embedded", size=32)
    model = build_model(model_name, tuple(data.input_shape), data.num_classes, seed=seed)
    rows = []
    for k, (x, y) in enumerate(_private_batches(data, batches, batch, seed)):
        obs = observe(model, x, y, client_mode="train")
        layer = relu_linear_layers(obs.model)[0][0].layer
        seen = {}
        hook = layer.register_forward_hook(lambda _m, inp, out: seen.update(z=out, x=inp[0].detach()))
        out = obs.model.train()(x)
        seen["z"].retain_grad()
        torch.nn.functional.cross_entropy(out, y).backward()
        hook.remove()
        dz = seen["z"].grad.double().T  # (rows, B)
        live = dz.abs().amax(1) > 0
        dz = dz[live]
        zero = dz == 0
        isolable = sum(int(torch.linalg.matrix_rank(dz[zero[:, i]][:, [j for j in range(batch) if j != i]]))
                       == batch - 1 for i in range(batch))
        inputs = seen["x"].double()  # (B, n): the layer's input, its other side
        inputs = inputs[:, inputs.abs().amax(0) > 0]
        in_zero = inputs == 0
        input_isolable = sum(int(torch.linalg.matrix_rank(inputs[[j for j in range(batch) if j != i]][:, in_zero[i]]))
                             == batch - 1 for i in range(batch))
        trace = ATTACKS.build("spear", samples=samples).reconstruct(obs, None, seed).trace
        rows.append({"batch": k, "labels": len(set(y.tolist())), "live": int(live.sum()),
                     "zeros": f"{int(zero.sum(0).min())}-{int(zero.sum(0).max())}", "isolable": isolable,
                     "input_zeros": f"{100 * float(in_zero.double().mean(1).min()):.0f}-"
                                    f"{100 * float(in_zero.double().mean(1).max()):.0f}%",
                     "input_isolable": input_isolable, "from_input": bool(trace.get("from_input_zeros")),
                     "certified": trace.get("certified", False),
                     "match": f"{trace['activity_match']:.2f}" if "activity_match" in trace else "-"})
    return rows


def cell(attack: str, model: str, batch: int, sigma: float, args) -> dict:
    """One attack on ``args.repeats`` private batches in a row (from ``args.index``)."""
    settings = {"samples": args.samples} if attack.startswith("spear") else {}
    psnrs, certified, seconds, applicable = [], 0, 0.0, True
    for k in range(args.repeats):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            metrics = run_attack(attack, model=model, batch_size=batch, index=args.index + k * batch, attack_args=settings,
                                 budget=None if attack == "spear" else args.budget,
                                 defense="gaussian" if sigma else None,
                                 defense_args={"sigma": sigma} if sigma else None, out=out, seed=args.seed,
                                 progress=False)
        seconds += time.perf_counter() - start
        if not metrics["applicable"]:
            applicable = False
            continue
        psnrs += [min(p, 200.0) for p in metrics["scores"]["psnr"].per_image]
        trace = metrics["trace"]
        inner = trace.get("spear")  # spear-ig: SPEAR's summary where its features were certified, else why not
        certified += bool(trace.get("certified") or isinstance(inner, dict))
    if not applicable and not psnrs:
        return {"exact": "n/a", "psnr": "n/a", "certified": "n/a", "seconds": f"{seconds:.0f}"}
    exact = sum(p >= EXACT_DB for p in psnrs)
    return {"exact": f"{exact}/{len(psnrs)}", "psnr": f"{sum(psnrs) / len(psnrs):.1f}",
            "certified": f"{certified}/{args.repeats}" if attack.startswith("spear") else "-",
            "seconds": f"{seconds / args.repeats:.0f}"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp")
    parser.add_argument("--batches", default="8,16")
    parser.add_argument("--sigmas", default="0,1e-5,1e-4")
    parser.add_argument("--attacks", default="spear,analytic,ig")
    parser.add_argument("--samples", type=int, default=1 << 18, help="SPEAR's most sampled row subsets")
    parser.add_argument("--budget", type=int, default=200, help="ig's gradient evaluations")
    parser.add_argument("--index", type=int, default=0, help="first held-out image of the first private batch")
    parser.add_argument("--repeats", type=int, default=1, help="private batches per cell, one after another")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--audits", default=None, metavar="SIGMAS",
                        help="instead: the whole mlp audit at these gaussian sigmas (0: no defense)")
    parser.add_argument("--isolation", type=int, default=0, metavar="N",
                        help="instead: why SPEAR can or cannot separate the audit's first N private batches")
    add_docs_option(parser, "docs/strength.md")
    args = parser.parse_args(argv)
    if args.audits is not None:
        batch = int(args.batches.split(",")[0])
        lines = [f"| defense (mlp, batch {batch}, step 0) | verdict | recovered (95% CI) | marked exact | "
                 "SPEAR's images >= 50 dB, mean PSNR (dB) | wall of this run (s; a stored audit is only read) |", "|---|---|---|---|---|---|"]
        for r in audits([float(v) for v in args.audits.split(",")], batch, args.seed):
            what = "none" if r["sigma"] == 0 else f"gaussian sigma {r['sigma']:g}"
            lines.append(f"| {what} | {r['verdict']} | {r['recovered']} | {r['exact']} | {r['spear']} | "
                         f"{r['seconds']:.0f} |")
            print(lines[-1], flush=True)
        publish(args, "bench.bench_spear", argv, "\n".join(lines))
        return
    if args.isolation:
        lines = ["| model | batch | private batch | distinct labels | live rows of dZ | zero rows per image | "
                 "images a row subset isolates | the input's zero share per image | images its zeros isolate | "
                 "SPEAR certified | from the input's zeros | activity match |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for model in args.models.split(","):
            for batch in map(int, args.batches.split(",")):
                for r in isolation(model, batch, args.isolation, args.seed, args.samples):
                    lines.append(f"| {model} | {batch} | {r['batch']} | {r['labels']} | {r['live']} | {r['zeros']} | "
                                 f"{r['isolable']} of {batch} | {r['input_zeros']} | {r['input_isolable']} of {batch} | "
                                 f"{r['certified']} | {r['from_input']} | {r['match']} |")
                    print(lines[-1], flush=True)
        publish(args, "bench.bench_spear", argv, "\n".join(lines))
        return
    lines = ["| model | batch | gaussian sigma | attack | exact (PSNR >= 50 dB) | mean PSNR (dB) | certified batches "
             "| wall per batch (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for model in args.models.split(","):
        for batch in map(int, args.batches.split(",")):
            for sigma in map(float, args.sigmas.split(",")):
                for attack in args.attacks.split(","):
                    r = cell(attack, model, batch, sigma, args)
                    lines.append(f"| {model} | {batch} | {sigma:g} | {attack} | {r['exact']} | {r['psnr']} | "
                                 f"{r['certified']} | {r['seconds']} |")
                    print(lines[-1], flush=True)
    publish(args, "bench.bench_spear", argv, "\n".join(lines))


if __name__ == "__main__":
    main()
