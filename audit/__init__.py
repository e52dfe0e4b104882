"""gia-audit: adversarial auditing of gradient-inversion defenses."""
from audit.core import __version__  # noqa: F401


def __getattr__(name):
    # `audit.run(...)` without importing the attack stack when only the contracts are used
    if name == "run":
        from audit.engine.audit import run

        return run
    raise AttributeError(f"module 'audit' has no attribute {name!r}")
