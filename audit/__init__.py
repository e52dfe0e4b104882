"""gia-audit: adversarial auditing of gradient-inversion defenses."""
from audit.core import __version__  # noqa: F401


def __getattr__(name):
    # `audit.run(...)` / `audit.sweep(...)` without importing the attack stack when only the contracts are used
    if name == "run":
        from audit.engine.audit import run

        return run
    if name == "AuditConfig":
        from audit.engine.config import AuditConfig

        return AuditConfig
    if name == "sweep":
        from audit.engine.sweep import sweep

        return sweep
    raise AttributeError(f"module 'audit' has no attribute {name!r}")
