"""The top floor: the audit itself, the single-attack use case, utility and the planner's
report. The only place (with ``cli.py``) that imports ``defenses``, ``attacks`` and
``adaptive`` together, and the one place a defense is resolved and a model wrapped."""
