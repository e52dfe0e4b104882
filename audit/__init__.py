"""gia-audit: adversarial auditing of gradient-inversion defenses."""
__version__ = "0.1.0"
