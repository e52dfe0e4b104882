"""A small Flower app audited from inside: FedAvg over 2 clients on the embedded data, the
gia-audit client mod on its ClientApp (docs/flower.md).

    python -m bench.flower_app                         # 3 rounds, rounds 1 and 3 audited under two descriptions
    python -m bench.flower_app --localdp 1,1,20,1e-5   # the clients run Flower's LocalDpMod
    python -m bench.flower_app --docs flower           # ... and write the table into docs/flower.md

Client 0 is audited twice on the same replies: with its training described as it runs (2
local SGD steps with momentum 0.9) and as one plain SGD step.
"""
from __future__ import annotations

import argparse
import os
import shutil
import time

import torch
from torch import nn
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

from audit.core.data import load_dataset
from audit.integrations.flower import AuditMod, combine_rounds, wait_for_audits

LR, MOMENTUM, STEPS, BATCH, CLIENTS = 0.05, 0.9, 2, 4, 2


class Net(nn.Module):
    """The deployment's model: Conv-BN-ReLU blocks for 3x32x32 images in [0, 1], 10 classes."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 5), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Flatten())
        self.head = nn.Sequential(nn.Linear(32 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.features(x))


def client_data(context: Context):
    """The client's own images and labels: its partition of the embedded train split."""
    data = load_dataset("embedded", size=32)
    part, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    return data.train_images[part::parts], data.train_labels[part::parts]


def round_batch(context: Context, server_round: int) -> torch.Tensor:
    """The rows of its data the client trains on in ``server_round``: BATCH drawn with a seed of
    its own and the round."""
    seed = 1000 * int(context.node_config["partition-id"]) + int(server_round)
    return torch.randperm(len(client_data(context)[1]), generator=torch.Generator().manual_seed(seed))[:BATCH]


def train(msg: Message, context: Context) -> Message:
    """The client's round: STEPS local SGD steps with momentum on its batch of the round, from
    the global model; it sends its whole state (weights and BatchNorm buffers)."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = client_data(context)
    rows = round_batch(context, msg.content["config"]["server-round"])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    model.train()
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images[rows]), labels[rows])
        loss.backward()
        optimizer.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": BATCH, "loss": float(loss.detach())})})
    return Message(content=content, reply_to=msg)


def client_app(mods=()) -> ClientApp:
    """The ClientApp: ``train`` behind ``mods`` (application-wide)."""
    app = ClientApp(mods=list(mods))
    app.train()(train)
    return app


def server_app(rounds: int, result: dict) -> ServerApp:
    """FedAvg over every client for ``rounds`` rounds; the final global state lands in ``result``."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=CLIENTS, min_available_nodes=CLIENTS)
        final = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=rounds)
        result["state"] = final.arrays.to_torch_state_dict()

    return app


