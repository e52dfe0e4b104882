"""The top floor: the audit itself, the sweep, the single-attack use case, utility and the
planner's report. The only place (with ``cli.py``) that imports ``defenses``, ``attacks`` and
``adaptive`` together; :mod:`audit.engine.compose` builds what an audit runs on (device, data
set, resolved defense, seeded and wrapped client model) once and hands it on."""
