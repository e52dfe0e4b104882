"""Adaptive attacks use only the declared defense protocol (audit.core.types), never a
built-in defense's class or attributes: a user's own PRECODE-style defense gets the latent
recovery attack, and a user's weighted low-rank defense gets the oblique projection."""
import torch
from torch import nn

import audit
from audit.core.models import last_linear
from audit.core.types import Defense, LatentBottleneck, clean_gradients, default_loss_fn

TINY = dict(model="mlp", model_args={"hidden": (32, 16)}, image_size=8, budget=5, utility=False, progress=False)


class MyBottleneck(nn.Module):
    """A user's variational bottleneck, written from scratch (not defenses.precode)."""

    def __init__(self, features: int, latent: int = 8):
        super().__init__()
        self.mu = nn.Linear(features, latent)
        self.log_sigma = nn.Linear(features, latent)
        self.decoder = nn.Linear(latent, features)
        self.fixed_latent = None
        self.generator = None

    def posterior(self, features):
        return self.mu(features), self.log_sigma(features).exp()

    def forward(self, x):
        mu, sigma = self.posterior(x)
        if self.fixed_latent is not None:
            b = self.fixed_latent
        else:  # no generator attached (evaluation): the mean draw
            noise = (torch.randn(mu.shape, generator=self.generator, device=mu.device)
                     if self.generator is not None else torch.zeros_like(mu))
            b = mu + sigma * noise
        return self.decoder(b)


class MyPrecode(Defense):
    """A user's architectural defense declaring its bottleneck through the protocol."""

    name = "my-precode"
    stochastic = True

    def wrap_model(self, model):
        if self.latent_bottlenecks(model):
            return model
        name, head = last_linear(model)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, nn.Sequential(MyBottleneck(head.in_features), head))
        return model

    def latent_bottlenecks(self, model):
        return [m for m in model.modules() if isinstance(m, MyBottleneck)]

    def __call__(self, model, inputs, labels, *, loss_fn=default_loss_fn, generator=None):
        necks = self.latent_bottlenecks(model)
        gen = generator if generator is not None else torch.Generator(device=inputs.device)
        for neck in necks:
            neck.generator = gen
        try:
            return clean_gradients(model, inputs, labels, loss_fn)
        finally:
            for neck in necks:
                neck.generator = None


def test_user_bottleneck_satisfies_the_declared_protocol():
    neck = MyBottleneck(4)
    # (isinstance on a runtime Protocol reads attributes statically since Python 3.12, which
    # misses nn.Module submodules; the protocol's members are checked directly)
    assert all(hasattr(neck, name) for name in ("decoder", "fixed_latent", "posterior"))
    assert isinstance(neck.decoder, nn.Linear) and callable(LatentBottleneck.posterior)


def test_audit_of_a_user_precode_runs_the_latent_recovery(tmp_path):
    report = audit.run(defense=MyPrecode(), steps=[0], attacks="auto", images=1, out=tmp_path, **TINY)
    ids = [a["id"] for a in report.data["attacks"]]
    assert "precode-latent" in ids
    latent = report.step(0)["attacks"]["precode-latent"]
    assert latent["status"] == "ok", latent  # not "not applicable"
    assert latent["psnr"] > 40  # the draw is recovered from the decoder gradient, the image in closed form
    assert report.psnr(0, "precode-latent") > report.psnr(0, "learned-inverter") + 10


def test_channel_weights_are_read_from_any_defense():
    from adaptive.svd_subspace import SVDSubspace
    from attacks import observe
    from audit.core.models import build_model
    from defenses import build_defense

    svd = build_defense("svdefense")

    class Mine(Defense):  # a user's low-rank defense reusing SVDefense's transform, weighting declared
        name = "mine"

        def transform(self, grads, *, generator=None, model=None):
            return svd.transform(grads, generator=generator, model=model)

        def channel_weights(self):
            return "square"

    model = build_model("cnn", (3, 8, 8), 4, seed=0)
    obs = observe(model, torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([1]),
                  Mine())
    notes = SVDSubspace().adapt(obs).notes
    assert notes["projection"].startswith("oblique, square")