def simulate(rounds: int, mods=()) -> dict:
    """Run the federation on ``CLIENTS`` simulated clients; the final global state."""
    result: dict = {}
    run_simulation(server_app=server_app(rounds, result), client_app=client_app(mods), num_supernodes=CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    return result["state"]


def first_client_data(context: Context, server_round: int):
    """Client 0's images, labels and the rows its round trained on, and None (not audited) on the
    other clients: auditing one client keeps the demo short."""
    if int(context.node_config["partition-id"]) != 0:
        return None
    images, labels = client_data(context)
    return images, labels, round_batch(context, server_round)


#: the client's training as the mod describes it: as it runs, and as one plain SGD step
TRAINING = {"momentum": {"local_steps": STEPS, "local_optimizer": f"sgd:momentum={MOMENTUM}"},
            "one-step": {"local_steps": 1, "local_optimizer": "sgd"}}


def audit_mod(out: str, audited=(1, 5, 20), localdp=None, training="momentum", **settings) -> AuditMod:
    """The gia-audit mod for this app: its model, client 0's data, the clients' defense and
    ``training``, a description of the client's training (:data:`TRAINING`)."""
    return AuditMod(rounds=audited, model=Net, data=first_client_data, defense=localdp or "none", local_lr=LR,
                    out=out, **TRAINING[training], **settings)


def main(argv=None) -> None:
    from audit.integrations.flower.job import read_status
    from audit.integrations.flower.rounds import round_folders
    from bench.docs_table import ROOT, add_docs_option, publish

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--audit-rounds", default="1,3")
    parser.add_argument("--budget", type=int, default=100)
    parser.add_argument("--attacks", default="auto")
    parser.add_argument("--localdp", default=None, metavar="C,S,EPS,DELTA",
                        help="the clients run LocalDpMod(clipping_norm, sensitivity, epsilon, delta)")
    parser.add_argument("--out", default="bench-out/flower-audit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    add_docs_option(parser, "docs/flower.md")
    args = parser.parse_args(argv)
    localdp = LocalDpMod(*map(float, args.localdp.split(","))) if args.localdp else None
    mods = [audit_mod(f"{args.out}/{training}", args.audit_rounds, localdp, training=training, budget=args.budget,
                      attacks=args.attacks, seed=args.seed, device=args.device) for training in TRAINING]
    start = time.perf_counter()
    simulate(args.rounds, mods + ([localdp] if localdp else []))
    federation = time.perf_counter() - start
    for training in TRAINING:
        wait_for_audits(f"{args.out}/{training}")
    waited = time.perf_counter() - start
    reports = {training: combine_rounds(f"{args.out}/{training}/partition-0") for training in TRAINING}
    for report in reports.values():
        print(report.summary())
    held = [read_status(f).get("prepared_s") or 0.0 for r in reports.values() for f in round_folders(r.out)]
    setting = (f"{args.rounds} rounds, {CLIENTS} clients, audited rounds {args.audit_rounds}, budget {args.budget}, "
               f"attacks {args.attacks}; the federation ran {federation:.0f} s, the mods held each audited round "
               f"{min(held):.2f}-{max(held):.2f} s, the audits (one torch thread each) were done {waited:.0f} s after "
               f"the federation started; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end, "
               f"torch {torch.__version__}")
    publish(args, "bench.flower_app", argv, _table(reports), setting)
    if args.docs:  # the per-round plot next to the table
        shutil.copyfile(reports["momentum"].out / "psnr_vs_step.png", ROOT / "docs" / f"{args.docs}-psnr_vs_round.png")


def _table(reports) -> str:
    from audit.report.control import POWER_ADVICE
    from audit.report.format import fmt, risk_text, verdict_text

    rows = ["| described training | round | fidelity (real reply vs replay) | worst-case PSNR (dB) | "
            "worst image PSNR (dB) | within delta (strongest attack) | epsilon spent (delta 1e-5) | verdict |",
            "|---|---:|---|---:|---:|---|---:|---|"]
    for training, report in reports.items():
        spent = {p["step"]: p["epsilon"] for p in report.data["privacy"].get("per_step", [])}
        fidelity = {r["round"]: (r.get("fidelity") or {}).get("summary", "n/a") for r in report.data["rounds"]}
        described = ", ".join(f"{k}={v}" for k, v in TRAINING[training].items())
        for step in report.steps:
            wc, eps = step["worst_case"], spent.get(step["step"])
            rows.append(f"| {described} | {step['step']} | {fidelity.get(step['step'], 'n/a')} | "
                        f"{fmt('psnr', wc['psnr'])} | {fmt('psnr', wc.get('psnr_max'))} | {risk_text(step['risk'])} | "
                        f"{'n/a' if eps is None else f'{eps:.3g}'} | "
                        f"{verdict_text(step['verdict']).replace('; ' + POWER_ADVICE, '')} |")
    overall = "; ".join(f"{t}: {r.data['verdict']['label']} ({r.data['status']})" for t, r in reports.items())
    advice = any(POWER_ADVICE in verdict_text(s["verdict"]) for r in reports.values() for s in r.steps)
    return "\n".join(rows) + f"\n\nOverall: {overall}." + (f" Where the attacks lack power: {POWER_ADVICE}." if advice else "")


if __name__ == "__main__":
    main()
