"""Audit a Flower federation from inside it: a client mod that audits the global model of
chosen rounds with the client's own data and defense (``docs/flower.md``).

>>> from audit.integrations.flower import AuditMod
>>> app = ClientApp(mods=[AuditMod(rounds=[1, 5, 20], model=Net, data=load_my_data, out="audits")])

Needs the ``[flower]`` extra: ``pip install "gia-audit[flower]"``.
"""
try:
    import flwr  # noqa: F401
except ImportError:
    raise ImportError('the Flower integration needs flwr: pip install "gia-audit[flower]"') from None

from audit.integrations.flower.defenses import flower_defense, is_flower_mod  # noqa: E402
from audit.integrations.flower.mod import AuditMod  # noqa: E402
from audit.integrations.flower.rounds import combine_rounds, wait_for_audits  # noqa: E402

__all__ = ["AuditMod", "combine_rounds", "flower_defense", "is_flower_mod", "wait_for_audits"]
