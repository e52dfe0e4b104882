"""Integrations with federated-learning frameworks: they drive :mod:`audit.engine` from inside
a federation. Each is an optional extra, imported only on use (``audit.integrations.flower``)."""
