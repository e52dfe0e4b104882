"""gia-audit: adversarial auditing of gradient-inversion defenses."""
__version__ = "0.1.0"


def __getattr__(name):
    # `audit.run(...)` without importing the attack stack when only the contracts are used
    if name == "run":
        from .engine import run

        return run
    raise AttributeError(f"module 'audit' has no attribute {name!r}")
