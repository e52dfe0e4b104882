"""The inversion network (sketched gradient -> images) and its training loop."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm


class InverterNet(nn.Module):
    """Standardise the sketched gradient, then an MLP decodes ``batch`` images in [0, 1].

    The feature mean / std are buffers fitted on the training pairs (:meth:`fit_scaler`),
    so the network is scale-free: sign compression (+-1) and a raw gradient (1e-4) train
    the same way.
    """

    def __init__(self, in_dim: int, out_shape: Sequence[int], hidden: int = 1024, depth: int = 2):
        super().__init__()
        self.out_shape = tuple(int(s) for s in out_shape)  # (batch, C, H, W)
        out_dim = 1
        for s in self.out_shape:
            out_dim *= s
        layers: List[nn.Module] = []
        prev = in_dim
        for _ in range(depth):
            layers += [nn.Linear(prev, hidden), nn.LayerNorm(hidden), nn.ReLU()]
            prev = hidden
        layers.append(nn.Linear(prev, out_dim))
        self.mlp = nn.Sequential(*layers)
        self.register_buffer("feat_mean", torch.zeros(in_dim))
        self.register_buffer("feat_std", torch.ones(in_dim))

    @torch.no_grad()
    def fit_scaler(self, features: Tensor) -> None:
        self.feat_mean.copy_(features.mean(0))
        std = features.std(0) if features.shape[0] > 1 else torch.ones_like(self.feat_std)
        self.feat_std.copy_(std.clamp_min(1e-12 + 1e-6 * float(std.max())))

    def forward(self, features: Tensor) -> Tensor:
        z = (features - self.feat_mean) / self.feat_std
        return torch.sigmoid(self.mlp(z)).view(features.shape[0], *self.out_shape)


def train_inverter(
    net: InverterNet,
    features: Tensor,
    targets: Tensor,
    steps: int,
    *,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    progress: bool = True,
    callback: Optional[Callable[[int, int, float], None]] = None,
    desc: str = "learned-inverter: training",
) -> List[float]:
    """Adam on the pixel MSE for ``steps`` mini-batches; returns the per-step losses.

    ``generator`` (on the CPU) draws the mini-batches, so the run is reproducible.
    ``progress`` shows a tqdm bar; ``callback(done, steps, loss)`` is called after each step.
    """
    opt = torch.optim.Adam(net.parameters(), lr=lr, foreach=True)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    n = features.shape[0]
    batch_size = min(batch_size, n)
    losses: List[float] = []
    order = torch.randperm(n, generator=generator)
    cursor = 0
    net.train()
    for step in tqdm(range(steps), desc=desc, disable=not progress, leave=False):
        if cursor + batch_size > n:
            order, cursor = torch.randperm(n, generator=generator), 0
        idx = order[cursor:cursor + batch_size].to(features.device)
        cursor += batch_size
        loss = nn.functional.mse_loss(net(features[idx]), targets[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if callback is not None:
            callback(step + 1, steps, losses[-1])
    net.eval()
    return losses


def init_inverter(in_dim: int, out_shape: Sequence[int], hidden: int, depth: int, seed: int,
                  device: Optional[torch.device] = None) -> InverterNet:
    """A freshly initialised inverter; ``seed`` fixes the weights (same on every device)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = InverterNet(in_dim, out_shape, hidden=hidden, depth=depth)
    return net.to(device) if device is not None else net
