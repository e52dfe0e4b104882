"""A small Flower app audited from inside: FedAvg over 2 clients on the embedded data, the
gia-audit client mod on its ClientApp (docs/flower.md).

    python bench/flower_app.py                                    # 20 rounds, rounds 1, 5, 20 audited
    python bench/flower_app.py --localdp 1,1,20,1e-5              # the clients run Flower's LocalDpMod
    python bench/flower_app.py --docs flower                      # ... and write the table into docs/flower.md
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch
from torch import nn
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from audit.core.data import load_dataset  # noqa: E402
from audit.integrations.flower import AuditMod, combine_rounds, wait_for_audits  # noqa: E402

LR, BATCH, CLIENTS = 0.1, 16, 2


class Net(nn.Module):
    """The deployment's model: a small CNN for 3x32x32 images in [0, 1], 10 classes."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(32 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.features(x))


def client_data(context: Context):
    """The client's own images and labels: its partition of the embedded train split."""
    data = load_dataset("embedded", size=32)
    part, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    return data.train_images[part::parts], data.train_labels[part::parts]


def train(msg: Message, context: Context) -> Message:
    """The client's round: one local SGD step on a batch of its data from the global model."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = client_data(context)
    seed = 1000 * int(context.node_config["partition-id"]) + int(msg.content["config"]["server-round"])
    pick = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:BATCH]
    loss = nn.functional.cross_entropy(model(images[pick]), labels[pick])
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
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


def first_client_data(context: Context):
    """Client 0's data, and None (not audited) on the other clients: auditing one client keeps the
    demo short; ``data=client_data`` audits every client."""
    return client_data(context) if int(context.node_config["partition-id"]) == 0 else None


def audit_mod(out: str, audited=(1, 5, 20), localdp=None, **settings) -> AuditMod:
    """The gia-audit mod for this app: its model, client 0's data and the clients' defense."""
    return AuditMod(rounds=audited, model=Net, data=first_client_data, defense=localdp or "none", lr=LR, out=out,
                    **settings)


def main(argv=None) -> None:
    from audit.integrations.flower.job import read_status
    from audit.integrations.flower.rounds import round_folders
    from bench.docs_table import ROOT, add_docs_option, publish

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--audit-rounds", default="1,5,20")
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--budget", type=int, default=200)
    parser.add_argument("--localdp", default=None, metavar="C,S,EPS,DELTA",
                        help="the clients run LocalDpMod(clipping_norm, sensitivity, epsilon, delta)")
    parser.add_argument("--out", default="bench-out/flower-audit")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    add_docs_option(parser, "docs/flower.md")
    args = parser.parse_args(argv)
    localdp = LocalDpMod(*map(float, args.localdp.split(","))) if args.localdp else None
    mod = audit_mod(args.out, args.audit_rounds, localdp, images=args.images, budget=args.budget, seed=args.seed,
                    device=args.device)
    start = time.perf_counter()
    simulate(args.rounds, [mod] + ([localdp] if localdp else []))
    federation = time.perf_counter() - start
    wait_for_audits(args.out)
    waited = time.perf_counter() - start
    report = combine_rounds(f"{args.out}/partition-0")
    print(report.summary())
    held = [read_status(f).get("prepared_s") for f in round_folders(report.out)]
    setting = (f"{args.rounds} rounds, {CLIENTS} clients, audited rounds {args.audit_rounds}; the federation ran "
               f"{federation:.0f} s, the mod held each audited round {min(held):.2f}-{max(held):.2f} s before "
               f"starting its audit, the audits (one torch thread each) were done {waited:.0f} s after the federation "
               f"started; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at the end, torch "
               f"{torch.__version__}")
    publish(args, "flower_app.py", argv, _table(report), setting)
    if args.docs:  # the per-round plot next to the table
        shutil.copyfile(report.out / "psnr_vs_step.png", ROOT / "docs" / f"{args.docs}-psnr_vs_round.png")


def _table(report) -> str:
    from audit.report.format import fmt, risk_text, verdict_text

    spent = {p["step"]: p["epsilon"] for p in report.data["privacy"].get("per_step", [])}
    rows = ["| round | worst-case PSNR (dB) | worst image PSNR (dB) | within delta (strongest attack) | "
            "epsilon spent (delta 1e-5) | verdict |", "|---:|---:|---:|---|---:|---|"]
    for step in report.steps:
        wc, eps = step["worst_case"], spent.get(step["step"])
        rows.append(f"| {step['step']} | {fmt('psnr', wc['psnr'])} | {fmt('psnr', wc.get('psnr_max'))} | "
                    f"{risk_text(step['risk'])} | {'n/a' if eps is None else f'{eps:.3g}'} | "
                    f"{verdict_text(step['verdict'])} |")
    return "\n".join(rows) + f"\n\nOverall: {report.data['verdict']['label']}; status: {report.data['status']}."


if __name__ == "__main__":
    main()
